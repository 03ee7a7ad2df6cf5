"""Structured output's request forms → one llguidance grammar (SamplingParams.grammar), checked here.

Accepted (docs/api.md, "Structured output"), at most one per request:

- OpenAI's `response_format`: `{"type": "text"}` (free), `{"type": "json_object"}` (any JSON object),
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`; TGI's forms of it too
  (`{"type": "json_object" | "json", "value": schema}`, `{"type": "regex", "value": ...}`);
- TGI's `grammar`: `{"type": "json" | "regex" | "json_schema", "value": ...}` (LMI's `parameters` too);
- vLLM's `guided_json` (a schema, or its text), `guided_regex`, `guided_choice` (a list of strings),
  `guided_grammar` (Lark, or GBNF / EBNF as llama.cpp and xgrammar write it), with
  `guided_whitespace_pattern` and `guided_decoding_backend` (auto, guidance, llguidance); and vLLM's
  newer `structured_outputs` object (`json`, `regex`, `choice`, `grammar`).

JSON is written compact (`{"a":1}`: no whitespace between tokens, so a model cannot spin in
whitespace) unless `guided_whitespace_pattern` says which whitespace to allow. A schema keyword the
grammar engine cannot enforce is a 400 naming it, unless the schema is marked not strict
(`"strict": false`), when it is ignored as OpenAI's non-strict mode allows.

The grammar is checked without the tokenizer here (llguidance's validate_grammar); the engine
compiles it against the tokenizer when the request arrives.
"""

from __future__ import annotations

import json

from handlers.errors import bad_request

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_FIELDS = frozenset(GUIDED_FIELDS + ("guided_whitespace_pattern", "guided_decoding_backend",
                                               "structured_outputs", "response_format", "grammar"))
BACKENDS = ("auto", "guidance", "llguidance")  # guided_decoding_backend values we serve (llguidance is ours)
MAX_CHOICES = 1024


def grammar_of(params: dict, where: str = "parameters.") -> str | None:
    """The request's grammar from whichever form it used (None: unconstrained); a 400 naming the field
    for a malformed one, two forms at once, or a grammar that does not compile."""
    forms = [name for name in ("response_format", "grammar", "structured_outputs") + GUIDED_FIELDS
             if params.get(name) is not None and not (name == "response_format" and _is_text(params[name]))]
    if not forms:
        return None
    if len(forms) > 1:
        raise bad_request(f"give one structured-output form, not {' and '.join(where + f for f in forms)}", forms[1])
    name = forms[0]
    backend = params.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise bad_request(f"\"{where}guided_decoding_backend\" {json.dumps(backend)} is not served here: this server "
                          f"constrains decoding with llguidance (give one of {', '.join(BACKENDS)}, or leave it out)",
                          "guided_decoding_backend")
    whitespace = params.get("guided_whitespace_pattern")
    if whitespace is not None and not isinstance(whitespace, str):
        raise bad_request(f"\"{where}guided_whitespace_pattern\" must be a regular expression (a string)",
                          "guided_whitespace_pattern")
    value = params[name]
    if name == "response_format":
        kind, spec = _response_format(value, where)
    elif name == "grammar":
        kind, spec = _tgi_grammar(value, f"{where}grammar")
    elif name == "structured_outputs":
        kind, spec = _structured_outputs(value, where)
    else:
        kind, spec = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                      "guided_grammar": "grammar"}[name], value
    strict = not (isinstance(value, dict) and (value.get("json_schema") or {}).get("strict") is False) \
        if name == "response_format" else True
    return compile_grammar(kind, spec, f"{where}{name}", whitespace, strict)


def compile_grammar(kind: str, spec, where: str, whitespace: str | None = None, strict: bool = True) -> str:
    """(json | regex | choice | grammar, its value) → llguidance's grammar text, validated."""
    import llguidance
    field = where.rsplit(".", 1)[-1]
    if kind == "json":
        schema = _schema(spec, where)
        options = {"whitespace_flexible": False} if whitespace is None else {"whitespace_pattern": whitespace}
        if not strict:
            options["lenient"] = True
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    elif kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise bad_request(f"\"{where}\" must be a regular expression (a non-empty string)", field)
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        if not isinstance(spec, list) or not spec or len(spec) > MAX_CHOICES or \
                not all(isinstance(c, str) and c for c in spec):
            raise bad_request(f"\"{where}\" must be a list of 1 to {MAX_CHOICES} non-empty strings", field)
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    elif kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise bad_request(f"\"{where}\" must be a grammar (Lark, or GBNF / EBNF) as a string", field)
        grammar = llguidance.LLMatcher.grammar_from_lark(_to_lark(spec, where, field))
    else:  # (the callers pass these four kinds only)
        raise AssertionError(kind)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"\"{where}\" cannot be enforced: {_first_line(error)}", field)
    return grammar


def json_schema_grammar(schema: dict) -> str:
    """A grammar for a schema built by the server (tools), compact JSON."""
    return compile_grammar("json", schema, "tools")


def _is_text(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "text" and set(value) == {"type"}


def _response_format(value, where: str) -> tuple[str, object]:
    w = f"{where}response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request(f"\"{w}\" must be an object with a \"type\" (text, json_object or json_schema)",
                          "response_format")
    kind = value["type"]
    if kind == "json_object" or kind == "json":  # OpenAI's (any object); TGI's with its schema in "value"
        schema = value.get("value", value.get("schema"))
        return "json", schema if schema is not None else {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "value" not in value:
            raise bad_request(f"\"{w}.json_schema\" must be an object with the \"schema\" (and a \"name\")",
                              "response_format")
        if spec is not None and spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
            raise bad_request(f"\"{w}.json_schema.strict\" must be true or false", "response_format")
        return "json", spec["schema"] if spec is not None and "schema" in spec else value["value"]
    if kind == "regex":
        return "regex", value.get("value")
    raise bad_request(f"\"{w}.type\" {json.dumps(kind)} is not one of text, json_object, json_schema",
                      "response_format")


def _tgi_grammar(value, where: str) -> tuple[str, object]:
    if not isinstance(value, dict) or value.get("type") not in ("json", "regex", "json_schema") or "value" not in value:
        raise bad_request(f"\"{where}\" must be {{\"type\": \"json\" | \"regex\" | \"json_schema\", \"value\": ...}}",
                          "grammar")
    if value["type"] == "json_schema":  # TGI 3: {"name": ..., "schema": {...}} as the value
        spec = value["value"]
        return "json", spec.get("schema") if isinstance(spec, dict) and "schema" in spec else spec
    return value["type"], value["value"]


def _structured_outputs(value, where: str) -> tuple[str, object]:
    w = f"{where}structured_outputs"
    kinds = [k for k in ("json", "regex", "choice", "grammar") if isinstance(value, dict) and value.get(k) is not None]
    if not isinstance(value, dict) or len(kinds) != 1 or set(value) - {"json", "regex", "choice", "grammar"}:
        raise bad_request(f"\"{w}\" must be an object with one of json, regex, choice, grammar", "structured_outputs")
    return kinds[0], value[kinds[0]]


def _schema(spec, where: str) -> dict:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise bad_request(f"\"{where}\" is not valid JSON: {exc}", where.rsplit(".", 1)[-1]) from None
    if isinstance(spec, bool):  # JSON Schema's true: anything
        spec = {} if spec else None
    if not isinstance(spec, dict):
        raise bad_request(f"\"{where}\" must be a JSON schema (an object)", where.rsplit(".", 1)[-1])
    return spec


def _to_lark(text: str, where: str, field: str) -> str:
    """Lark as it is; GBNF / EBNF (`rule ::= ...`, root first) converted."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark
    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # noqa: BLE001 — the converter's parse errors, of whatever type
        raise bad_request(f"\"{where}\" is not a grammar llguidance reads: {_first_line(str(exc))}", field) from None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"

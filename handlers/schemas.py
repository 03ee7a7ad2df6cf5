"""The LMI request schema: parse and validate a body into prompts and SamplingParams.

Every problem is a 400 that names the field; unknown parameters are logged and ignored. Limits are
checked before any expensive work: inputs per request and characters per input (tokenizing costs
about a microsecond a character), integers within 64 bits, finite numbers, valid Unicode.
Sampling values that are legal but numerically hopeless are normalised as vLLM does: a temperature
below 1e-5 means greedy, one below 1e-2 is raised to 1e-2, and a repetition penalty is held within
[1e-4, 1e4].
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace

from engines.protocol import Slo
from engines.sampling_params import SamplingParams
from handlers.errors import HttpError, bad_request
from handlers.structured import STRUCTURED_FIELDS, grammar_of

log = logging.getLogger(__name__)

MAX_TOP_N_TOKENS = 20
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS
MIN_TEMPERATURE = 1e-2  # vLLM raises smaller temperatures to this (NaN/inf otherwise)
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


@dataclass(frozen=True)
class RequestLimits:
    """Server settings `max_inputs_per_request` and `max_input_chars`."""

    max_inputs: int = 256
    max_input_chars: int = 1_000_000


@dataclass(frozen=True)
class GenerationRequest:
    inputs: list[str]
    is_list: bool  # "inputs" was a list (the answer then is a list too)
    sampling: SamplingParams
    stream: bool = False
    details: bool = False
    return_full_text: bool = False
    decoder_input_details: bool = False
    truncate: int | None = None  # keep only the last this many prompt tokens (TGI)
    stop_sequences: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()  # vLLM's: tokenized by Service.launch into sampling.bad_words_ids
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the text stays in it
    skip_special_tokens: bool = True  # vLLM's: special tokens (EOS, ...) left out of the text
    ignored_parameters: tuple[str, ...] = field(default=())
    adapters: tuple[str | None, ...] = ()  # each input's LoRA adapter (None: the base model); empty: all base
    slo: Slo = Slo()  # priority, tenant, how long it may wait to start (docs/scheduling.md)


def parse_body(raw: bytes, content_type: str | None) -> dict:
    """JSON object from the body; text/plain becomes {"inputs": text} (as DJL decodes it)."""
    mime = (content_type or "").split(";")[0].strip().lower()
    if mime == "text/plain":
        try:
            return {"inputs": raw.decode("utf-8")}
        except UnicodeDecodeError:
            raise bad_request("the text/plain body is not valid UTF-8") from None
    if not raw.strip():
        raise bad_request("the request body is empty; send JSON such as {\"inputs\": \"Hello\"}")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_type_name(body)}")
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_request(body: dict, *, default_max_new_tokens: int, limits: RequestLimits = RequestLimits(),
                  lora: bool = False) -> GenerationRequest:
    """lora: the engine serves LoRA adapters (option.enable_lora): their names pass to it, which answers an
    unknown one with a 404 naming those it serves; otherwise any adapter asked for is a 404 here."""
    if "messages" in body:
        raise bad_request("chat requests (\"messages\") are not supported by this engine; send \"inputs\"")
    if "inputs" not in body:
        raise bad_request("missing \"inputs\": send {\"inputs\": \"text\"} or {\"inputs\": [\"text\", ...]}")
    inputs, is_list = _inputs(body["inputs"], limits)
    params = body.get("parameters", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad_request(f"\"parameters\" must be a JSON object, not {_type_name(params)}")
    if lora:
        adapters = _adapter_names(body.get("adapters"), params.get("adapter_id"), len(inputs))
    else:
        _refuse_adapters(body.get("adapters"), "adapters")  # DJL LMI's field, beside "inputs"
        _refuse_adapters(params.get("adapter_id"), "parameters.adapter_id")  # TGI's
        adapters = ()
    stream = _bool(body, "stream", False, where="")
    if params.get("stream") is not None:
        stream = _bool(params, "stream", False)
    req = _build(inputs, is_list, params, stream, default_max_new_tokens)
    return replace(req, adapters=adapters) if adapters else req


def _adapter_names(adapters, adapter_id, num_inputs: int) -> tuple[str | None, ...]:
    """Each input's adapter: LMI's "adapters" (one name for every input, or a list matching "inputs") or
    TGI's adapter_id (one name); "" and null mean the base model. → () when every input is the base's."""
    if adapters not in (None, "", []) and adapter_id not in (None, ""):
        raise bad_request("give the adapter as \"adapters\" or as \"parameters.adapter_id\", not both", "adapters")
    where, value = ("parameters.adapter_id", adapter_id) if adapter_id not in (None, "") else ("adapters", adapters)
    if value in (None, "", []):
        return ()
    if isinstance(value, str):
        names = [value] * num_inputs
    elif isinstance(value, list) and where == "adapters":
        if len(value) != num_inputs:
            raise bad_request(f"\"adapters\" holds {len(value)} names for {num_inputs} inputs: give one name, or "
                              "one per input", "adapters")
        names = value
    else:
        raise bad_request(f"\"{where}\" must be an adapter's name{' or a list of them' if where == 'adapters' else ''},"
                          f" not {_type_name(value)}", where)
    for i, name in enumerate(names):
        if name is not None and not isinstance(name, str):
            raise bad_request(f"\"{where}\"[{i}] must be an adapter's name or null, not {_type_name(name)}", where)
    names = [name or None for name in names]
    return tuple(names) if any(names) else ()


def _refuse_adapters(value, where: str) -> None:
    """A request for a LoRA adapter where none is served (option.enable_lora off): a 404 naming it, never
    the base model's answer under the adapter's name. An empty value asks for the base model."""
    if value in (None, "", []):
        return
    names = value if isinstance(value, list) else [value]
    shown = ", ".join(json.dumps(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    raise HttpError(404, f"\"{where}\": no LoRA adapter named {shown}: this server serves the base model only "
                         "(adapters are served with option.enable_lora); send the request without it", param=where)


def _inputs(value, limits: RequestLimits) -> tuple[list[str], bool]:
    if isinstance(value, str):
        _check_text(value, "\"inputs\"", limits)
        return [value], False
    if isinstance(value, list):
        if not value:
            raise bad_request("\"inputs\" is an empty list; send at least one string")
        if len(value) > limits.max_inputs:
            raise bad_request(f"\"inputs\" holds {len(value)} prompts: at most {limits.max_inputs} are allowed "
                              "per request (max_inputs_per_request)")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise bad_request(f"\"inputs\"[{i}] must be a string, not {_type_name(item)}")
            _check_text(item, f"\"inputs\"[{i}]", limits)
        return list(value), True
    raise bad_request(f"\"inputs\" must be a string or a list of strings, not {_type_name(value)}")


def _check_text(text: str, where: str, limits: RequestLimits | None = None) -> None:
    if limits is not None and len(text) > limits.max_input_chars:
        raise bad_request(f"{where} has {len(text)} characters: at most {limits.max_input_chars} are allowed "
                          "(max_input_chars)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{where} is not valid Unicode: a lone surrogate at character {exc.start}") from None


_KNOWN = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
          "stop_sequences", "stop", "ignore_eos", "ignore_eos_token", "details", "return_full_text",
          "decoder_input_details", "top_n_tokens", "stop_token_ids", "stream", "presence_penalty",
          "frequency_penalty", "truncate", "min_p", "adapter_id",  # adapter_id: refused unless empty (_refuse_adapters)
          "logit_bias", "min_tokens", "min_new_tokens", "include_stop_str_in_output", "skip_special_tokens",
          "bad_words", "typical_p", "priority", "timeout"} | STRUCTURED_FIELDS


# Parameters LMI, TGI or vLLM define that we do not implement, with the value that changes nothing
# (accepted); any other value is a 400 naming the parameter, never a 200 that silently ignored it.
UNSUPPORTED = {"n": 1, "best_of": 1, "num_beams": 1,
               "watermark": False, "logprobs": None, "prompt_logprobs": None,
               "length_penalty": 1.0, "early_stopping": False, "spaces_between_special_tokens": True,
               "use_beam_search": False,
               "adapters": None}


# Why (docs/decisions.md), said in the 400.
_BEAM_SEARCH = ("beam search is not built: requests decode greedily or sample, one sequence each (vLLM too took "
                "beam search out of its engine core); ask for several candidates with the OpenAI routes' n or best_of")
WHY_UNSUPPORTED = {
    "num_beams": _BEAM_SEARCH, "use_beam_search": _BEAM_SEARCH, "length_penalty": _BEAM_SEARCH,
    "early_stopping": _BEAM_SEARCH,
    "n": "several choices per prompt are the OpenAI routes' n", "best_of": "ranked choices are /v1/completions' best_of",
    "watermark": "watermarking is not built",
    "spaces_between_special_tokens": "special tokens are written as the tokenizer decodes them",
}


def _refuse_unsupported(params: dict) -> None:
    for name, harmless in UNSUPPORTED.items():
        value = params.get(name)
        if value is not None and value != harmless and value not in ({}, []):
            why = f": {WHY_UNSUPPORTED[name]}" if name in WHY_UNSUPPORTED else ""
            raise bad_request(f"\"parameters.{name}\" is not supported by lmi-serve (only {json.dumps(harmless)}){why}; "
                              "remove it", name)


def _build(inputs, is_list, params: dict, stream: bool, default_max_new_tokens: int) -> GenerationRequest:
    _refuse_unsupported(params)
    ignored = tuple(sorted(k for k in params if k not in _KNOWN and k not in UNSUPPORTED))
    details = _bool(params, "details", False)
    decoder_input_details = _bool(params, "decoder_input_details", False)
    if decoder_input_details and stream:  # as TGI and DJL: the prompt's details come with the whole answer
        raise bad_request("\"parameters.decoder_input_details\" cannot be used with streaming", "decoder_input_details")
    sampling = sampling_params(
        params, do_sample=_bool(params, "do_sample", False),
        max_new_tokens=_int(params, "max_new_tokens", default_max_new_tokens, minimum=1),
        ignore_eos=_bool(params, "ignore_eos", False) or _bool(params, "ignore_eos_token", False),
        top_n_tokens=_int(params, "top_n_tokens", 0, minimum=0, maximum=MAX_TOP_N_TOKENS),
        prompt_logprobs=details and decoder_input_details)  # the prompt's log-probs appear in details only
    return GenerationRequest(
        inputs=inputs, is_list=is_list, sampling=sampling, stream=stream,
        details=details, return_full_text=_bool(params, "return_full_text", False),
        decoder_input_details=decoder_input_details, truncate=_int(params, "truncate", None, minimum=1),
        stop_sequences=_stop_sequences(params), ignored_parameters=ignored, slo=slo_of(params),
        **text_options(params))


MAX_TIMEOUT_S = 86400.0


def slo_of(params: dict, where: str = "parameters.", timeout: bool = True) -> Slo:
    """A request's `priority` (vLLM's: lower first) and `timeout` (seconds within which it must start:
    LMI's parameters.timeout), checked; the tenant comes from a header (Service.launch)."""
    priority = _int(params, "priority", 0, minimum=-INT32_MAX, maximum=INT32_MAX, where=where)
    seconds = _number(params, "timeout", None, minimum=0.0, maximum=MAX_TIMEOUT_S, open_low=True,
                      where=where) if timeout else None
    return Slo(priority, "", None if seconds is None else seconds * 1000.0)


def text_options(params: dict, where: str = "parameters.") -> dict:
    """How the generated tokens become text (vLLM's options, every route)."""
    return {"include_stop_str_in_output": _bool(params, "include_stop_str_in_output", False, where=where),
            "skip_special_tokens": _bool(params, "skip_special_tokens", True, where=where),
            "bad_words": _bad_words(params, where)}


MAX_BAD_WORDS = 256


def _bad_words(params: dict, where: str) -> tuple[str, ...]:
    value = params.get("bad_words")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value) or \
            len(value) > MAX_BAD_WORDS:
        raise bad_request(f"\"{where}bad_words\" must be a list of at most {MAX_BAD_WORDS} non-empty strings",
                          "bad_words")
    return tuple(value)


def sampling_params(params: dict, *, do_sample: bool, max_new_tokens: int, ignore_eos: bool, top_n_tokens: int,
                    prompt_logprobs: bool = False, where: str = "parameters.") -> SamplingParams:
    """The sampling fields every route shares (temperature, top_k, top_p, penalties, seed, stop ids),
    validated and normalised; the route decides do_sample, max_new_tokens and top_n_tokens."""
    temperature = _number(params, "temperature", 1.0, minimum=0.0, where=where)
    top_k = _int(params, "top_k", 0, minimum=-1, maximum=INT32_MAX, where=where)
    top_p = _number(params, "top_p", 1.0, minimum=0.0, maximum=1.0, open_low=True, where=where)
    penalty = _number(params, "repetition_penalty", 1.0, minimum=0.0, open_low=True, where=where)
    is_greedy = not do_sample or temperature < GREEDY_BELOW_TEMPERATURE  # temperature 0: greedy (vLLM, TGI)
    return SamplingParams(
        max_new_tokens=max_new_tokens, do_sample=not is_greedy,
        temperature=1.0 if is_greedy else max(temperature, MIN_TEMPERATURE),
        top_k=max(top_k, 0), top_p=top_p,
        min_p=_number(params, "min_p", 0.0, minimum=0.0, maximum=1.0, where=where),
        typical_p=_number(params, "typical_p", 1.0, minimum=0.0, maximum=1.0, open_low=True, where=where),
        repetition_penalty=min(max(penalty, REPETITION_PENALTY_RANGE[0]), REPETITION_PENALTY_RANGE[1]),
        presence_penalty=_number(params, "presence_penalty", 0.0, minimum=-2.0, maximum=2.0, where=where),
        frequency_penalty=_number(params, "frequency_penalty", 0.0, minimum=-2.0, maximum=2.0, where=where),
        seed=_int(params, "seed", None, minimum=0, where=where), ignore_eos=ignore_eos,
        stop_token_ids=tuple(_int_list(params, "stop_token_ids", where=where)), top_n_tokens=top_n_tokens,
        prompt_logprobs=prompt_logprobs, logit_bias=_logit_bias(params, where),
        min_tokens=_min_tokens(params, max_new_tokens, where), grammar=grammar_of(params, where))


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]


def _logit_bias(params: dict, where: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {token id (a string in JSON, or an int): bias in [-100, 100]} → sorted pairs."""
    value = params.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request(f"\"{where}logit_bias\" must be an object mapping token ids to biases, not "
                          f"{_type_name(value)}", "logit_bias")
    pairs = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or str(token) != str(key).strip():
            raise bad_request(f"\"{where}logit_bias\" keys must be token ids (non-negative integers), not "
                              f"{json.dumps(key)}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"\"{where}logit_bias\" values must be numbers in [-100, 100], not {json.dumps(bias)} "
                              f"(token {token})", "logit_bias")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _min_tokens(params: dict, max_new_tokens: int, where: str) -> int:
    """vLLM's min_tokens (HF's min_new_tokens): at most max_new_tokens."""
    if params.get("min_tokens") is not None and params.get("min_new_tokens") is not None and \
            params["min_tokens"] != params["min_new_tokens"]:
        raise bad_request(f"give \"{where}min_tokens\" or \"{where}min_new_tokens\", not both", "min_tokens")
    name = "min_new_tokens" if params.get("min_new_tokens") is not None else "min_tokens"
    value = _int(params, name, 0, minimum=0, where=where)
    if value > max_new_tokens:
        raise bad_request(f"\"{where}{name}\" ({value}) must not exceed the maximum number of new tokens "
                          f"({max_new_tokens})", name)
    return value


def _bool(params: dict, name: str, default, where: str = "parameters."):
    value = params.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"\"{where}{name}\" must be true or false, not {json.dumps(value)}", name)
    return value


def _int(params: dict, name: str, default, *, minimum=-INT64_MAX - 1, maximum=INT64_MAX, where="parameters."):
    value = params.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and abs(value) <= INT64_MAX:
            value = int(value)
        else:
            raise bad_request(f"\"{where}{name}\" must be an integer, not {json.dumps(value)}", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"\"{where}{name}\" must be >= {minimum}, not {value}", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"\"{where}{name}\" must be <= {maximum}, not {value}", name)
    return value


def _number(params: dict, name: str, default, *, minimum=None, maximum=None, open_low=False, where="parameters."):
    value = params.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"\"{where}{name}\" must be a number, not {json.dumps(value)}", name)
    try:
        value = float(value)  # an integer beyond a double's range overflows here
    except OverflowError:
        value = float("inf")
    if value != value or value in (float("inf"), float("-inf")):
        raise bad_request(f"\"{where}{name}\" must be a finite number", name)
    if minimum is not None and (value < minimum or (open_low and value == minimum)):
        op = ">" if open_low else ">="
        raise bad_request(f"\"{where}{name}\" must be {op} {minimum}, not {value}", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"\"{where}{name}\" must be <= {maximum}, not {value}", name)
    return value


def _int_list(params: dict, name: str, where="parameters.") -> list[int]:
    value = params.get(name) or []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= INT32_MAX
                                          for v in value):
        raise bad_request(f"\"{where}{name}\" must be a list of token ids (integers in [0, {INT32_MAX}])", name)
    return value


def _stop_sequences(params: dict, name: str = "stop_sequences", where="parameters.") -> tuple[str, ...]:
    value = params.get(name, params.get("stop"))
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise bad_request(f"\"{where}{name}\" must be a string or a list of non-empty strings", name)
    for v in value:
        _check_text(v, f"\"{where}{name}\"")
    return tuple(value)


def _type_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)

"""A reader for Java `.properties` files, the syntax of DJL's `serving.properties`.

What it accepts (java.util.Properties.load):
- `#` and `!` start a comment line (after leading white space);
- `key=value`, `key: value`, or `key value` (the first unescaped `=`, `:` or white space ends the
  key); white space around the separator and leading white space of the value are dropped;
- a line ending in an odd number of backslashes continues on the next line, whose leading white
  space is dropped;
- escapes `\\t \\n \\r \\f \\\\ \\uXXXX`, and `\\` before any other character keeps that character.

One difference from Java, on purpose: trailing white space of a value is trimmed as well, so that
`engine=MPI ` selects MPI (DJL fails on it, see djl-serving#1351).
"""

from __future__ import annotations

import re

_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
_SEPARATORS = "=: \t\f"
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # Java's line terminators only (not str.splitlines' set)


class PropertiesError(ValueError):
    """A malformed properties file (bad \\u escape), with the line number."""


def parse_properties(text: str) -> dict[str, str]:
    """Parse properties text into an ordered dict; a later key replaces an earlier one."""
    result: dict[str, str] = {}
    for lineno, logical in _logical_lines(text):
        key, value = _split_key_value(logical)
        try:
            result[_unescape(key)] = _unescape(value).strip()
        except PropertiesError as exc:
            raise PropertiesError(f"line {lineno}: {exc}") from None
    return result


def read_properties(path: str) -> dict[str, str]:
    with open(path, encoding="utf-8") as f:
        return parse_properties(f.read())


def _logical_lines(text: str):
    """Yield (first physical line number, logical line) with continuations joined."""
    buf: list[str] = []
    start = 0
    for lineno, raw in enumerate(_LINE_BREAK.split(text), start=1):
        line = raw.lstrip(" \t\f")
        if not buf:
            if not line or line[0] in "#!":
                continue
            start = lineno
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:
            buf.append(line[:-1])
            continue
        buf.append(line)
        yield start, "".join(buf)
        buf = []
    if buf:
        yield start, "".join(buf)


def _split_key_value(line: str) -> tuple[str, str]:
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "\\":
            i += 2
            continue
        if ch in _SEPARATORS:
            break
        i += 1
    key, rest = line[:i], line[i:]
    rest = rest.lstrip(" \t\f")
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(" \t\f")
    return key, rest


def _unescape(s: str) -> str:
    if "\\" not in s:
        return s
    out: list[str] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if ch != "\\" or i + 1 >= len(s):
            out.append(ch)
            i += 1
            continue
        nxt = s[i + 1]
        if nxt == "u":
            digits = s[i + 2 : i + 6]
            if len(digits) != 4 or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise PropertiesError(f"malformed \\u escape {s[i:i + 6]!r}")
            out.append(chr(int(digits, 16)))
            i += 6
            continue
        out.append(_ESCAPES.get(nxt, nxt))
        i += 2
    return "".join(out)


# vLLM engine-argument names that are not `option.<name>` here (the rest are, or are aliases of ours)
_VLLM_NAMES = {"model": "option.model_id", "tensor_parallel_size": "option.tensor_parallel_degree",
               "revision": "option.revision"}


def read_vllm_yaml(path: str) -> dict[str, str]:
    """A vLLM-style YAML config (`vllm serve --config FILE`): a flat mapping of engine arguments,
    `max-num-seqs: 64` or `max_num_seqs: 64`, mapped to our keys (`model` → option.model_id,
    `tensor-parallel-size` → option.tensor_parallel_degree, anything else → option.<name>, where
    vLLM's spellings are aliases of ours). Values become the strings a properties file would hold."""
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise PropertiesError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PropertiesError(f"{path}: a vLLM config is a mapping of engine arguments, not a {type(data).__name__}")
    result: dict[str, str] = {}
    for name, value in data.items():
        key = str(name).strip().replace("-", "_")
        if isinstance(value, (dict, list)):
            if key == "served_model_name" and isinstance(value, list) and len(value) == 1:
                value = value[0]
            else:
                raise PropertiesError(f"{path}: {name}: only single values are supported, not a {type(value).__name__}")
        text = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        result[_VLLM_NAMES.get(key, key if key.startswith("option.") else f"option.{key}")] = text
    return result

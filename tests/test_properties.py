"""Table-driven tests of container.properties (java.util.Properties.load syntax, plus value trimming)."""

from __future__ import annotations

import pytest

from container.properties import PropertiesError, parse_properties, read_properties

# (text, expected dict); ids are short names of the rule being checked.
CASES = [
    # comments
    pytest.param("# a comment\na=1", {"a": "1"}, id="hash-comment"),
    pytest.param("! a comment\na=1", {"a": "1"}, id="bang-comment"),
    pytest.param("   # indented\n\t! tabbed\n  a=1", {"a": "1"}, id="indented-comments"),
    pytest.param("a=1 # not a comment", {"a": "1 # not a comment"}, id="hash-inside-value"),
    pytest.param("#a=1\n!b=2", {}, id="only-comments"),
    # separators
    pytest.param("a=1", {"a": "1"}, id="equals"),
    pytest.param("a:1", {"a": "1"}, id="colon"),
    pytest.param("a 1", {"a": "1"}, id="space-sep"),
    pytest.param("a\t1", {"a": "1"}, id="tab-sep"),
    pytest.param("a   =   1", {"a": "1"}, id="spaces-around-equals"),
    pytest.param("a\t:\t1", {"a": "1"}, id="tabs-around-colon"),
    pytest.param("a = = b", {"a": "= b"}, id="second-equals-is-value"),
    pytest.param("a=b:c=d", {"a": "b:c=d"}, id="separators-in-value"),
    pytest.param("a\fb", {"a": "b"}, id="formfeed-sep"),
    # trimming and empty values
    pytest.param("engine=MPI ", {"engine": "MPI"}, id="trailing-space"),
    pytest.param("engine=MPI \t  ", {"engine": "MPI"}, id="trailing-mixed-ws"),
    pytest.param("a=    x", {"a": "x"}, id="leading-value-ws"),
    pytest.param("key=", {"key": ""}, id="empty-value"),
    pytest.param("key =   ", {"key": ""}, id="empty-value-ws"),
    pytest.param("flag", {"flag": ""}, id="key-no-value"),
    pytest.param("flag   \nb=2", {"flag": "", "b": "2"}, id="key-no-value-ws"),
    # continuations
    pytest.param("a=1,\\\n   2", {"a": "1,2"}, id="continuation"),
    pytest.param("a=1,\\\n  2,\\\n\t3\nb=4", {"a": "1,2,3", "b": "4"}, id="continuation-twice"),
    pytest.param("a=1,\\\n#2", {"a": "1,#2"}, id="continuation-hash-is-value"),
    pytest.param("a=1\\", {"a": "1"}, id="continuation-at-eof"),
    pytest.param("a=x\\\\\nb=2", {"a": "x\\", "b": "2"}, id="even-backslashes"),
    pytest.param("a=x\\\\\\\\\nb=2", {"a": "x\\\\", "b": "2"}, id="four-backslashes"),
    pytest.param("a=x\\\\\\\n  y", {"a": "x\\y"}, id="odd-backslashes"),
    pytest.param("long\\\n  key=v", {"longkey": "v"}, id="continuation-in-key"),
    # escapes
    pytest.param("a=x\\ty\\nz", {"a": "x\ty\nz"}, id="tab-newline-escapes"),
    pytest.param("a=x\\ry\\fz", {"a": "x\ry\fz"}, id="cr-ff-escapes"),
    pytest.param("a=back\\\\slash", {"a": "back\\slash"}, id="escaped-backslash"),
    pytest.param("a=\\u0041BC", {"a": "ABC"}, id="unicode-escape"),
    pytest.param("a=\\u00e9\\u6a21", {"a": "\u00e9\u6a21"}, id="unicode-escape-nonascii"),
    pytest.param("a\\=b=c", {"a=b": "c"}, id="escaped-equals-key"),
    pytest.param("a\\:b:c", {"a:b": "c"}, id="escaped-colon-key"),
    pytest.param("my\\ key=v", {"my key": "v"}, id="escaped-space-key"),
    pytest.param("url=s3\\://bucket/x", {"url": "s3://bucket/x"}, id="escaped-colon-value"),
    pytest.param("a=\\q\\z", {"a": "qz"}, id="unknown-escape-keeps-char"),
    # duplicates, blank lines, line endings
    pytest.param("a=1\nb=2\na=3", {"a": "3", "b": "2"}, id="later-duplicate-wins"),
    pytest.param("\n\n   \n\t\na=1\n\n", {"a": "1"}, id="blank-lines"),
    pytest.param("a=1\r\nb=2\r\n", {"a": "1", "b": "2"}, id="crlf"),
    pytest.param("a=1,\\\r\n   2\r\nb=3\r\n", {"a": "1,2", "b": "3"}, id="crlf-continuation"),
    pytest.param("a=1\rb=2", {"a": "1", "b": "2"}, id="cr-only"),
    pytest.param("engine=MPI \r\n", {"engine": "MPI"}, id="crlf-trailing-space"),
    # unicode
    pytest.param("name=模型 é ü", {"name": "模型 é ü"}, id="unicode-value"),
    pytest.param("clé=värde", {"clé": "värde"}, id="unicode-key"),
    pytest.param("a=x\u2028y", {"a": "x\u2028y"}, id="u2028-in-value"),
    # a realistic file
    pytest.param(
        "# LMI\nengine=MPI\noption.model_id = s3://bucket/llama/\noption.tensor_parallel_degree: max\n"
        "option.rolling_batch lmi-dist\n",
        {"engine": "MPI", "option.model_id": "s3://bucket/llama/", "option.tensor_parallel_degree": "max",
         "option.rolling_batch": "lmi-dist"},
        id="realistic"),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_parse_properties(text: str, expected: dict[str, str]) -> None:
    assert parse_properties(text) == expected


def test_later_duplicate_wins_keeps_first_position() -> None:
    assert list(parse_properties("a=1\nb=2\na=3")) == ["a", "b"]


@pytest.mark.parametrize("text, line", [
    pytest.param("a=1\n\nb=\\u12", 3, id="short-u-escape-value"),
    pytest.param("# c\nk\\u00G1=v", 2, id="bad-hex-in-key"),
    pytest.param("a=1\nb=x,\\\n  \\u12zz", 2, id="continued-line-number"),
    pytest.param("b=\\u", 1, id="bare-u"),
])
def test_malformed_unicode_escape(text: str, line: int) -> None:
    with pytest.raises(PropertiesError, match=rf"^line {line}: .*\\u"):
        parse_properties(text)


def test_properties_error_is_value_error() -> None:
    assert issubclass(PropertiesError, ValueError)


def test_read_properties_crlf_file(tmp_path) -> None:
    path = tmp_path / "serving.properties"
    path.write_bytes("engine=MPI \r\noption.name=模型\r\noption.list=a,\\\r\n  b\r\n".encode("utf-8"))
    assert read_properties(str(path)) == {"engine": "MPI", "option.name": "模型", "option.list": "a,b"}

"""Incremental detokenization never splits a character and adds up to the whole decode."""

from __future__ import annotations

import pytest

from handlers.tokenizer import IncrementalDetokenizer, TextTokenizer

TEXTS = ["The river ran quietly past the old mill.", "Café crème, naïve façade — ünïcödé ✓",
         "emoji 🚀🔥 and 中文字符 mixed in", "numbers 12, 256, 1024 and 3.14", "  leading and  double  spaces"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return TextTokenizer(str(tiny_model))


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_text_and_never_hold_broken_characters(tok, text):
    ids = tok.encode(text)[1:]  # drop <s>
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_are_split_across_tokens_by_byte_level_bpe(tok):
    # the premise of the test above: at least one character spans several tokens
    ids = tok.encode("🚀")[1:]
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids][:-1] == [""] * (len(ids) - 1)


def test_encode_adds_bos_and_decode_skips_special_tokens(tok):
    ids = tok.encode("hello")
    assert ids[0] == 1  # <s>
    assert tok.decode(ids + [tok.eos_token_id]) == "hello"
    assert tok.eos_token_id == 2


def test_an_incomplete_character_at_the_end_is_flushed(tok):
    ids = tok.encode("ok 🚀")[1:]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids[:-1]]  # generation ends inside the emoji
    tail = detok.flush()
    assert "".join(deltas) + tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")
    assert detok.flush() == ""


def test_stop_strings_see_the_same_text_token_by_token(tok):
    from handlers.generation import StopFilter

    text = "Café crème and 🚀 then STOP here"
    ids = tok.encode(text)[1:]
    detok, stops = IncrementalDetokenizer(tok), StopFilter(("STOP",))
    out, stopped = [], False
    for i in ids:
        piece, stopped = stops.feed(detok.add(i))
        out.append(piece)
        if stopped:
            break
    assert stopped and "".join(out) == "Café crème and 🚀 then "

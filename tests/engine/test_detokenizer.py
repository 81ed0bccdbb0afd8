"""Incremental text and stop strings, with a byte-level tokenizer: multi-byte characters are
emitted whole, and a stop string split over tokens is caught and cut."""

from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama[0]))


def _stream(tokenizer, text, stop=()):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer, [1], tuple(stop))
    pieces, stopped = [], False
    for token in ids:
        piece, stopped = detok.push(token)
        pieces.append(piece)
        if stopped:
            break
    else:
        pieces.append(detok.flush())
    return pieces, stopped, detok.text


def test_multibyte_characters_come_out_whole(tokenizer):
    pieces, stopped, text = _stream(tokenizer, "héllo wörld ✓ 日本")
    assert "".join(pieces) == text == "héllo wörld ✓ 日本" and not stopped
    assert all("\ufffd" not in p for p in pieces)
    assert "日" in pieces and "✓" in pieces  # 3-byte characters emitted once complete


def test_stop_string_split_over_tokens_is_cut(tokenizer):
    pieces, stopped, text = _stream(tokenizer, "Hello there. END of it", stop=["END", "xyz"])
    assert stopped and text == "Hello there. " and "".join(pieces) == text
    assert "E" not in "".join(pieces)  # held back while it could still become "END"


def test_engine_applies_stop_strings(tiny_llama):
    llm = LLM(tiny_llama[0], device="cpu")
    free = llm.generate(["Hi"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert free.text  # the byte tokenizer decodes whatever the random model says
    stop = free.text[3:5]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], ignore_eos=True)
    out = llm.generate(["Hi"], params)[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.find(stop)]

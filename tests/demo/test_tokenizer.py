"""The demo tokenizer: byte-level (any UTF-8 round-trips, nothing is unknown), bos on plain
encodes, the chat template, and the same tokenizer from the same corpus."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from loraplex.demo.demo_tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    ROLE_TOKENS,
    VOCAB_SIZE,
    save_tokenizer,
    train_tokenizer,
)

TEXTS = ["How do I make a cup of tea?", "Arr, matey! Boil yer water.", "Certainly, sir."] * 3


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets.model_dir)


def _random_text(rng: random.Random, length: int) -> str:
    ranges = [(0x20, 0x7E), (0x09, 0x0A), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
              (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0xAC00, 0xD7A3)]
    chars = []
    for _ in range(length):
        low, high = rng.choice(ranges)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


def test_any_utf8_round_trips(tokenizer):
    rng = random.Random(0)
    samples = [_random_text(rng, rng.randint(1, 80)) for _ in range(200)]
    samples += ["", " ", "  two  spaces ", "\n\n", "naïve café, 日本語, 🙂🚀, Ωμέγα, \x00\x7f"]
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert all(0 <= i < len(tokenizer) for i in ids)
        assert tokenizer.decode(ids) == text


def test_nothing_is_unknown(tokenizer):
    assert tokenizer.unk_token_id is None
    assert len(tokenizer) <= VOCAB_SIZE
    ids = tokenizer("\U0010FFFF zzqx \u200b", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "\U0010FFFF zzqx \u200b"


def test_plain_encode_starts_with_bos(tokenizer):
    ids = tokenizer("Hello")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello"


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tea?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    system, user, assistant = ROLE_TOKENS
    assert text == (f"{BOS_TOKEN}{system}Be brief.{EOS_TOKEN}{user}Hi{EOS_TOKEN}"
                    f"{assistant}Hello!{EOS_TOKEN}{user}Tea?{EOS_TOKEN}{assistant}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == assistant
    assert ids.count(tokenizer.eos_token_id) == 4
    with pytest.raises(Exception, match="roles"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_training_is_deterministic(tmp_path):
    first, second = train_tokenizer(TEXTS), train_tokenizer(TEXTS)
    assert first.to_str() == second.to_str()
    save_tokenizer(first, tmp_path, model_max_length=128)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.model_max_length == 128
    assert loaded.decode(loaded("Boil yer tea")["input_ids"], skip_special_tokens=True) == (
        "Boil yer tea")

"""Incremental detokenization and stop strings. Text is emitted only once it is stable: a
multi-byte character split over tokens waits for its last byte, and text that could be the
start of a stop string is held back until it is known not to be."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Prompt tokens decoded ahead of the output so that the first output token is decoded in
# context (SentencePiece drops a leading space on a token decoded alone).
_CONTEXT_TOKENS = 4


def fast_decode(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, through the Rust tokenizer straight when
    that is all transformers would do (a fast tokenizer without clean-up of spaces): it skips
    transformers' conversion of the ids, one Python step an id, which took 9% of the engine
    thread's time under the GIL in the H200 serving pass."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self._decode = fast_decode(tokenizer)
        self._before: str | None = None  # the decoded text of _ids[_prefix:_read]
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        """All stable text so far (including text held back from the caller)."""
        self._emitted = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (new text for the caller, whether a stop string ended it)."""
        self._ids.append(token_id)
        if self._before is None:
            self._before = self._decode(self._ids[self._prefix:self._read])
        before, after = self._before, self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
            self._before = None
        return self._emit()

    def _emit(self) -> tuple[str, bool]:
        if self._stop:
            window_start = max(0, self._emitted - self._hold)
            cut = min((i for i in (self.text.find(s, window_start) for s in self._stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                return self.flush(), True
        end = len(self.text) - self._hold if self._stop else len(self.text)
        if end <= self._emitted:
            return "", False
        new = self.text[self._emitted:end]
        self._emitted = end
        return new, False

    def flush(self) -> str:
        """Everything not yet emitted (when the request ends)."""
        new = self.text[self._emitted:]
        self._emitted = len(self.text)
        return new

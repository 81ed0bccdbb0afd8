"""Incremental detokenization and stop strings. Text is emitted only once it is stable: a
multi-byte character split over tokens waits for its last byte, and text that could be the
start of a stop string is held back until it is known not to be."""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded ahead of the output so that the first output token is decoded in
# context (SentencePiece drops a leading space on a token decoded alone).
_CONTEXT_TOKENS = 4


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
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
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self._ids[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
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

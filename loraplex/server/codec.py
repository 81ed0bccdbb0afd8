"""Text to tokens and back for the server, off the event loop: every tokenizer call runs on
one worker thread of its own (HF fast tokenizers are not safe to share between threads that
change their settings, and one thread keeps ordering simple)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loraplex.errors import InvalidRequestError


class TextCodec:
    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-tokenizer")

    @property
    def has_chat_template(self) -> bool:
        return self._tokenizer is not None and bool(getattr(self._tokenizer, "chat_template", None))

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, by default with the tokenizer's special tokens (BOS)."""
        tokenizer = self._require(param)
        return await self._run(lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens included ("" when the model has no tokenizer)."""
        if self._tokenizer is None:
            return ""
        tokenizer = self._tokenizer
        return await self._run(lambda: tokenizer.decode(token_ids))

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template applied to `messages`, with the assistant's turn opened."""
        tokenizer = self._require("messages")
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions",
                                      param="messages")
        return await self._run(_render_chat, tokenizer, messages)

    async def count(self, text: str) -> int:
        """Tokens in `text` without special tokens (0 when the model has no tokenizer)."""
        if self._tokenizer is None:
            return 0
        tokenizer = self._tokenizer
        return await self._run(lambda: len(tokenizer.encode(text, add_special_tokens=False)))

    async def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own (for logprobs)."""
        if self._tokenizer is None:
            return [str(t) for t in token_ids]
        tokenizer = self._tokenizer
        return await self._run(lambda: [tokenizer.decode([t]) for t in token_ids])

    def _require(self, param: str) -> Any:
        if self._tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; give the prompt as token ids",
                                      param=param)
        return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:  # the template's raise_exception: e.g. roles must alternate
        raise InvalidRequestError(f"the chat template refused the messages: {exc}",
                                  param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))

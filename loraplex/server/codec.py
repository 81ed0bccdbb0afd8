"""Text to tokens and back for the server, off the event loop and fair between tenants.

Tokenizing is the one unbounded piece of work a request causes before the engine sees it, so:
- text that cannot fit is refused before it is tokenized: no token of the tokenizer is longer
  than `max_token_bytes` bytes, so a prompt of B bytes has at least B / max_token_bytes tokens
  (tokenizers of causal LMs cover every byte of the text: byte-level BPE or byte fallback);
- tokenizer calls run on a FairPool: each worker thread has its own copy of the tokenizer,
  one tenant runs one call at a time, and tenants take turns, so a tenant that sends many long
  prompts waits behind itself, not others;
- the workers run at a lower CPU priority than the engine and the event loop, so a flood of
  long prompts being tokenized does not take the CPU from generation. For that the tokenizer
  must work on the calling thread: its own thread pool is turned off in this process
  (TOKENIZERS_PARALLELISM=false, unless set otherwise; it splits only batches, and the server
  tokenizes one text a call)."""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

from loraplex.errors import ContextLengthError, InvalidRequestError
from loraplex.server.fair_pool import FairPool

TOKENIZER_NICENESS = 10
"""How much lower the tokenizer threads' CPU priority is (their nice value)."""
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"
SERVER_WORK = ""
"""The turn of calls made for the server itself (counting a system prompt's tokens, decoding
logprobs) rather than for one tenant's prompt."""
JSON_BYTES_PER_TEXT_BYTE = 6
"""JSON escapes a byte as at most 6 (`\\u0001`)."""
BODY_SLACK_BYTES = 64 << 10
"""What a request body holds besides its prompt: the other fields, messages' framing."""


def max_token_bytes(tokenizer: Any) -> int:
    """The length in UTF-8 bytes of the tokenizer's longest token as its vocabulary spells it
    (an upper bound on the text one token covers: `Ġ` spells one byte in two, `<0x0A>` one in
    six)."""
    return max(len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab())


def max_request_body_bytes(tokenizer: Any | None, max_prompt_tokens: int) -> int:
    """The largest JSON body a completion or chat request that fits the context can need."""
    if tokenizer is None:  # prompts are token ids: `123456,` each
        return max_prompt_tokens * 8 + BODY_SLACK_BYTES
    return max_prompt_tokens * max_token_bytes(tokenizer) * JSON_BYTES_PER_TEXT_BYTE + BODY_SLACK_BYTES


class TextCodec:
    def __init__(self, tokenizer: Any | None, max_prompt_tokens: int, num_workers: int = 2) -> None:
        self._tokenizer = tokenizer
        self._max_prompt_tokens = max_prompt_tokens
        self._max_token_bytes = max_token_bytes(tokenizer) if tokenizer is not None else 0
        os.environ.setdefault(TOKENIZERS_PARALLELISM, "false")
        copies = [tokenizer] + [copy.deepcopy(tokenizer) for _ in range(num_workers - 1)]
        self._pool = FairPool(copies, max_per_tenant=max(1, num_workers - 1), name="loraplex-tokenizer",
                              niceness=TOKENIZER_NICENESS)

    @property
    def has_chat_template(self) -> bool:
        return self._tokenizer is not None and bool(getattr(self._tokenizer, "chat_template", None))

    async def encode(self, text: str, tenant: str, param: str = "prompt",
                     add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, by default with the tokenizer's special tokens (BOS).
        ContextLengthError, without tokenizing, for text too long to fit."""
        self._require(param)
        self._check_fits(len(text), lambda: len(text.encode("utf-8")), param)
        return await self._pool.run(
            tenant, lambda t: list(t.encode(text, add_special_tokens=add_special_tokens)))

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens included ("" when the model has no tokenizer)."""
        if self._tokenizer is None:
            return ""
        return await self._pool.run(SERVER_WORK, lambda t: t.decode(token_ids))

    @property
    def chat_template(self) -> str | None:
        return getattr(self._tokenizer, "chat_template", None) if self._tokenizer is not None else None

    async def encode_chat(self, messages: list[dict[str, Any]], tenant: str,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template applied to `messages` (and `tools`, for a template that takes
        them), with the assistant's turn opened."""
        self._require("messages")
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions",
                                      param="messages")
        texts = [m["content"] or "" for m in messages] + [json.dumps(tools)] * bool(tools)
        self._check_fits(sum(map(len, texts)), lambda: sum(len(t.encode("utf-8")) for t in texts),
                         "messages")
        return await self._pool.run(tenant, lambda t: _render_chat(t, messages, tools))

    async def count(self, text: str) -> int:
        """Tokens in `text` without special tokens (0 when the model has no tokenizer)."""
        return len(await self.tokens(text))

    async def tokens(self, text: str) -> list[int]:
        """`text`'s token ids without special tokens and without the prompt's length check (a
        registered text; [] when the model has no tokenizer)."""
        if self._tokenizer is None:
            return []
        return await self._pool.run(SERVER_WORK, lambda t: list(t.encode(text, add_special_tokens=False)))

    async def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own (for logprobs)."""
        if self._tokenizer is None:
            return [str(t) for t in token_ids]
        return await self._pool.run(SERVER_WORK, lambda t: [t.decode([i]) for i in token_ids])

    def _check_fits(self, num_chars: int, num_bytes: Any, param: str) -> None:
        """Refuse text whose bytes alone need more tokens than a prompt may have (a text has
        at least as many bytes as characters: the cheap test first)."""
        limit = self._max_prompt_tokens * self._max_token_bytes
        if num_chars <= limit // 4:  # at most 4 bytes a character: it may fit
            return
        size = num_bytes()
        if size > limit:
            raise ContextLengthError(
                f"The prompt is {size} bytes long: at least {math.ceil(size / self._max_token_bytes)} "
                f"tokens (no token of this model is longer than {self._max_token_bytes} bytes), more "
                f"than the {self._max_prompt_tokens} a prompt may have. It was not tokenized.",
                param=param)

    def _require(self, param: str) -> None:
        if self._tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; give the prompt as token ids",
                                      param=param)

    def close(self) -> None:
        self._pool.close()


def _render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                 ) -> list[int]:
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as exc:  # the template's raise_exception: e.g. roles must alternate
        raise InvalidRequestError(f"the chat template refused the messages: {exc}",
                                  param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))

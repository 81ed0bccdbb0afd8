"""Plain data shared by every layer: sampling parameters and request outputs. No torch here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from loraplex.errors import InvalidRequestError

FinishReason = Literal["stop", "length", "abort", "error"]

MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, compiled by the grammar engine (xgrammar): exactly one
    of the kinds below. Equal constraints compile once (the compiled grammars are cached by this
    value, `param` left out)."""

    json_schema: str | None = None
    """A JSON schema, as JSON text: the output is a JSON value that it accepts."""
    json_object: bool = False
    """Any JSON object."""
    regex: str | None = None
    """The output matches this regular expression, whole."""
    choice: tuple[str, ...] | None = None
    """The output is one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF, llama.cpp's dialect, as vLLM takes it; the rule `root` starts)."""
    param: str = field(default="response_format", compare=False)
    """The request field it came from: errors name it."""

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [self.json_schema is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        _require(sum(kinds) == 1, "give exactly one of json_schema, json_object, regex, choice and "
                 "grammar", self.param)
        _require(self.choice is None or (self.choice and all(isinstance(c, str) and c for c in self.choice)),
                 "choice must be a list of non-empty strings", self.param)

    @property
    def kind(self) -> str:
        return ("json_schema" if self.json_schema is not None else "json_object" if self.json_object
                else "regex" if self.regex is not None else "choice" if self.choice is not None
                else "grammar")


@dataclass(frozen=True)
class StreamingWindow:
    """Attention sinks (StreamingLLM): the request's KV keeps its first `attention_sinks` tokens
    and its last `sliding_window`, so that a session runs past the model's context with bounded
    memory. Sinks are kept in whole KV blocks (4 sinks keep the first block: 16 tokens at the
    default block size); window blocks are let go once all their tokens are more than
    `sliding_window` back. Positions are those within the cache, as StreamingLLM assigns them."""

    sliding_window: int
    attention_sinks: int = 4
    param: str = field(default="streaming_window", compare=False)
    """The request field or option it came from: errors name it."""

    def __post_init__(self) -> None:
        _require(isinstance(self.sliding_window, int) and self.sliding_window > 0,
                 "sliding_window must be an integer > 0", self.param)
        _require(isinstance(self.attention_sinks, int) and self.attention_sinks >= 0,
                 "attention_sinks must be an integer >= 0", self.param)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its output. Invalid values raise InvalidRequestError naming the
    field. `temperature == 0` is greedy; `top_k <= 0` and `top_p == 1` disable those filters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    """Makes sampling reproducible: the same seed, prompt and adapter give the same tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end the output; the matched string is not included."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the log-probability of each sampled token and of this many top alternatives."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token after the first (under the request's
    adapter), with its rank and this many top alternatives. With `max_tokens=0` the request
    only scores its prompt: it ends with nothing generated."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (each sampled token
    is drawn from those the grammar allows next; the request stops when the grammar is done)."""
    streaming_window: StreamingWindow | None = None
    """Keep only the first tokens' KV (attention sinks) and a recent window, so that the request
    may run past the context (None: the engine's default, `--sliding-window`)."""

    def __post_init__(self) -> None:
        # Accept lists and a single stop string, as the OpenAI API does; store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 0,
                 "max_tokens must be an integer >= 0", "max_tokens")
        _require(math.isfinite(self.temperature) and self.temperature >= 0,
                 "temperature must be a finite number >= 0", "temperature")
        _require(isinstance(self.top_k, int), "top_k must be an integer", "top_k")
        _require(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _require(self.seed is None or isinstance(self.seed, int), "seed must be an integer", "seed")
        _require(len(self.stop) <= MAX_STOP_SEQUENCES and all(isinstance(s, str) and s for s in self.stop),
                 f"stop must be at most {MAX_STOP_SEQUENCES} non-empty strings", "stop")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids must be non-negative integers", "stop_token_ids")
        _require(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                 f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
        _require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                 f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}", "prompt_logprobs")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_scoring_only(self) -> bool:
        """The request computes its prompt and generates nothing (`max_tokens == 0`)."""
        return self.max_tokens == 0


def _require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise InvalidRequestError(message, param=param)


@dataclass
class TokenLogprob:
    """Log-probability of one sampled (or prompt) token and its top alternatives, under the
    model's distribution before temperature and filters. `top` is ordered, most likely first."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None
    """For prompt tokens: 1 + the number of tokens the model found more likely."""


@dataclass
class RequestOutput:
    """The state of one request after a step. `token_ids` and `text` are cumulative (generated
    part only); `new_token_ids` and `new_text` are what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With `prompt_logprobs` asked: one entry per prompt token, None for the first (nothing
    precedes it). Complete from the request's first output on, and never changed after."""
    adapter: str | None = None
    error: str | None = None
    error_code: str | None = None
    """With `error`: the `code` of the LoraplexError that failed the request (None for other
    failures), e.g. `out_of_device_memory`, which a client may retry."""

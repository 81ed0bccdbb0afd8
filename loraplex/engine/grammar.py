"""Structured outputs: constraints (loraplex.types.StructuredOutput) compiled by xgrammar into
grammars over the model's vocabulary, and the per-request matchers that follow a request's
output and say which tokens may come next.

Compiling is the slow part (a JSON schema over a 49k vocabulary: milliseconds to seconds), so
compiled grammars are cached by the constraint's content, and the server compiles off the
event loop and off the engine's step (`GrammarCompiler.compile` in a worker thread, with a time
limit); the engine is handed the compiled grammar. A matcher is cheap: one a request, made
when the request is added. The README's structured outputs section says why xgrammar."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.errors import InvalidRequestError
from loraplex.types import StructuredOutput

MAX_SCHEMA_BYTES = 64 << 10
"""The largest JSON schema, regex, grammar or choice list (its text) that is compiled."""
MAX_CACHED_GRAMMARS = 256
"""Compiled grammars kept (least recently used dropped first)."""


class GrammarError(InvalidRequestError):
    """A constraint that cannot compile (bad schema, regex or grammar, or over a limit)."""

    code = "invalid_grammar"


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for this model's vocabulary (shared by every request that asks
    for it; each request makes its own matcher)."""

    spec: StructuredOutput
    compiled: Any  # xgrammar.CompiledGrammar

    def make_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)


class GrammarMatcher:
    """One request's place in its grammar: advanced by each token the request commits."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        import xgrammar

        self.grammar = grammar
        self._matcher = xgrammar.GrammarMatcher(grammar.compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher is
        left where it was)."""
        return bool(self._matcher.accept_token(token_id))

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` [rows, ceil(vocab / 32)]
        int32 (bit j of word i: token 32 i + j)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_done(self) -> bool:
        """The grammar has ended (its stop token was accepted)."""
        return bool(self._matcher.is_terminated())


def allocate_masks(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32 bitmasks, pinned on a CUDA machine."""
    import xgrammar

    return xgrammar.allocate_token_bitmask(num_rows, vocab_size)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe, cached by content."""

    @classmethod
    def for_model(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> GrammarCompiler:
        """The compiler of a model's tokenizer; InvalidRequestError if the model has none."""
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: structured outputs need one",
                                      param="response_format")
        return cls(tokenizer, vocab_size, stop_token_ids)

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 max_schema_bytes: int = MAX_SCHEMA_BYTES, max_cached: int = MAX_CACHED_GRAMMARS,
                 tokenizer_info: Any = None) -> None:
        """`vocab_size`: the model's (the logits' width, which may exceed the tokenizer's);
        `stop_token_ids`: the tokens that end a request (a finished grammar allows only them);
        `tokenizer_info`: an xgrammar.TokenizerInfo to use instead of `tokenizer`'s (a
        benchmark's synthetic vocabulary)."""
        import xgrammar

        info = tokenizer_info or xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids)))
        # xgrammar's own cache is off: ours keys by the whole constraint and bounds the count.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.max_schema_bytes = max_schema_bytes
        self._max_cached = max_cached
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        """Constraints compiled (cache misses)."""

    def cached(self, spec: StructuredOutput) -> CompiledGrammar | None:
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
            return grammar

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when it was compiled before). Raises
        GrammarError naming `spec.param` and the reason when it cannot compile."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        self._check_size(spec)
        try:
            compiled = self._compile(spec)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its reason
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GrammarError(f"{spec.param}: the {spec.kind.replace('_', ' ')} cannot be compiled: "
                               f"{reason}", param=spec.param) from None
        grammar = CompiledGrammar(spec, compiled)
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = grammar
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._compiler
        # Compact JSON (no free whitespace): a model cannot pad its answer with endless blanks,
        # which small models do when whitespace is allowed anywhere.
        compact = {"any_whitespace": False, "separators": (",", ":")}
        if spec.json_object:  # an object (not any JSON value), with any members
            return compiler.compile_json_schema('{"type":"object"}', strict_mode=False, **compact)
        if spec.json_schema is not None:
            _check_schema(spec)
            # strict_mode: no properties or items beyond those the schema names
            return compiler.compile_json_schema(spec.json_schema, strict_mode=True, **compact)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            alternatives = " | ".join(json.dumps(c) for c in spec.choice)  # EBNF string literals
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(spec.grammar)

    def _check_size(self, spec: StructuredOutput) -> None:
        text = spec.json_schema or spec.regex or spec.grammar or "".join(spec.choice or ())
        if len(text.encode("utf-8", "surrogatepass")) > self.max_schema_bytes:
            raise GrammarError(f"{spec.param}: the {spec.kind.replace('_', ' ')} is longer than "
                               f"{self.max_schema_bytes} bytes", param=spec.param)


def _check_schema(spec: StructuredOutput) -> None:
    """A JSON schema is a JSON object (or a boolean); xgrammar says what else is wrong."""
    try:
        schema = json.loads(spec.json_schema)
    except ValueError as exc:
        raise GrammarError(f"{spec.param}: the JSON schema is not JSON: {exc}", param=spec.param) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{spec.param}: a JSON schema is an object, not {type(schema).__name__}",
                           param=spec.param)

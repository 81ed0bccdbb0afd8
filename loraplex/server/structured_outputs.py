"""A request's output constraint (OpenAI's `response_format`, vLLM's `structured_outputs` and
its older `guided_*` fields) read from the body and compiled off the event loop and off the
engine's step, on the server's grammar threads, with a time limit. The engine caches compiled
grammars by content, so a schema that many requests send compiles once."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loraplex.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from loraplex.errors import InvalidRequestError
from loraplex.server.schemas.openai import SamplingFields
from loraplex.types import StructuredOutput


def structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The body's constraint, or None. More than one constraining field is a 400 naming the
    second."""
    found: list[StructuredOutput] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredOutput(json_object=True, param="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        found.append(StructuredOutput(json_object=True, param="response_format.json_schema")
                     if schema is None else
                     StructuredOutput(json_schema=_schema_text(schema, "response_format.json_schema.schema"),
                                      param="response_format.json_schema.schema"))
    outputs = body.structured_outputs
    if outputs is not None:
        given = {name: value for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                                                 ("choice", outputs.choice), ("grammar", outputs.grammar),
                                                 ("json_object", outputs.json_object or None))
                 if value is not None}
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs takes exactly one of json, regex, choice, grammar "
                                      "and json_object", param="structured_outputs")
        [(name, value)] = given.items()
        found.append(_spec(name, value, f"structured_outputs.{name}"))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{name}")
        if value is not None:
            found.append(_spec(name, value, f"guided_{name}"))
    if len(found) > 1:
        raise InvalidRequestError(f"{found[0].param} and {found[1].param} both constrain the output: "
                                  "give one", param=found[1].param)
    return found[0] if found else None


def _spec(name: str, value: Any, param: str) -> StructuredOutput:
    if name == "json":
        return StructuredOutput(json_schema=_schema_text(value, param), param=param)
    if name == "json_object":
        return StructuredOutput(json_object=True, param=param)
    if name == "choice":
        return StructuredOutput(choice=tuple(value), param=param)
    return StructuredOutput(**{name: value}, param=param)


def _schema_text(schema: Any, param: str) -> str:
    """A schema as compact JSON text (the cache key; key order kept: it is the output's order)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"{param}: the JSON schema is not JSON: {exc}", param=param) from None
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class GrammarPool:
    """Compiles constraints on its own threads; a compile past `max_compile_s` is a 400 (its
    thread finishes it in the background and caches it: xgrammar cannot be interrupted)."""

    def __init__(self, compiler: Any, num_threads: int, max_compile_s: float) -> None:
        """`compiler`: a callable returning the engine's GrammarCompiler (made on first use:
        building it reads the whole vocabulary, so that too happens on these threads)."""
        self._compiler = compiler
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="loraplex-grammar")
        self.max_compile_s = max_compile_s

    async def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._compile, spec)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.max_compile_s)
        except asyncio.TimeoutError:  # not TimeoutError before 3.11
            raise GrammarError(f"{spec.param}: the {spec.kind.replace('_', ' ')} took longer than "
                               f"{self.max_compile_s:g} s to compile", param=spec.param) from None

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        compiler: GrammarCompiler = self._compiler()
        return compiler.compile(spec)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

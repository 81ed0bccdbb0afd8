"""What the server process sends the engine-core process (loraplex.engine.core_process), in
order on one pipe. Every command that has an `call_id` is answered (core_replies.CallDone or
CallFailed); the others are not."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loraplex.adapter_format import LoraAdapter
from loraplex.engine.blending import DocumentBlend
from loraplex.engine.lora_weights import HostAdapter
from loraplex.types import SamplingParams, StructuredOutput


@dataclass(frozen=True)
class Call:
    """Run `fn(engine)` between two steps; answered with its value. `fn` is a module-level
    function, a functools.partial of one, or an operator.methodcaller, pickled by the caller (so
    that a closure fails at the call, and a function the core cannot import fails that call
    only)."""

    call_id: int
    fn: bytes


@dataclass(frozen=True)
class AddRequest:
    """LLMEngine.add_request; answered (None, or the error that refused the request) before the
    request's first output."""

    call_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    tenant: str | None = None
    sample_of: str | None = None
    grammar: StructuredOutput | None = None
    """The constraint the server compiled (xgrammar's compiled form does not pickle): the core
    compiles it again, from its own cache after the first time."""
    documents: DocumentBlend | None = None


@dataclass(frozen=True)
class Abort:
    """Stop a request (its stream's listener left); not answered."""

    request_id: str


@dataclass(frozen=True)
class UseAdapterLoader:
    """Load adapters by digest through the server from now on (core_replies.AdapterWanted); not
    answered."""


@dataclass(frozen=True)
class AdapterLoaded:
    """The server's answer to an AdapterWanted: where the core reads the adapter itself (`read`:
    a function that pickles, called with no arguments on the core's loader thread, e.g. a partial
    of the blob-store read with the adapter's files), or why it could not be found."""

    load_id: int
    read: Callable[[], LoraAdapter | HostAdapter] | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Shutdown:
    """Stop stepping, abort what is left, free the engine and exit."""

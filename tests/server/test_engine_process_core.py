"""The engine-core loop (loraplex.engine.core_process.EngineCore) on a stub engine, in a thread
of the test process: it stops when the server's end of its pipe closes (the server died),
failing the adapter loads that wait on the server; a step's outputs go as one message with the
prompt left out and the tokens, text and log-probs as deltas; errors cross the pipe with their
code and param."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from typing import Any

from loraplex.engine.core_commands import AddRequest, Call, Shutdown
from loraplex.engine.core_process import EngineCore, portable
from loraplex.engine.core_replies import CallDone, CallFailed, StepOutputs
from loraplex.engine.grammar import GrammarError
from loraplex.errors import InvalidRequestError, UnknownAdapterError
from loraplex.types import RequestOutput, SamplingParams, StructuredOutput, TokenLogprob


class StubGrammars:
    """Compiles a regex in 0.3 s; `[` does not compile."""

    def cached(self, spec: StructuredOutput) -> None:
        return None

    def compile(self, spec: StructuredOutput) -> str:
        time.sleep(0.3)
        if spec.regex == "[":
            raise GrammarError("response_format: the regex cannot be compiled", param="response_format")
        return f"compiled {spec.regex}"


class StubEngine:
    """Adds requests that each output two tokens, one a step."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}
        self.num_aborted = 0
        self.grammars = StubGrammars()

    def add_request(self, request_id: str, *, prompt_token_ids: list[int], grammar: Any = None,
                    **_: Any) -> None:
        assert grammar is None or grammar.startswith("compiled ")
        if not prompt_token_ids:
            raise InvalidRequestError("empty prompt", param="prompt")
        self.requests[request_id] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, tokens in list(self.requests.items()):
            tokens.append(len(tokens) + 7)
            finished = len(tokens) == 2
            if finished:
                del self.requests[request_id]
            text = "".join(f"<{t}>" for t in tokens)
            outputs.append(RequestOutput(
                request_id, [1, 2, 3], list(tokens), text, finished, "length" if finished else None,
                new_token_ids=tokens[-1:], new_text=f"<{tokens[-1]}>",
                logprobs=[TokenLogprob(t, -0.5) for t in tokens],
                prompt_logprobs=[None, TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)]))
        return outputs

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def abort_all(self) -> int:
        self.num_aborted, self.requests = len(self.requests), {}
        return self.num_aborted

    def set_adapter_loader(self, loader: Any) -> None:
        self.loader = loader


def _core(engine: StubEngine) -> tuple[EngineCore, Any, threading.Thread]:
    server, child = multiprocessing.Pipe()
    core = EngineCore(engine, child, parent_pid=os.getppid())
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    return core, server, thread


def test_a_step_is_one_message_with_the_prompt_left_out_and_tokens_as_deltas() -> None:
    engine = StubEngine()
    _, server, thread = _core(engine)
    server.send(AddRequest(1, "a", [1, 2, 3], SamplingParams()))
    server.send(AddRequest(2, "b", [], SamplingParams()))  # refused: the error crosses whole
    server.send(Call(3, pickle.dumps(len)))  # a picklable callable: len(engine) fails, typed
    messages = [server.recv() for _ in range(5)]
    done = [m for m in messages if isinstance(m, CallDone | CallFailed)]
    assert done[0] == CallDone(1, None)
    assert isinstance(done[1].error, InvalidRequestError) and done[1].error.param == "prompt"
    assert isinstance(done[2], CallFailed) and isinstance(done[2].error, TypeError)
    steps = [m for m in messages if isinstance(m, StepOutputs)]
    assert [(o.prompt_token_ids, o.token_ids, o.new_token_ids) for s in steps for o in s.outputs] == [
        ([], [], [7]), ([], [], [8])]
    assert [s.is_delta for s in steps] == [[True], [True]]
    # the text and the log-probs as what the step added; the prompt's log-probs with the first only
    first, second = (s.outputs[0] for s in steps)
    assert (first.text, second.text) == ("<7>", "<8>")
    assert [lp.token_id for lp in first.logprobs] == [7] and [lp.token_id for lp in second.logprobs] == [8]
    assert len(first.prompt_logprobs) == 3 and second.prompt_logprobs is None
    server.send(Shutdown())
    thread.join(5)
    assert not thread.is_alive()


def test_a_constraint_compiles_beside_the_step_loop() -> None:
    _, server, thread = _core(StubEngine())
    server.send(AddRequest(1, "slow", [1], SamplingParams(), grammar=StructuredOutput(regex="a+")))
    server.send(AddRequest(2, "bad", [1], SamplingParams(), grammar=StructuredOutput(regex="[")))
    server.send(AddRequest(3, "plain", [1], SamplingParams()))
    replies = []
    while len(replies) < 3:
        assert server.poll(10), "the core did not answer"
        if isinstance(message := server.recv(), CallDone | CallFailed):
            replies.append(message)
    assert [r.call_id for r in replies] == [3, 1, 2]  # the plain request did not wait for the compiles
    assert isinstance(replies[2], CallFailed) and isinstance(replies[2].error, GrammarError)
    server.send(Shutdown())
    thread.join(5)


def test_the_core_stops_when_the_server_is_gone() -> None:
    engine = StubEngine()
    _, server, thread = _core(engine)
    server.send(AddRequest(1, "r", [1], SamplingParams()))
    server.recv()
    server.close()  # the server process died: its end of the pipe closed
    thread.join(5)
    assert not thread.is_alive(), "the core kept running without its server"


def test_errors_cross_with_their_code_and_param_or_as_runtime_errors() -> None:
    error = portable(UnknownAdapterError("adapter 'x' is not loaded", param="model"))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is UnknownAdapterError and copy.param == "model" and copy.code == "model_not_found"

    class Local(Exception):  # defined in a function: does not pickle
        pass

    assert type(portable(Local("boom"))) is RuntimeError and "Local: boom" in str(portable(Local("boom")))

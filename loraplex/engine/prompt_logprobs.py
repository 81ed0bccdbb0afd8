"""Prompt log-probabilities, computed in the prefill's own forward pass: for each prompt token
after the first, its log-probability under the model (and the request's adapter) given the
tokens before it, its rank, and the top k alternatives.

The hidden state at position j predicts token j + 1, so a step that computes positions
[start, start + n) of a prompt of P tokens scores prompt tokens start + 1 .. min(start + n, P - 1)
(position P - 1 predicts the first generated token: that is sampling's business). Only those
rows go through the lm_head, in slices that bound the float32 logits' memory; the chosen
token's log-probability, its rank and the top token come from one pass over each slice's
logits (the op set's score_tokens), in float32, and everything the host needs travels in one
copy per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.types import TokenLogprob

MAX_SLICE_ELEMENTS = 1 << 27
"""Logits computed at once: rows x vocabulary <= this (512 MiB of float32), e.g. 1,046 rows of
a 128k vocabulary: enough rows for the lm_head's GEMM to run near the device's peak."""
SLICE_BYTES = MAX_SLICE_ELEMENTS * 4
"""Memory one slice's logits take, set aside when the engine sizes its KV cache."""


@dataclass(frozen=True)
class PromptSelection:
    """Which of a step's token positions to score (host side, made while preparing the step)."""

    seqs: np.ndarray  # [num_scoring_seqs]: indices into the step's scheduled requests
    first_index: np.ndarray  # [num_scoring_seqs]: prompt index of each one's first scored token
    counts: np.ndarray  # [num_scoring_seqs]: tokens scored for each
    ks: np.ndarray  # [num_scoring_seqs]: top alternatives each wants
    hidden_rows: np.ndarray  # [num_scored] int64: the step's flat token index predicting each
    targets: np.ndarray  # [num_scored] int64: the prompt token scored at each

    @property
    def max_k(self) -> int:
        return int(self.ks.max())


def select(rows: np.ndarray, start: np.ndarray, num_new: np.ndarray, query_start: np.ndarray,
           num_prompt_tokens: np.ndarray, ks: np.ndarray, tokens: list[list[int]]
           ) -> PromptSelection | None:
    """The positions of a step to score. All arrays are per scheduled request ([num_seqs]):
    InputBatch rows, first position computed, positions computed, offsets into the step's
    flat tokens, prompt lengths, prompt logprobs asked (-1: none); `tokens` the rows' token
    lists. None when nothing in the step is to be scored."""
    end = np.minimum(start + num_new, num_prompt_tokens - 1)  # last position predicting a prompt token
    counts = np.where(ks >= 0, np.maximum(end - start, 0), 0)
    seqs = np.flatnonzero(counts)
    if not len(seqs):
        return None
    counts = counts[seqs]
    offsets = np.repeat(query_start[seqs] - np.cumsum(counts) + counts, counts)
    hidden_rows = offsets + np.arange(int(counts.sum()))
    targets = [t for i, count in zip(seqs.tolist(), counts.tolist())
               for t in tokens[rows[i]][start[i] + 1:start[i] + 1 + count]]
    return PromptSelection(
        seqs=seqs, first_index=start[seqs] + 1, counts=counts, ks=ks[seqs],
        hidden_rows=hidden_rows.astype(np.int64), targets=np.asarray(targets, dtype=np.int64),
    )


@dataclass
class QueuedPromptLogprobs:
    """A step's prompt logprobs on their way to the host."""

    selection: PromptSelection
    values: torch.Tensor
    """[num_scored, 2 + 2 * max_k] float64 (host; pinned on CUDA): the token's logprob, its
    rank, the top k logprobs, the top k token ids (exact in float64)."""


@torch.inference_mode()
def compute(model, hidden: torch.Tensor, selection: PromptSelection,
            to_device: Callable[[np.ndarray], torch.Tensor],
            to_host: Callable[[torch.Tensor], torch.Tensor]) -> QueuedPromptLogprobs:
    """Score the selected positions of `hidden` [num_tokens, hidden_size] through `model`'s
    lm_head (`compute_logits`: float32 logits). `to_device` / `to_host` move arrays and
    tensors without synchronising."""
    k = selection.max_k
    num_scored = len(selection.targets)
    rows = to_device(selection.hidden_rows)
    targets = to_device(selection.targets)
    out = torch.empty(num_scored, 2 + 2 * k, dtype=torch.float64, device=hidden.device)
    step = max(1, MAX_SLICE_ELEMENTS // model.config.vocab_size)
    for begin in range(0, num_scored, step):
        end = min(begin + step, num_scored)
        logits = model.compute_logits(hidden[rows[begin:end]])  # [m, vocab] float32
        _score(model.ops, logits, targets[begin:end], k, out[begin:end])
    return QueuedPromptLogprobs(selection, to_host(out))


def _score(ops, logits: torch.Tensor, targets: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """log_softmax(logits)[target], its rank and the top k, written into out [m, 2 + 2k]: the
    op set's score_tokens (one pass over the logits) gives the first three and the top one."""
    scores = ops.score_tokens(logits, targets)  # [m, 4]: logprob, rank, top logprob, top id
    out[:, :2] = scores[:, :2]
    if k == 1:
        out[:, 2:4] = scores[:, 2:4]
    elif k > 1:
        lse = logits.gather(1, targets.view(-1, 1)).view(-1) - scores[:, 0]  # [m]
        top_values, top_ids = logits.topk(k, dim=-1)
        out[:, 2:2 + k] = top_values - lse[:, None]
        out[:, 2 + k:] = top_ids


def collect(queued: QueuedPromptLogprobs, request_ids: list[str]
            ) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """Once the step's copy has landed: request id -> (prompt index of the first entry,
    entries). `request_ids` are the step's scheduled requests, in plan order."""
    selection = queued.selection
    values = queued.values.tolist()
    k = selection.max_k
    result = {}
    offset = 0
    for seq, first, count, want in zip(selection.seqs.tolist(), selection.first_index.tolist(),
                                       selection.counts.tolist(), selection.ks.tolist()):
        entries = []
        for row, target in zip(values[offset:offset + count],
                               selection.targets[offset:offset + count].tolist()):
            top = {int(t): v for v, t in zip(row[2:2 + want], row[2 + k:2 + k + want])}
            entries.append(TokenLogprob(token_id=target, logprob=row[0], top=top, rank=int(row[1])))
        result[request_ids[seq]] = (first, entries)
        offset += count
    return result

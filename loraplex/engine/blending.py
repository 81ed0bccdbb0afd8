"""CacheBlend (issue 25): a prompt's KV from documents' KV computed once each, alone, and reused
wherever the documents land, with a share of their tokens computed again.

A document's KV computed alone (positions from 0) differs from a full prefill's in two ways: its
keys sit at the wrong positions, and it never attended to what precedes it. The first is exact to
fix: a rotary rotation composes with another, so rotating the keys on by the document's offset
puts them where the prompt has them. The second is what the recompute is for. As CacheBlend
does, layers 0 and 1 run every token (a layer-0 key depends on its token and position only, so
layer 0 costs little and is exact, and so then is layer 1); then every token that is no
document's (the template, the question) and the `share` of document tokens that matter most go
through the remaining layers, their KV replacing the reused one and attending to the blended
cache. A share of 1.0 is a full prefill. Which tokens matter most: by default those the
prompt's own tokens attend to most past layer 1, reading the reused KV (a probe pass of the own
tokens, whose KV the blend then computes again); CacheBlend's own rule, those whose layer-1 KV
moved most from the reused, is `recompute_by="deviation"` (the two measured against each
other: studies/cacheblend_select.py, README's documents section).

Documents' KV lives in the prefix cache's pool under hashes of their own (`document_hashes`):
evictable like any cached block, and found again by the next request that names the document
under the same tenant and adapter. Only a document's full blocks are reused; the tokens of its
last, partial block are computed as the prompt's own.

Under an adapter (every family: LoRA, DoRA, IA3, FLoRA) every forward pass of the blend, the
documents' own included, carries the request's adapter slot (`AdapterSlot`) as a step's tokens
do, and the documents' KV is kept under the adapter's digest: another adapter computes its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.lora_weights import LoraSlotBuffers
from loraplex.engine.prefix_cache import block_hashes
from loraplex.engine.step_inputs import flora_row_arrays
from loraplex.model.context import (
    AttentionMetadata,
    FloraRows,
    ForwardContext,
    LoraMetadata,
    forward_context,
)
from loraplex.model.llama import LlamaForCausalLM

DEFAULT_RECOMPUTE_SHARE = 0.2
"""Share of reused document tokens computed again. studies/results/cacheblend-share-cpu.json
(SmolLM2-135M-Instruct, float32, 8 questions over 4 documents of 384 tokens): the first answer
token's log-prob error against full prefill is 0.38 reused as is, 0.16 at 5%, 0.10 at 15%, 0.09
at 20%, 0.07 at 30%; the answers' ROUGE-L stays 0.50-0.53 from 5% to 30% (by deviation, the
rule then). studies/results/cacheblend-select-cpu.json (10 questions, 4 documents of 1,025
tokens): ranked by the question's attention, 20% takes the answer's log-prob error from 0.13
(ranked by deviation) to 0.07, and 10% errs no more than 20% by deviation (0.12)."""
RECOMPUTE_BY = ("question", "deviation")
CHUNK_TOKENS = 512
"""Selected tokens a forward pass takes at once past layer 1 with the reference ops (one
sequence, each token at its own position), and own tokens a probe pass takes: bounds the
scores they hold to heads x CHUNK_TOKENS x prompt length. The kernels hold no such scores: they
take every selected token in one pass (launches a layer once, not once a chunk)."""


@dataclass(frozen=True)
class DocumentBlend:
    """Where a prompt's documents lie and how to blend them."""

    spans: tuple[tuple[int, int], ...]
    """[start, end) of each document's tokens in the prompt, in order, not overlapping."""
    recompute_share: float = DEFAULT_RECOMPUTE_SHARE
    """Share of the reused document tokens whose KV is computed again (0 to 1)."""
    recompute_by: str = "question"
    """Which reused tokens are computed again: `question`, those the prompt's own tokens (the
    template, the question) attend to most past layer 1, reading the reused KV (a probe pass of
    the own tokens, `question_attention`); `deviation`, CacheBlend's: those whose layer-1 KV
    moved most from the reused."""

    def check(self, num_prompt_tokens: int) -> None:
        if not 0.0 <= self.recompute_share <= 1.0:
            raise ValueError(f"recompute_share must be in [0, 1], not {self.recompute_share}")
        if self.recompute_by not in RECOMPUTE_BY:
            raise ValueError(f"recompute_by must be one of {RECOMPUTE_BY}, not {self.recompute_by!r}")
        end = 0
        for start, stop in self.spans:
            if not end <= start < stop <= num_prompt_tokens:
                raise ValueError(f"document span [{start}, {stop}) is out of order or outside the "
                                 f"prompt of {num_prompt_tokens} tokens")
            end = stop


@dataclass(frozen=True)
class AdapterSlot:
    """The request's adapter in its device slot (held for the blend), for the blend's passes."""

    slot: int
    buffers: LoraSlotBuffers

    def metadata(self, num_tokens: int, device: torch.device) -> LoraMetadata:
        """LoRA metadata of `num_tokens` tokens all in this slot, as a step's (StepInputs.fill)."""
        buffers, slot = self.buffers, self.slot
        has_input_scale = bool(buffers.slot_input_scaled[slot])
        flora = None
        rank = int(buffers.slot_flora_rank[slot])
        if rank:
            slots = np.full(num_tokens, slot, dtype=np.int32)
            arrays = flora_row_arrays(slots, np.full(num_tokens, rank, dtype=np.int64), num_tokens)
            flora = FloraRows(*(torch.from_numpy(a).to(device) for a in arrays))
        return LoraMetadata(torch.full((num_tokens,), slot, dtype=torch.int32, device=device), buffers,
                            has_input_scale=has_input_scale,
                            has_expand=has_input_scale or bool(buffers.slot_needs_expand[slot]), flora=flora)


def _context(kv_cache: torch.Tensor, meta: AttentionMetadata, lora: AdapterSlot | None) -> ForwardContext:
    adapter = None if lora is None else lora.metadata(len(meta.slot_mapping), kv_cache.device)
    return ForwardContext(kv_cache, meta, adapter)


def document_hashes(token_ids: list[int], block_size: int, tenant: str,
                    adapter: str | None) -> list[bytes]:
    """Prefix-cache hashes of a document's full blocks computed alone: seeded apart from every
    prompt's (a prompt that starts with the document's tokens has the same KV, but a document's
    blocks must not be taken for a prompt's when its seed is not the tenant's)."""
    return block_hashes(token_ids, block_size, f"{tenant}\x00document", adapter)


def shift_keys(keys: torch.Tensor, offset: int, cos_sin: torch.Tensor) -> torch.Tensor:
    """Keys [..., head_dim] rotated on by `offset` positions (rotate-half layout; cos_sin
    [max_positions, head_dim] as the model's rope table), in float32, back to keys' dtype."""
    cos, sin = cos_sin[offset].float().chunk(2, dim=-1)
    x1, x2 = keys.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(keys.dtype)


def copy_document_kv(kv_cache: torch.Tensor, source_blocks: list[int], target_blocks: list[int],
                     start: int, num_tokens: int, cos_sin: torch.Tensor) -> None:
    """Copy a document's first `num_tokens` KV (all layers) from its blocks into a prompt's
    blocks at positions start.., keys rotated on by `start`. kv_cache [num_blocks, num_layers,
    2, block_size, kv_heads, head_dim]."""
    block_size = kv_cache.shape[3]
    device = kv_cache.device
    source = torch.tensor(source_blocks, device=device)
    kv = kv_cache[source].transpose(0, 1).transpose(1, 2)  # [layers, 2, blocks, block_size, kv_heads, d]
    kv = kv.flatten(2, 3)[:, :, :num_tokens]  # [layers, 2, tokens, kv_heads, d]
    keys = shift_keys(kv[:, 0], start, cos_sin)
    positions = torch.arange(start, start + num_tokens, device=device)
    blocks = torch.tensor(target_blocks, device=device)[positions // block_size]
    offsets = positions % block_size
    kv_cache[blocks, :, 0, offsets] = keys.transpose(0, 1)
    kv_cache[blocks, :, 1, offsets] = kv[:, 1].transpose(0, 1)


def _metadata(slots: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
    """Attention over one prompt's blocks `table` [1, max_blocks] for tokens at `positions`
    (ascending), each token attending to the cache up to its own position: one sequence ending
    at the last token, each token at its own position (the prompt's first tokens in order, a
    prefill's, need no positions)."""
    n = len(positions)
    last = int(positions[-1])
    return AttentionMetadata(
        slot_mapping=slots, block_tables=table,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=positions.device),
        seq_lens=torch.tensor([last + 1], dtype=torch.int32, device=positions.device), max_query_len=n,
        query_positions=None if last + 1 == n else positions.to(torch.int32))


def metadata_by_runs(slots: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
    """The same attention as `_metadata`, laid out without query positions: each run of
    consecutive positions a sequence of its own, ending at its last token. It reads the prompt's
    keys once per run (the blend's layout before the prefill attention took query positions):
    the reference that the one-sequence layout is tested and timed against."""
    host = positions.cpu()
    ends = torch.cat([(host[1:] != host[:-1] + 1).nonzero().flatten() + 1, torch.tensor([len(host)])])
    starts = torch.cat([torch.zeros(1, dtype=ends.dtype), ends[:-1]])
    return AttentionMetadata(
        slot_mapping=slots, block_tables=table.expand(len(ends), -1).contiguous(),
        query_start_loc=torch.cat([torch.zeros(1, dtype=ends.dtype), ends]).to(positions.device, torch.int32),
        seq_lens=(host[ends - 1] + 1).to(positions.device, torch.int32),
        max_query_len=int((ends - starts).max()))


@dataclass(frozen=True)
class _Pass:
    """A forward pass over the tokens at `positions`, rows `rows` of the hidden states, with its
    context: made once and run at every layer (no host sync a layer)."""

    rows: slice
    positions: torch.Tensor
    context: ForwardContext


def _passes(kv_cache: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
            lora: AdapterSlot | None, size: int) -> list[_Pass]:
    """The tokens at `positions` (ascending) `size` at a time (those before a pass are in the
    cache when it runs)."""
    passes = []
    for lo in range(0, len(positions), size):
        chosen = positions[lo:lo + size]
        passes.append(_Pass(slice(lo, lo + size), chosen,
                            _context(kv_cache, _metadata(slots[chosen], table, chosen), lora)))
    return passes


def _layer(layer: torch.nn.Module, model: LlamaForCausalLM, passes: list[_Pass], hidden: torch.Tensor,
           residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer on the passes' tokens, pass by pass."""
    outputs = []
    for p in passes:
        with forward_context(p.context):
            outputs.append(layer(p.positions, hidden[p.rows], None if residual is None else residual[p.rows],
                                 model.cos_sin))
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat([h for h, _ in outputs]), torch.cat([r for _, r in outputs])


@torch.inference_mode()
def blend_prefill(model: LlamaForCausalLM, kv_cache: torch.Tensor, block_ids: list[int],
                  token_ids: list[int], reused: torch.Tensor | None, share: float,
                  lora: AdapterSlot | None = None, by: str = "question") -> torch.Tensor:
    """Compute the KV of `token_ids` (a prompt's first tokens, every one in `block_ids`) into
    the cache, where `reused` [num_tokens] bool marks tokens whose KV the cache holds already
    (re-positioned documents): all of them go through layers 0 and 1, then every token not
    reused and the `share` of reused ones ranked first `by` (DocumentBlend.recompute_by).
    `reused` None: a full prefill. `lora`: the request's adapter. Returns the positions that
    went through every layer (ascending)."""
    device, n = kv_cache.device, len(token_ids)
    block_size = kv_cache.shape[3]
    table = torch.tensor([block_ids], dtype=torch.int32, device=device)
    positions = torch.arange(n, device=device)
    slots = table[0].long()[positions // block_size] * block_size + positions % block_size
    hidden = F.embedding(torch.tensor(token_ids, device=device), model.embed_tokens)
    residual = None
    selected = positions
    passes = _passes(kv_cache, slots, table, positions, lora, n)  # every token at once
    is_blend = reused is not None and bool(reused.any())
    for index, layer in enumerate(model.layers):
        if index == 1 and is_blend and by == "deviation":
            before = kv_cache[table[0].long(), 1].clone()  # [blocks, 2, block_size, kv_heads, d]
        hidden, residual = _layer(layer, model, passes, hidden, residual)
        if index == 1 and is_blend:
            if by == "deviation":
                after = kv_cache[table[0].long(), 1]
                score = (after.float() - before.float()).pow(2).sum((1, 3, 4)).flatten()[:n]  # [tokens]
            else:
                score = question_attention(model, kv_cache, table, slots, ~reused, hidden, residual, lora)
            selected = _select(score, reused, share)
            if len(selected) < n:
                hidden, residual = hidden[selected], residual[selected]
                size = CHUNK_TOKENS if model.ops.name == "reference" else len(selected)
                passes = _passes(kv_cache, slots, table, selected, lora, size)
    return selected


def question_attention(model: LlamaForCausalLM, kv_cache: torch.Tensor, table: torch.Tensor,
                       slots: torch.Tensor, own: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor,
                       lora: AdapterSlot | None) -> torch.Tensor:
    """Attention weight [num_tokens] (float32) each of a prompt's tokens gets from its `own`
    tokens ([num_tokens] bool: the template, the question, what is no reused document's) past
    layer 1, averaged over heads and own tokens, summed over layers: a probe pass of the own
    tokens (hidden, residual [num_tokens, hidden] after layer 1) through the remaining layers,
    attending to the cache as it stands (the documents' reused KV), each layer's queries taken
    from its own attention call (ForwardContext.queries). The probe writes the own tokens' KV,
    which the blend's pass writes again."""
    n = len(own)
    probe = own.nonzero().flatten()
    hidden, residual = hidden[probe], residual[probe]
    passes = _passes(kv_cache, slots, table, probe, lora, CHUNK_TOKENS)
    rows = table[0].long()
    later = torch.arange(n, device=kv_cache.device)[None, :] > probe[:, None]  # [probe, tokens]
    mass = torch.zeros(n, dtype=torch.float32, device=kv_cache.device)
    for layer in model.layers[2:]:
        attn, queries = layer.attn, []
        layer_passes = [dataclasses.replace(p, context=dataclasses.replace(p.context, queries=queries))
                        for p in passes]
        hidden, residual = _layer(layer, model, layer_passes, hidden, residual)
        keys = kv_cache[rows, attn.layer, 0].flatten(0, 1)[:n].float()  # [tokens, kv_heads, d]
        group = attn.num_heads // attn.num_kv_heads
        for p, q in zip(passes, queries):
            q = q.float().view(len(p.positions), attn.num_kv_heads, group, attn.head_dim)
            scores = torch.einsum("pkgd,nkd->kgpn", q, keys) * attn.scale  # [kv_heads, group, chunk, tokens]
            weights = scores.masked_fill(later[p.rows], float("-inf")).softmax(-1)
            mass += weights.sum((0, 1, 2)) / (attn.num_heads * len(probe))
    return mass


def _select(score: torch.Tensor, reused: torch.Tensor, share: float) -> torch.Tensor:
    """Token indices (ascending) to carry past layer 1: every token not reused, and the `share`
    of reused ones whose `score` [tokens] is highest."""
    rows = reused.nonzero().flatten()
    count = round(share * len(rows))
    chosen = rows[score[rows].topk(count).indices] if count else rows[:0]
    return torch.cat([(~reused).nonzero().flatten(), chosen]).sort().values


@dataclass
class BlendReport:
    """What one blended prompt took."""

    prompt_hashes: list[bytes]
    """The prefix-cache hashes its blended blocks are cached under (the request's own)."""
    num_documents_computed: int
    """Documents whose KV was not cached and was computed alone for it."""
    num_reused_tokens: int
    num_recomputed_tokens: int
    """Tokens that went through every layer (the prompt's own and the recomputed share)."""


def prefill_with_documents(model: LlamaForCausalLM, kv_cache: torch.Tensor, blocks: BlockManager,
                           token_ids: list[int], documents: DocumentBlend, tenant: str,
                           adapter: str | None, salt: str, lora: AdapterSlot | None = None
                           ) -> BlendReport | None:
    """Blend the KV of a prompt's full blocks but the last (the engine computes the rest and
    samples) into fresh blocks, cached under hashes seeded by `salt` (unique to the request)
    and left for the scheduler to find. Each document's full blocks come from the prefix cache
    or are computed alone first. `adapter`: the request's adapter digest, held in `lora`'s slot
    (None: the base model). None when nothing is blended (no full block, or no room: the
    request then runs a full prefill)."""
    block_size = blocks.block_size
    num_blocks = (len(token_ids) - 1) // block_size
    if num_blocks == 0:
        return None
    held: list[int] = []
    try:
        sources, computed = [], 0
        for start, end in documents.spans:
            doc = token_ids[start:end]
            hashes = document_hashes(doc, block_size, tenant, adapter)
            found = blocks.match(hashes, len(hashes))
            if len(found) < len(hashes):  # (evicted in part: computed again whole)
                blocks.free(found)
                found = blocks.allocate(len(hashes))
                if found is None:
                    return None
                blend_prefill(model, kv_cache, found, doc[:len(hashes) * block_size], None, 1.0, lora)
                blocks.register(found, hashes)
                blocks.mark_computed(found)
                computed += 1
            held += found
            sources.append((start, found))
        prompt = blocks.allocate(num_blocks)
        if prompt is None:
            return None
        held += prompt
        limit = num_blocks * block_size
        reused = torch.zeros(limit, dtype=torch.bool, device=kv_cache.device)
        for start, found in sources:
            count = min(len(found) * block_size, limit - start)
            if count > 0:
                copy_document_kv(kv_cache, found, prompt, start, count, model.cos_sin)
                reused[start:start + count] = True
        num_computed = len(blend_prefill(model, kv_cache, prompt, token_ids[:limit], reused,
                                         documents.recompute_share, lora, documents.recompute_by))
        hashes = block_hashes(token_ids, block_size, salt, adapter, num_blocks)
        blocks.register(prompt, hashes)
        blocks.mark_computed(prompt)
        return BlendReport(hashes, computed, int(reused.sum()) - (num_computed - int((~reused).sum())),
                           num_computed)
    finally:
        blocks.free(held)

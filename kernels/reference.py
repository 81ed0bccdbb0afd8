"""Torch reference for every op of the forward pass: the CPU path of the engine and the oracle
the Triton kernels are tested against. Plain, readable torch; no Triton, nothing from the rest
of loraplex.

Layout conventions shared with the Triton kernels:
- KV cache: one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`
  (block-major); ops take the layer's view `kv_cache[:, layer]`, shape
  `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (index 0 = K, 1 = V), not contiguous.
- A token's cache slot is `block_id * block_size + offset`.
- LoRA slot buffers, per layer and module group (qkv, o, gate_up, down): A
  `[num_slots, num_slices, max_rank, in_features]`, B `[num_slots, out_features, max_rank]`
  with the scaling folded into B, and the true rank of each (slot, slice) in
  `ranks [num_slots, num_slices]`; slot 0 means "no adapter" and is never read. The output
  rows of B are the slices' outputs laid end to end (`slice_offsets`).
- LoRA rank pages (kernels/lora_paged.py, adapter_families_paged.py): the same A, and B
  transposed per slice, in pages of PAGE_RANK rank rows anywhere in the pool, found through
  int64 page tables `[num_slots, num_slices, cdiv(max_rank, PAGE_RANK)]` of element offsets;
  per-slot float32 vectors at int64 offsets (-1: none) into the pool viewed as float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

PAGE_RANK = 8
"""Rank rows of one module a LoRA rank page holds (SGLang's paged LoRA pool uses 8 too): an
adapter of rank r takes cdiv(r, 8) pages a module, so ranks 8, 16 and 64 take memory 1:2:8."""


def num_rank_pages(rank: int) -> int:
    """Rank pages a module of `rank` takes."""
    return -(-max(int(rank), 0) // PAGE_RANK)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [num_tokens, hidden], weight [hidden] -> [num_tokens, hidden]. Normalises in float32
    and rounds to x's dtype before the weight multiply, as Hugging Face Llama does."""
    return _rms_norm(x, weight, eps, x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual). Shapes
    [num_tokens, hidden]. The residual has x's dtype, or float32 (a 16-bit model's residual
    stream kept unrounded): the sum is taken in the residual's dtype and the normalised rows
    are rounded to x's."""
    residual = x + residual
    return _rms_norm(residual, weight, eps, x.dtype), residual


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim]
    by position (the "rotate half" layout of Hugging Face Llama). cos_sin_cache
    [max_positions, head_dim] holds cos in the first half of each row and sin in the second,
    in float32."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [num_tokens, head_dim / 2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into the layer's cache view at
    slot_mapping [num_tokens] (int64); negative slots are skipped (padding)."""
    block_size = kv_layer.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_layer[blocks, 0, offsets] = k[valid].to(kv_layer.dtype)
    kv_layer[blocks, 1, offsets] = v[valid].to(kv_layer.dtype)


def rotary_store_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_sin_cache: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
    token_slots: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    scaled: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary on q and k, then k and v written to the cache. Returns the rotated q.
    IA3 (token_slots [num_tokens], scale [num_slots, q_size + 2 * kv_size] float32, scaled
    [num_slots] int32, given together): q | k | v of the tokens whose slot sets scaled are first
    multiplied by scale[slot] (in float32, rounded to their dtype): the projections' output
    vectors. Or scaled [num_slots] int64 offsets into a 1-D scale (see _scale_flagged)."""
    if token_slots is not None:
        num_tokens, shapes = q.shape[0], (q.shape, k.shape, v.shape)
        qkv = torch.cat([t.reshape(num_tokens, -1) for t in (q, k, v)], dim=1)
        qkv = _scale_flagged(qkv, scale, scaled, token_slots)
        q, k, v = (t.view(shape) for t, shape in zip(
            qkv.split([s[1] * s[2] for s in shapes], dim=1), shapes))
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv(k, v, kv_layer, slot_mapping)
    return q


def gather_kv(
    kv_layer: torch.Tensor, block_tables: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first max_len keys and values of each sequence of block_tables [num_seqs, max_blocks]:
    each [num_seqs, max_len, num_kv_heads, head_dim] (positions past a sequence's length hold
    whatever the blocks hold)."""
    block_size = kv_layer.shape[2]
    num_blocks = -(-max_len // block_size)
    blocks = kv_layer[block_tables[:, :num_blocks].long()]  # [seqs, n, 2, block_size, kv_heads, d]
    k = blocks[:, :, 0].flatten(1, 2)[:, :max_len]
    v = blocks[:, :, 1].flatten(1, 2)[:, :max_len]
    return k, v


def paged_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    return_lse: bool = False, max_query_len: int | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention for a batch of sequences over the paged cache, the new tokens already
    stored. q [num_tokens, num_heads, head_dim] holds each sequence's new tokens in turn
    (sequence i owns rows query_start_loc[i]:query_start_loc[i+1]); seq_lens [num_seqs] counts
    each sequence's tokens including the new ones, so its new tokens sit at the last positions.
    block_tables [num_seqs, max_blocks] int32. Returns out [num_tokens, num_heads, head_dim] in
    q's dtype, and with return_lse the log-sum-exp of the scores [num_tokens, num_heads]
    (-inf for a sequence of length 0, whose output is 0). Rows past query_start_loc[-1]
    (padding) belong to no sequence: the reference gives them 0 and lse -inf; kernels may leave
    them unwritten.
    max_query_len (the longest run of new tokens) lets kernels size their grid without reading
    query_start_loc on the host; the reference ignores it.
    query_positions [num_tokens] int32, when given, places each new token at a position of its
    own instead (ascending within its sequence, the last one below its seq_len): a token at
    position p sees the sequence's tokens 0..p, so a sequence's new tokens may be any of its
    tokens (CacheBlend recomputes scattered ones, every key already in the cache)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = len(seq_lens), kv_layer.shape[3]
    group = num_heads // num_kv_heads
    starts = query_start_loc[:-1].long()
    query_lens = query_start_loc[1:].long() - starts
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), query_lens)  # [tokens]
    num_real = len(seq_of)  # rows past the last sequence's are padding
    index = torch.arange(num_real, device=q.device) - starts[seq_of]  # within its sequence
    max_q, max_len = int(query_lens.max()), max(int(seq_lens.max()), 1)
    # Queries padded per sequence, heads split into (kv head, group): [seqs, max_q, kv_heads, group, d]
    q_pad = q.new_zeros(num_seqs, max_q, num_heads, head_dim).float()
    q_pad[seq_of, index] = q[:num_real].float()
    q_pad = q_pad.view(num_seqs, max_q, num_kv_heads, group, head_dim)
    # Blocks past a sequence's length hold anything (stale or never-written values, NaN
    # included; table entries past its blocks, anything): zero those keys and values, so the
    # masked-out scores' zero weights cannot meet a NaN.
    key_pos = torch.arange(max_len, device=q.device)
    in_seq = key_pos.view(1, -1) < seq_lens.long().view(-1, 1)  # [seqs, max_len]
    blocks_used = -(-seq_lens.long() // kv_layer.shape[2])
    table = block_tables[:, :-(-max_len // kv_layer.shape[2])]
    past_end = torch.arange(table.shape[1], device=q.device) >= blocks_used[:, None]
    table = table.masked_fill(past_end, 0)
    k, v = gather_kv(kv_layer, table, max_len)  # [seqs, max_len, kv_heads, d]
    k = k.float().masked_fill(~in_seq[:, :, None, None], 0.0)
    v = v.float().masked_fill(~in_seq[:, :, None, None], 0.0)
    scores = torch.einsum("sqhgd,slhd->shgql", q_pad, k) * scale
    if query_positions is None:
        query_pos = (seq_lens.long() - query_lens).unsqueeze(1) + torch.arange(max_q, device=q.device)
    else:  # padded rows at -1: they see nothing, and are dropped below
        query_pos = torch.full((num_seqs, max_q), -1, dtype=torch.long, device=q.device)
        query_pos[seq_of, index] = query_positions[:num_real].long()
    hidden = key_pos.view(1, 1, -1) > query_pos.unsqueeze(-1)  # [seqs, max_q, max_len]
    scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [seqs, kv_heads, group, max_q]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("shgql,slhd->sqhgd", probs, v).reshape(num_seqs, max_q, num_heads, head_dim)
    out = F.pad(out[seq_of, index].to(q.dtype), (0, 0, 0, 0, 0, num_tokens - num_real))
    if not return_lse:
        return out
    lse = lse.permute(0, 3, 1, 2).reshape(num_seqs, max_q, num_heads)[seq_of, index]
    return out, F.pad(lse, (0, 0, 0, num_tokens - num_real), value=float("-inf"))


def paged_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
) -> torch.Tensor:
    """One new token per sequence: q [batch, num_heads, head_dim], seq_lens [batch] including
    the new token. Sequences with seq_len 0 (padding) give zeros. num_splits (how many pieces
    a kernel cuts each sequence into) is a tuning knob of the kernels; the reference ignores
    it."""
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, kv_layer, block_tables, query_start_loc, seq_lens, scale)


def attend_ranges(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, starts: torch.Tensor,
    ends: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row, q [rows, num_heads, head_dim], over the tokens [starts[i], ends[i])
    of block_tables[i] (no causal mask): (out [rows, num_heads, head_dim] float32,
    lse [rows, num_heads] float32, natural log). A row with no token gives 0 and lse -inf."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    group = num_heads // num_kv_heads
    max_len = max(int(ends.max()) if rows else 0, 1)
    key_pos = torch.arange(max_len, device=q.device)
    seen = (key_pos >= starts.long()[:, None]) & (key_pos < ends.long()[:, None])  # [rows, len]
    table = block_tables[:, :-(-max_len // block_size)]
    past_end = torch.arange(table.shape[1], device=q.device) * block_size >= ends.long()[:, None]
    k, v = gather_kv(kv_layer, table.masked_fill(past_end, 0), max_len)  # [rows, len, kv, d]
    k = k.float().masked_fill(~seen[:, :, None, None], 0.0)  # unseen slots may hold NaN
    v = v.float().masked_fill(~seen[:, :, None, None], 0.0)
    qg = q.float().view(rows, num_kv_heads, group, head_dim)
    scores = torch.einsum("rhgd,rlhd->rhgl", qg, k) * scale
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [rows, kv_heads, group]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("rhgl,rlhd->rhgd", probs, v)
    return out.reshape(rows, num_heads, head_dim), lse.reshape(rows, num_heads)


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets from each one's normalised output o [..., head_dim]
    and log-sum-exp lse [...] (natural log, -inf = no key, its o then 0), in float32:
    o = sigmoid(lse_a - lse_b) * o_a + (1 - sigmoid(lse_a - lse_b)) * o_b and
    lse = logaddexp(lse_a, lse_b). An empty side leaves the other exactly; both empty give 0."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    w = torch.sigmoid(torch.where(both_empty, 0.0, lse_a - lse_b)).unsqueeze(-1)
    out = w * o_a.float() + (1 - w) * o_b.float()
    return out.masked_fill(both_empty.unsqueeze(-1), 0.0), torch.logaddexp(lse_a, lse_b)


def relay_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor, members: torch.Tensor, group_starts: torch.Tensor, scale: float,
    *, num_splits: int | None = None, num_prefix_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention where relay groups share a prefix, as the relay decomposition: each
    member's query over its group's prefix (tokens [0, prefix_len) of the group's first
    member's table), its own part (tokens [prefix_len, seq_len) of its table), merged by
    merge_attention_states. Arguments as kernels/relay_attention.py documents them: prefix_lens
    [batch] int32 (0 = no group), members [max_members] int32 batch rows, group g owning
    members[group_starts[g]:group_starts[g + 1]]. Equal to paged_decode_attention over each
    sequence's whole table. Checks the group buffers' invariants (a host sync: the CPU path).
    num_splits and num_prefix_splits are the kernels' tuning knobs; ignored here."""
    batch = q.shape[0]
    starts = group_starts.tolist()
    prefix_row = torch.arange(batch, device=q.device)  # whose table holds a row's prefix
    in_group = torch.zeros(batch, dtype=torch.bool, device=q.device)
    for g in range(len(starts) - 1):
        if not starts[g] <= starts[g + 1] <= members.numel():
            raise ValueError(f"group_starts must be non-decreasing within members: {starts}")
        rows = members[starts[g]:starts[g + 1]].long()
        if len(rows) == 0:
            continue
        if in_group[rows].any() or (prefix_lens[rows] != prefix_lens[rows[0]]).any():
            raise ValueError(f"group {g}: a row in two groups, or members of unequal prefix_lens")
        in_group[rows] = True
        prefix_row[rows] = rows[0]
    if ((prefix_lens > 0) & ~in_group).any():
        raise ValueError("a row with prefix_lens > 0 is in no group")
    zeros = torch.zeros_like(prefix_lens)
    o_p, lse_p = attend_ranges(q, kv_layer, block_tables[prefix_row], zeros, prefix_lens, scale)
    o_o, lse_o = attend_ranges(q, kv_layer, block_tables, prefix_lens, seq_lens, scale)
    out, _ = merge_attention_states(o_p, lse_p, o_o, lse_o)
    return out.to(q.dtype)


def silu_and_mul(
    x: torch.Tensor, token_slots: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    scaled: torch.Tensor | None = None, in_scale: torch.Tensor | None = None,
    in_scaled: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [num_tokens, 2 * intermediate] (gate | up) -> silu(gate) * up [num_tokens, intermediate].
    IA3 (token_slots [num_tokens] and the rest given together): gate | up of each token whose slot
    sets scaled [num_slots] are multiplied by scale[slot] [num_slots, 2 * intermediate] first, and
    the result of each token whose slot sets in_scaled by in_scale[slot] [num_slots,
    intermediate] (float32 products rounded to x's dtype: gate_proj's and up_proj's output
    vectors, down_proj's input vector). Or scaled and in_scaled [num_slots] int64 offsets into
    1-D scale and in_scale (see _scale_flagged)."""
    if token_slots is not None:
        x = _scale_flagged(x, scale, scaled, token_slots)
    gate, up = x.chunk(2, dim=-1)
    out = F.silu(gate) * up
    if token_slots is not None:
        out = _scale_flagged(out, in_scale, in_scaled, token_slots)
    return out


def _scale_flagged(x: torch.Tensor, scale: torch.Tensor, flags: torch.Tensor,
                   token_slots: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, n] * scale[slot] [num_slots, n] for the tokens whose slot sets flags
    [num_slots] int32, in float32, rounded to x's dtype; other rows as they are. Or, flags
    [num_slots] int64 (scale_offsets), a slot's row is scale[flags[slot]:][:n] of a 1-D scale
    (the adapter pool as float32), none where flags[slot] is -1."""
    slots = token_slots.long()
    if flags.dtype == torch.int64:
        at = flags[slots]
        on = (at >= 0).unsqueeze(1)
        rows = scale[at.clamp_min(0).unsqueeze(1) + torch.arange(x.shape[1], device=x.device)]
    else:
        on = (flags[slots] != 0).unsqueeze(1)  # [num_tokens, 1]
        rows = scale[slots]
    return torch.where(on, x.float() * rows, x.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [num_tokens, in_features], weight [out_features, in_features] (nn.Linear's layout),
    bias [out_features] or None -> x @ weight.T + bias [num_tokens, out_features] in out_dtype
    (default x's dtype), computed in float32 (exactly F.linear for float32 inputs)."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(out_dtype or x.dtype)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    """x [num_tokens, in], lora_a [num_slots, num_slices, max_rank, in], token_slots
    [num_tokens] (0 = no adapter), ranks [num_slots, num_slices] -> float32
    [num_slices, num_tokens, max_rank]; entries past a slot's rank, and rows of tokens with no
    adapter, are 0."""
    num_slices, max_rank = lora_a.shape[1], lora_a.shape[2]
    out = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    slot_ranks = ranks.tolist()
    for slot, rows in _rows_by_slot(token_slots):
        xs = x[rows].float()
        for s in range(num_slices):
            r = slot_ranks[slot][s]
            if r > 0:
                out[s, rows, :r] = xs @ lora_a[slot, s, :r].float().T
    return out


def lora_expand(
    y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, slice_offsets: tuple[int, ...], scale: torch.Tensor | None = None,
    scaled: torch.Tensor | None = None, shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [num_tokens, out] += per slice s: shrunk[s] @ lora_b[slot, off_s:off_{s+1}, :rank].T,
    in place. shrunk [num_slices, num_tokens, max_rank] float32, lora_b
    [num_slots, out, max_rank], slice_offsets (num_slices + 1 ints, last = out).
    The epilogue, for tokens whose slot has scaled[slot] set (scaled [num_slots] int32):
    y <- scale[slot] * (y + delta) + shift[slot], in float32 (scale, shift [num_slots, out]
    float32; shift None means 0): DoRA's magnitude over the row norm, IA3's output vector."""
    slot_ranks = ranks.tolist()
    is_scaled = [False] * len(slot_ranks) if scaled is None else [bool(v) for v in scaled.tolist()]
    for slot, rows in _rows_by_slot(token_slots):
        if is_scaled[slot]:
            out = y[rows].float()
            for s in range(len(slice_offsets) - 1):
                r = slot_ranks[slot][s]
                lo, hi = slice_offsets[s], slice_offsets[s + 1]
                if r:
                    out[:, lo:hi] += shrunk[s, rows, :r] @ lora_b[slot, lo:hi, :r].float().T
            out = out * scale[slot]
            if shift is not None:
                out = out + shift[slot]
            y[rows] = out.to(y.dtype)
            continue
        for s in range(len(slice_offsets) - 1):
            r = slot_ranks[slot][s]
            if r == 0:
                continue
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            delta = shrunk[s, rows, :r] @ lora_b[slot, lo:hi, :r].float().T
            y[rows, lo:hi] += delta.to(y.dtype)
    return y


def scale_rows(x: torch.Tensor, scales: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, in] * scales[slot] for each token's slot (scales [num_slots, in] float32,
    row 0 and the rows of slots that scale nothing all 1): IA3's input vectors."""
    return (x.float() * scales[token_slots.long()]).to(x.dtype)


def flora_stack(
    x: torch.Tensor, lora_a: torch.Tensor, flora_ranks: torch.Tensor, row_tokens: torch.Tensor,
    row_slots: torch.Tensor, row_ranks: torch.Tensor, per_slice: bool,
) -> torch.Tensor:
    """The rows of FLoRA's base products: x [num_tokens, in], lora_a [num_slots, num_slices,
    max_rank, in] (FLoRA's A in its slots), row_tokens, row_slots and row_ranks [num_rows] int
    (row j is component row_ranks[j] < max_rank of token row_tokens[j], in slot row_slots[j];
    padding rows: slot 0) -> the rows a[slot, s, k] * x[t] of each slice s (zero where k is past
    the slot's FLoRA rank of that slice), laid out
    - fused: [num_tokens + num_slices * num_rows, in]: x, then slice 0's rows, slice 1's, ...
    - per_slice: [num_slices * (num_tokens + num_rows), in]: per slice, x then its rows."""
    num_slices = lora_a.shape[1]
    tokens, slots, ks = row_tokens.long(), row_slots.long(), row_ranks.long()
    parts = []
    for s in range(num_slices):
        a = lora_a[slots, s, ks].float()  # [num_rows, in]
        live = ((ks < flora_ranks[slots, s].long()) & (slots > 0)).unsqueeze(1)
        rows = torch.where(live, a * x[tokens].float(), 0.0).to(x.dtype)
        parts += [x, rows] if per_slice else [rows]
    return torch.cat(parts if per_slice else [x] + parts)


def flora_combine(
    products: torch.Tensor, flora_b: torch.Tensor, token_slots: torch.Tensor, flora_ranks: torch.Tensor,
    bounds: torch.Tensor, slice_offsets: tuple[int, ...], num_rows: int, per_slice: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> y [num_tokens, out]: each token's own product plus bias [out]; the columns of each
    slice that a token's FLoRA adapter adapts are sum_k flora_b[slot, k, col] * (product of its
    row k) plus bias instead. products: the base weight times flora_stack's rows (no bias),
    flattened in flora_stack's layout (per_slice: slice s's [num_tokens + num_rows, width]
    block at (num_tokens + num_rows) * slice_offsets[s]); bounds [num_tokens + 1]: token t's rows
    are bounds[t]:bounds[t + 1] in turn (rows past bounds[num_tokens] are padding). flora_b
    [num_slots, max_rank, out]: FLoRA's B transposed."""
    num_tokens, out_features = len(token_slots), slice_offsets[-1]
    num_slices, block = len(slice_offsets) - 1, len(token_slots) + num_rows
    y = torch.empty(num_tokens, out_features, dtype=products.dtype, device=products.device)
    num_used = int(bounds[-1])
    counts = (bounds[1:] - bounds[:-1]).long()
    tokens = torch.repeat_interleave(torch.arange(num_tokens, device=y.device), counts)  # [num_used]
    ks = torch.arange(num_used, device=y.device) - bounds[:-1].long()[tokens]
    slots = token_slots.long()[tokens]
    for s in range(num_slices):
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        if per_slice:
            part = products[block * lo:block * hi].view(block, hi - lo)
            own, rows = part[:num_tokens], part[num_tokens:num_tokens + num_used]
        else:
            full = products.view(num_tokens + num_slices * num_rows, out_features)
            own = full[:num_tokens, lo:hi]
            rows = full[num_tokens + s * num_rows:num_tokens + s * num_rows + num_used, lo:hi]
        acc = own.float()
        live = (ks < flora_ranks[slots, s].long()) & (slots > 0)  # [num_used]
        if num_used:
            terms = torch.where(live.unsqueeze(1), flora_b[slots, ks, lo:hi].float() * rows.float(), 0.0)
            flora = torch.zeros(num_tokens, hi - lo, dtype=torch.float32, device=y.device)
            flora.index_add_(0, tokens, terms)
            adapted = torch.zeros(num_tokens, dtype=torch.bool, device=y.device)
            adapted[tokens[live]] = True
            acc = torch.where(adapted.unsqueeze(1), flora, acc)
        if bias is not None:
            acc = acc + bias[lo:hi].float()
        y[:, lo:hi] = acc.to(y.dtype)
    return y


def gather_pages(pool: torch.Tensor, pages: torch.Tensor, ranks: torch.Tensor, row_lens: list[int],
                 max_rank: int) -> list[torch.Tensor]:
    """The dense rows that lora_paged.py's page tables name: pool [elements], pages [num_slots,
    num_slices, max_pages] int64 (rank page p of slice s: a [PAGE_RANK, row_lens[s]] block at
    pool[pages[slot, s, p]]), ranks [num_slots, num_slices] -> per slice [num_slots, max_rank,
    row_lens[s]] in pool's dtype, zero past each slot's rank and on slot 0 (their table entries
    are never followed)."""
    r = torch.arange(max_rank, device=pool.device)
    ranks = ranks.long().clone()
    ranks[0] = 0
    out = []
    for s, n in enumerate(row_lens):
        live = r[None, :] < ranks[:, s, None]  # [num_slots, max_rank]
        starts = torch.where(live, pages[:, s, r // PAGE_RANK] + (r % PAGE_RANK) * n, 0)
        rows = pool.unfold(0, n, 1).index_select(0, starts.view(-1))  # row i of the view: pool[i:i + n]
        out.append(rows.view(*starts.shape, n).masked_fill(~live[:, :, None], 0))
    return out


def gather_vectors(vectors: torch.Tensor, at: torch.Tensor, length: int, default: float) -> torch.Tensor:
    """[num_slots, length] float32: vectors[at[slot]:][:length] per slot, `default` where at is -1."""
    rows = [vectors[i:i + length] if i >= 0 else torch.full((length,), default, device=vectors.device)
            for i in at.tolist()]
    return torch.stack(rows).float()


def paged_lora_a(pool: torch.Tensor, a_pages: torch.Tensor, ranks: torch.Tensor, in_features: int,
                 max_rank: int) -> torch.Tensor:
    """lora_a [num_slots, num_slices, max_rank, in] from rank pages (see gather_pages)."""
    num_slices = a_pages.shape[1]
    return torch.stack(gather_pages(pool, a_pages, ranks, [in_features] * num_slices, max_rank), dim=1)


def paged_lora_bt(pool: torch.Tensor, b_pages: torch.Tensor, ranks: torch.Tensor,
                  slice_offsets: tuple[int, ...], max_rank: int) -> torch.Tensor:
    """B transposed [num_slots, max_rank, out] (flora_b's layout) from rank pages: slice s's
    pages hold its [rank, width_s] rows."""
    widths = [hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:])]
    return torch.cat(gather_pages(pool, b_pages, ranks, widths, max_rank), dim=2)


def _top_rank(ranks: torch.Tensor) -> int:
    """The largest rank of the slots in ranks [num_slots, num_slices] but slot 0 (at least 1)."""
    return max(1, int(ranks[1:].max())) if len(ranks) > 1 else 1


def _used_slots(slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the slots slot_ids name, slot 0 first: sorted, unique; slot_ids renumbered into them).
    The paged references gather only the pages of the slots a call uses: the engine's tables
    have a row for every slot (hundreds on a small model), and gathering them all each call
    made a CPU step take seconds."""
    ids = slot_ids.long()
    zero = torch.zeros(1, dtype=torch.long, device=ids.device)
    used = torch.unique(torch.cat([zero, ids.reshape(-1)]))
    return used, torch.searchsorted(used, ids).to(slot_ids.dtype)


MAX_LONE_TOKENS = 256
"""Most tokens of a step that LoneSplit lists (those past it stay in the tiles): a step's lone
tokens are at most its sequences, and 256 is SchedulerConfig.max_num_seqs's default."""


class LoneSplit(NamedTuple):
    """A step's tokens split between the paged LoRA kernels' tiles and their per-token kernels
    (lora_paged.SPLIT_LONE). The results do not depend on it: the reference ops ignore it."""

    run_slots: torch.Tensor
    """[num_tokens] int32: token_slots with the listed tokens' slots 0 (the tiles skip them)."""
    lone_tokens: torch.Tensor
    """[min(num_tokens, MAX_LONE_TOKENS)] int32: the listed tokens, ascending, then -1."""


def lone_split(token_slots: torch.Tensor) -> LoneSplit:
    """List the lone tokens of `token_slots` [num_tokens] (those whose slot neither neighbour
    carries: a decode row beside other adapters' rows), the first MAX_LONE_TOKENS of them."""
    n = token_slots.shape[0]
    slots = token_slots.to(torch.int32)
    edge = torch.full((1,), -1, dtype=torch.int32, device=slots.device)
    before, after = torch.cat([edge, slots[:-1]]), torch.cat([slots[1:], edge])
    lone = (slots != before) & (slots != after)
    rank = torch.cumsum(lone, 0, dtype=torch.int32) - 1
    size = min(n, MAX_LONE_TOKENS)
    listed = lone & (rank < size)
    lone_tokens = torch.full((size + 1,), -1, dtype=torch.int32, device=slots.device)
    index = torch.where(listed, rank, size).to(torch.int64)  # the unlisted to a spare entry
    lone_tokens.scatter_(0, index, torch.arange(n, dtype=torch.int32, device=slots.device))
    return LoneSplit(torch.where(listed, 0, slots), lone_tokens[:size])


def no_split(token_slots: torch.Tensor) -> None:
    """reference_ops' lone_split: the reference ops share no work out, so they take no split."""
    return None


def lora_shrink_paged(x: torch.Tensor, pool: torch.Tensor, a_pages: torch.Tensor,
                      token_slots: torch.Tensor, ranks: torch.Tensor, max_rank: int,
                      split: LoneSplit | None = None) -> torch.Tensor:
    """lora_shrink with A in rank pages (kernels/lora_paged.py's layout). `split`: how the
    Triton kernels share the tokens out (LoneSplit); ignored here."""
    used, local = _used_slots(token_slots)
    top = _top_rank(ranks[used])  # rows past it are zeros: not gathered
    shrunk = lora_shrink(x, paged_lora_a(pool, a_pages[used], ranks[used], x.shape[1], top), local,
                         ranks[used])
    return F.pad(shrunk, (0, max_rank - top))


def lora_expand_paged(
    y: torch.Tensor, shrunk: torch.Tensor, pool: torch.Tensor, b_pages: torch.Tensor,
    token_slots: torch.Tensor, ranks: torch.Tensor, slice_offsets: tuple[int, ...],
    vectors: torch.Tensor | None = None, scale_at: torch.Tensor | None = None,
    shift_at: torch.Tensor | None = None, split: LoneSplit | None = None,
) -> torch.Tensor:
    """lora_expand with B (transposed) in rank pages and the epilogue's vectors at scale_at,
    shift_at (-1: none) in vectors, the pool as float32 (kernels/lora_paged.py's layout).
    `split` as lora_shrink_paged's."""
    used, local = _used_slots(token_slots)
    ranks = ranks[used]
    lora_b = paged_lora_bt(pool, b_pages[used], ranks, slice_offsets, _top_rank(ranks)).transpose(1, 2)
    scale = scaled = shift = None
    if scale_at is not None:
        out_features = slice_offsets[-1]
        scale = gather_vectors(vectors, scale_at[used], out_features, 1.0)
        scaled = (scale_at[used] >= 0).to(torch.int32)
        if shift_at is not None:
            shift = gather_vectors(vectors, shift_at[used], out_features, 0.0)
    return lora_expand(y, shrunk, lora_b, local, ranks, slice_offsets, scale, scaled, shift)


def scale_rows_paged(x: torch.Tensor, vectors: torch.Tensor, scale_at: torch.Tensor,
                     token_slots: torch.Tensor) -> torch.Tensor:
    """scale_rows with each slot's vector at scale_at[slot] in vectors (-1: all 1)."""
    used, local = _used_slots(token_slots)
    return scale_rows(x, gather_vectors(vectors, scale_at[used], x.shape[1], 1.0), local)


def flora_stack_paged(
    x: torch.Tensor, pool: torch.Tensor, a_pages: torch.Tensor, flora_ranks: torch.Tensor,
    row_tokens: torch.Tensor, row_slots: torch.Tensor, row_ranks: torch.Tensor, per_slice: bool,
) -> torch.Tensor:
    """flora_stack with FLoRA's A in rank pages."""
    used, local = _used_slots(row_slots)
    a = paged_lora_a(pool, a_pages[used], flora_ranks[used], x.shape[1], a_pages.shape[2] * PAGE_RANK)
    return flora_stack(x, a, flora_ranks[used], row_tokens, local, row_ranks, per_slice)


def flora_combine_paged(
    products: torch.Tensor, pool: torch.Tensor, b_pages: torch.Tensor, token_slots: torch.Tensor,
    flora_ranks: torch.Tensor, bounds: torch.Tensor, slice_offsets: tuple[int, ...], num_rows: int,
    per_slice: bool, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """flora_combine with FLoRA's B (transposed, per slice) in rank pages."""
    used, local = _used_slots(token_slots)
    flora_b = paged_lora_bt(pool, b_pages[used], flora_ranks[used], slice_offsets,
                            b_pages.shape[2] * PAGE_RANK)
    return flora_combine(products, flora_b, local, flora_ranks[used], bounds, slice_offsets, num_rows,
                         per_slice, bias)


def _rows_by_slot(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, indices of its tokens) for every adapter slot present, slot 0 left out. Grouped
    on the host: one device sync per call, not one per slot."""
    groups: dict[int, list[int]] = {}
    for index, slot in enumerate(token_slots.tolist()):
        if slot:
            groups.setdefault(slot, []).append(index)
    return [(slot, torch.tensor(rows, device=token_slots.device)) for slot, rows in groups.items()]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> int64 [rows]: the first index of each row's maximum."""
    return logits.argmax(dim=-1)


def mask_logits(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [batch, vocab] float, rows [m] int64 (rows of logits that are masked; -1:
    padding), bitmask [m, >= ceil(vocab / 32)] int32 (bit j of word i set: token 32 i + j
    allowed) -> a copy of logits whose masked rows have -inf at every token their mask leaves
    out (other rows unchanged)."""
    vocab = logits.shape[-1]
    keep = rows >= 0
    rows, bitmask = rows[keep], bitmask[keep]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(bitmask), -1)[:, :vocab].bool()
    masked = logits.clone()
    masked[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return masked


def score_tokens(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] float32, targets [rows] int -> float32 [rows, 4]:
    log_softmax(logits)[target], the target's rank (1 + the tokens scored higher), the row's
    top log-probability and the first index of it."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # [rows]
    chosen = logits.gather(1, targets.view(-1, 1).long()).view(-1)
    top, index = logits.max(dim=-1)
    rank = (logits > chosen[:, None]).sum(dim=-1) + 1
    return torch.stack([chosen - lse, rank.float(), top - lse, index.float()], dim=1)


def sampling_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exponential(1) noise [batch, vocab] drawn from each row's (seed, offset) alone, so a
    request's draws do not depend on what else is in the batch or on recomputation."""
    noise = torch.empty(len(seeds), vocab_size, dtype=torch.float32)
    for i, (seed, offset) in enumerate(zip(seeds.tolist(), offsets.tolist())):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + offset) % (2**63))
        noise[i].exponential_(generator=generator)
    return noise.to(seeds.device)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    seeds: torch.Tensor, offsets: torch.Tensor,
) -> torch.Tensor:
    """Sample one token per row of logits [batch, vocab]. temperature [batch] (0 = greedy),
    top_k [batch] int (<= 0 or >= vocab = off), top_p [batch] (>= 1 = off), seeds and offsets
    [batch] int64 pick the noise (the offset is the index of the token being sampled). Top-k is
    applied before top-p. Each row's token depends on that row alone. Returns int64 [batch]."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    filters = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    if bool(filters.any()):  # only the rows that filter pay for a sort of the vocabulary
        rows = filters.nonzero().view(-1)
        scaled = scaled.clone()
        scaled[rows] = _top_k_top_p(scaled[rows], top_k[rows], top_p[rows])
    probs = scaled.softmax(dim=-1)
    noise = sampling_noise(seeds, offsets, vocab)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """scaled [rows, vocab] with the tokens outside each row's top-k, then outside its top-p mass,
    set to -inf (a row's top_k <= 0 and top_p >= 1 are off)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.where(top_p < 1, top_p, float("inf")).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)

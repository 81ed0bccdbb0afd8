"""Attention sinks (StreamingLLM, Xiao et al. 2023): a request whose KV keeps its first tokens
(the sinks) and a recent window, so that it runs past the model's context in bounded memory.

Layout. The sinks are the request's first `sink_blocks` blocks; the window, the blocks after
them. When every token of the window's first block is more than `sliding_window` tokens behind
the next token to compute, the block is dropped (freed back to the pool) and the blocks after it
move up in the request's block list. The attention kernels see one contiguous sequence: the
cache-relative position of a kept token is its index in that list of blocks, which is what
StreamingLLM assigns (positions within the cache, not in the text), and queries take their
cache-relative positions too.

Keys are stored rotated (rotary is applied as K is written, loraplex/kernels/*rotary*), so when
a block drops, the kept window's keys are rotated back by the tokens dropped: a rotary rotation
composes, R(p - s) k = R(-s) R(p) k. One rotation per drop, over the window's blocks of every
layer at once; a key is rotated at most ceil(sliding_window / block_size) times while it stays in
the window (float32: exact to ~1e-6; bf16 rounds at each rotation). Values carry no position.

Bookkeeping is pure Python (the scheduler's); `rotate_keys` is the runner's (torch, any device)."""

from __future__ import annotations

import torch

from loraplex.types import StreamingWindow


def sink_blocks(window: StreamingWindow, block_size: int) -> int:
    """Blocks that hold the sinks (kept for good)."""
    return -(-window.attention_sinks // block_size)


def max_cached_tokens(window: StreamingWindow, block_size: int) -> int:
    """The most tokens a request with this window holds in the cache at a decode step: its sink
    blocks, a window that may run a block past `sliding_window`, and the token computed."""
    return sink_blocks(window, block_size) * block_size + window.sliding_window + block_size


def window_problem(window: StreamingWindow, block_size: int, max_model_len: int) -> str | None:
    """Why a cache of `max_model_len` tokens cannot hold `window`'s sinks and window, or None if
    it can."""
    bs, need = block_size, max_cached_tokens(window, block_size)
    if need <= max_model_len:
        return None
    return (f"{window.attention_sinks} attention sinks (kept in whole blocks of {bs} tokens: "
            f"{sink_blocks(window, bs) * bs}) and a sliding window of {window.sliding_window} tokens "
            f"need {need} tokens of cache (a block more for the tokens being computed); this "
            f"model's context is {max_model_len}: make the window at most "
            f"{window.sliding_window - (need - max_model_len)}")


def blocks_to_drop(window: StreamingWindow, block_size: int, num_computed: int, num_dropped: int) -> int:
    """Window blocks to drop before computing from token `num_computed` (of the text) on, when
    `num_dropped` tokens were dropped before: those whose tokens are all more than
    `sliding_window` behind it."""
    first_kept = sink_blocks(window, block_size) * block_size + num_dropped  # (text position)
    return max(0, num_computed - window.sliding_window - first_kept) // block_size


def rotate_keys(kv_cache: torch.Tensor, blocks: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate the keys of `blocks` [n] int64 (every layer, in place) by the angles of one
    cos_sin row [head_dim] float32 (cos in the first half, sin in the second; the "rotate half"
    layout of loraplex.model.rope), with the sin negated: back by that row's position.
    kv_cache [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]."""
    keys = kv_cache[blocks, :, 0].float()  # [n, layers, block_size, kv_heads, head_dim]
    cos, sin = cos_sin.float().chunk(2)
    x1, x2 = keys.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)
    kv_cache[blocks, :, 0] = rotated.to(kv_cache.dtype)

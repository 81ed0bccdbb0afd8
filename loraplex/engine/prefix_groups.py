"""Shared prefixes across an offline batch, found globally (BatchLLM's lesson). Pure Python.

Sorting the prompts by (tenant, adapter digest, token ids) lists them in the depth-first order
of a prefix tree over the whole batch: prompts that share a prefix sit side by side, and a
prefix shared by a subset of a group sits inside that group's run. Only whole KV blocks are
shared (the prefix cache's unit), and never a prompt's last token (each request computes it: it
samples from it), so two neighbours share `min(common tokens, len - 1 of each) // block_size`
blocks. A group is a maximal run of neighbours that share at least one block.

Submitted in this order, a group's first member computes the shared blocks, the others wait
for them and take them from the prefix cache (the scheduler holds a fresh request back while
another request's step writes its next prompt block), and the group runs together, so its
shared KV is held for as short a time as the batch allows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptKey:
    """What decides whether two prompts can share KV: the same tenant (the prefix cache never
    shares across tenants), the same adapter weights, and the same leading tokens."""

    tenant: str
    adapter: str | None  # digest; None: the base model
    token_ids: list[int]


@dataclass(frozen=True)
class PrefixGroup:
    members: tuple[int, ...]
    """Indices into the batch, in submission order."""
    num_shared_blocks: int
    """Whole KV blocks every member's prompt starts with (0 for a prompt alone)."""


def group_by_prefix(keys: Sequence[PromptKey], block_size: int) -> list[PrefixGroup]:
    """The batch's prompts cut into groups that share whole blocks, each group's members in
    prefix-tree order, the groups in the order of their first prompt in the batch (a batch with
    nothing shared keeps its order). Every index appears once; groups of one are prompts that
    share no block with any other."""
    order = sorted(range(len(keys)), key=lambda i: (keys[i].tenant, keys[i].adapter or "",
                                                    keys[i].token_ids))
    groups: list[PrefixGroup] = []
    members: list[int] = []
    shared = 0
    for index in order:
        if members:
            blocks = _shared_blocks(keys[members[-1]], keys[index], block_size)
            if blocks > 0:
                members.append(index)
                shared = blocks if len(members) == 2 else min(shared, blocks)
                continue
            groups.append(PrefixGroup(tuple(members), shared))
        members, shared = [index], 0
    if members:
        groups.append(PrefixGroup(tuple(members), shared))
    return sorted(groups, key=lambda group: min(group.members))


def _shared_blocks(a: PromptKey, b: PromptKey, block_size: int) -> int:
    if a.tenant != b.tenant or a.adapter != b.adapter:
        return 0
    limit = (min(len(a.token_ids), len(b.token_ids)) - 1) // block_size  # each computes its last token
    blocks = 0
    while blocks < limit and (a.token_ids[blocks * block_size:(blocks + 1) * block_size]
                              == b.token_ids[blocks * block_size:(blocks + 1) * block_size]):
        blocks += 1
    return blocks

"""Relay groups of a decode step: rows that hold the same leading KV blocks (a prefix found in
the prefix cache, a registered system prompt, the samples of one prompt) read that prefix
once per step for the whole group (RelayAttention, kernels/relay_attention.py). Numpy only.

Blocks are shared only as prefixes (a shared block's chained hash pins everything before it),
so rows with the same first block form a candidate group, and its prefix is the run of leading
blocks that every member holds, ending before each member's newest token. Two adapters or two
tenants never share a block, so they never share a group.

When relay pays (`RelayRule`), measured on the H100 with `loraplex bench relay-kernels`
(bench/results/relay-kernels-h100.json, own context 160 tokens, batches 64-256): a prefix of
128 tokens was never faster than plain paged decode; at 512 tokens from groups of 16; at 2,048
and 4,096 from groups of 4. Rule: prefix >= 2,048 and group >= 4, or prefix >= 512 and group >=
16; otherwise the plain path. A step with no group that pays runs the plain kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

RelayMode = Literal["auto", "always", "off"]
MEASURED_MIN_GROUP = ((2048, 4), (512, 16))
"""(prefix tokens at least, smallest group that pays), longest prefix first."""


@dataclass(frozen=True)
class RelayRule:
    mode: RelayMode
    """"auto": the measured rule; "always": every group of 2 or more with a prefix of one block
    or more (tests, benchmarks); "off": never."""

    def pays(self, num_members: int, prefix_len: int) -> bool:
        if self.mode == "off" or num_members < 2 or prefix_len == 0:
            return False
        if self.mode == "always":
            return True
        return any(prefix_len >= p and num_members >= g for p, g in MEASURED_MIN_GROUP)


@dataclass(frozen=True)
class RelayGroups:
    prefix_lens: np.ndarray  # [num_rows] int32: tokens of each row's shared prefix, 0: none
    members: np.ndarray  # [num_members] int32: row indices, group by group
    group_starts: np.ndarray  # [num_groups + 1] int32: group g owns members[starts[g]:starts[g+1]]

    @property
    def num_groups(self) -> int:
        return len(self.group_starts) - 1


NO_RELAY = RelayRule("off")
_NO_MEMBERS, _ONE_START = np.zeros(0, np.int32), np.zeros(1, np.int32)  # no groups (read only)


def find_groups(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
                rule: RelayRule) -> RelayGroups:
    """Relay groups among decode rows: block_tables [num_rows, max_blocks] (each row's first
    blocks valid), seq_lens [num_rows] (the new token included). Rows with a shared prefix
    that pays form groups; the others get prefix_lens 0."""
    num_rows = len(seq_lens)
    prefix_lens = np.zeros(num_rows, dtype=np.int32)
    if rule.mode == "off":
        return RelayGroups(prefix_lens, _NO_MEMBERS, _ONE_START)
    members: list[int] = []
    starts = [0]
    full = (seq_lens - 1) // block_size  # [num_rows] blocks wholly before the newest token
    candidates = np.flatnonzero(full > 0)
    if len(candidates) < 2:
        return RelayGroups(prefix_lens, _NO_MEMBERS, _ONE_START)
    firsts = block_tables[candidates, 0]
    order = np.argsort(firsts, kind="stable")
    bounds = np.flatnonzero(np.diff(firsts[order])) + 1
    for rows in np.split(candidates[order], bounds):
        if len(rows) < 2:
            continue
        width = int(full[rows].min())
        same = (block_tables[rows, :width] == block_tables[rows[0], :width]).all(axis=0)
        prefix = int(np.cumprod(same).sum()) * block_size
        if not rule.pays(len(rows), prefix):
            continue
        prefix_lens[rows] = prefix
        members += rows.tolist()
        starts.append(len(members))
    return RelayGroups(prefix_lens, np.asarray(members, dtype=np.int32), np.asarray(starts, dtype=np.int32))

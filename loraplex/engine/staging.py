"""Room in a staging area, handed out as runs of adjacent blocks (disaggregated prefill and
decode: the prefill side pushes a request's prompt blocks into the decode side's staging area
in one copy, so each request needs one run). First fit; a freed run joins its free neighbours."""

from __future__ import annotations

import bisect


class Runs:
    """Runs of adjacent block ids in [0, num_blocks)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, not {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[tuple[int, int]] = [(0, num_blocks)] if num_blocks else []
        """(start, length) of the free runs, by start; no two adjacent."""

    @property
    def num_free_blocks(self) -> int:
        return sum(length for _, length in self._free)

    def take(self, count: int) -> int | None:
        """The start of a run of `count` blocks, now taken; None if no free run is that long."""
        if count <= 0:
            raise ValueError(f"count must be positive, not {count}")
        for i, (start, length) in enumerate(self._free):
            if length >= count:
                if length == count:
                    del self._free[i]
                else:
                    self._free[i] = (start + count, length - count)
                return start
        return None

    def give_back(self, start: int, count: int) -> None:
        """Free the run [start, start + count) taken before."""
        i = bisect.bisect_left(self._free, (start, 0))
        before = self._free[i - 1] if i > 0 else None
        after = self._free[i] if i < len(self._free) else None
        if (start < 0 or start + count > self.num_blocks or (before and before[0] + before[1] > start)
                or (after and start + count > after[0])):
            raise ValueError(f"run [{start}, {start + count}) was not taken")
        if before and before[0] + before[1] == start:
            start, count, i = before[0], before[1] + count, i - 1
            del self._free[i]
        if i < len(self._free) and self._free[i][0] == start + count:
            count += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (start, count))

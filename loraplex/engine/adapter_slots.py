"""Which adapters occupy the device's LoRA slots. Pure Python bookkeeping; the weights are
copied by the model runner. Slot 0 means "no adapter" and is never handed out.

A slot whose adapter no running request uses stays resident (so the next request for it needs
no copy) until a new adapter needs the room: then the least recently used one is evicted. The
adapter itself stays in host memory and can be loaded again. A slot is never evicted while a
running request holds it."""

from __future__ import annotations

from collections import OrderedDict


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}
        self._holders = [0] * (num_slots + 1)
        self._idle: OrderedDict[int, str] = OrderedDict()  # resident, unheld; oldest first
        self._empty = list(range(num_slots, 0, -1))

    def slot_of(self, digest: str) -> int | None:
        return self._slot_of.get(digest)

    @property
    def resident(self) -> dict[str, int]:
        return dict(self._slot_of)

    def can_acquire(self, digest: str) -> bool:
        return digest in self._slot_of or bool(self._empty) or bool(self._idle)

    def acquire(self, digest: str) -> tuple[int, bool] | None:
        """Hold a slot for `digest`: (slot, needs_load), or None if every slot is held by
        running requests for other adapters."""
        slot = self._slot_of.get(digest)
        needs_load = slot is None
        if slot is None:
            if self._empty:
                slot = self._empty.pop()
            elif self._idle:
                slot, evicted = self._idle.popitem(last=False)
                del self._slot_of[evicted]
            else:
                return None
            self._slot_of[digest] = slot
        self._idle.pop(slot, None)
        self._holders[slot] += 1
        return slot, needs_load

    def release(self, digest: str) -> None:
        """Drop one hold; an unheld slot stays resident as the most recently used."""
        slot = self._slot_of[digest]
        if self._holders[slot] <= 0:
            raise ValueError(f"adapter {digest[:12]} released more often than acquired")
        self._holders[slot] -= 1
        if self._holders[slot] == 0:
            self._idle[slot] = digest

    def evict(self, digest: str) -> int | None:
        """Forget a resident adapter nobody holds (it was removed); returns its freed slot."""
        slot = self._slot_of.get(digest)
        if slot is None:
            return None
        if self._holders[slot]:
            raise ValueError(f"adapter {digest[:12]} is in use by running requests")
        del self._slot_of[digest]
        self._idle.pop(slot, None)
        self._empty.append(slot)
        return slot

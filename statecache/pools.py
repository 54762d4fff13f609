"""Free-list pools: KV blocks and GDN state slots.

| pool | ids | invariant: an id is |
| --- | --- | --- |
| BlockPool | 0 .. num_blocks-1 | either free or in exactly one request's block table |
| SlotPool | 1 .. num_slots-1 (0 is the null slot) | either free or owned by exactly one request |
"""

from __future__ import annotations

import heapq
from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n block ids, or None (nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class SlotPool:
    """Lowest free id first: requests admitted together get consecutive slots, which the torch
    GDN decode path updates in place as one slice of the pool (``kernels.delta_rule``)."""

    NULL_SLOT = 0

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(1, num_slots))  # a heap

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int] | None:
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)

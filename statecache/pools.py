"""Pools: KV blocks (reference-counted, cached ones kept until the room is needed) and GDN state
slots.

| pool | ids | invariant: an id is |
| --- | --- | --- |
| BlockPool | 0 .. num_blocks-1 | free; held by ``refs[id]`` >= 1 owners; or cached, unheld |
| SlotPool | 1 .. num_slots-1 (0: null) | free, or owned by one request or checkpoint |

Owners of a block are request and session block tables; a cached unheld block is evictable,
least recently released first.

A block is cached when the prefix cache indexes it by the hash of its tokens
(``statecache/prefix.py``); its content is read-only then. ``allocate`` takes never-cached free
blocks first and evicts cached unreferenced ones only when those run out, calling ``on_evict``
so that the index forgets them before their id is handed out again.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        # a stack, lowest id on top: recently freed blocks are reused first, so that memory
        # the pool has never touched stays untouched (its pages never become resident)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refs == 0; LRU first
        self.is_cached: Callable[[int], bool] = lambda block: False
        self.on_evict: Callable[[int], None] = lambda block: None
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached unreferenced ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def allocate(self, n: int) -> list[int] | None:
        """n block ids, each with one reference, or None (nothing taken) when fewer than n can
        be had."""
        if n > self.num_free:
            return None
        got = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                self.on_evict(b)
                self.num_evicted += 1
            self.refs[b] = 1
            got.append(b)
        return got

    def ref(self, blocks: Iterable[int]) -> None:
        """One more reference to each of ``blocks`` (held or cached ones)."""
        for b in blocks:
            if self.refs[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"block {b} is free: it cannot be shared")
                del self._evictable[b]
            self.refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``; the last reference makes a block free, or
        evictable if it is cached. Released last block first, so that a sequence's tail is
        evicted before its head (a shorter prefix stays usable)."""
        for b in reversed(blocks):
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} released more often than it was held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.is_cached(b):
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def uncache(self, block: int) -> None:
        """The index forgot ``block`` (``PrefixCache.clear``): if unreferenced it becomes
        free."""
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)


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

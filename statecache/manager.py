"""The hybrid cache manager: one object, one memory budget, both stores.

| store | unit | units per request |
| --- | --- | --- |
| paged KV (attention + MTP layers) | block of ``block_size`` tokens | ceil(tokens / block_size) |
| GDN conv + recurrent state | slot | ``slots_per_request`` (1, or 1 + k with speculation) |
| session snapshot (GDN state saved for a rollback) | slot | none: one per open session |

Both stores free a request's units at finish / abort / preemption. Between its turns a session
holds its conversation's blocks and slots under its own key; the engine evicts them when a
request needs the room. Snapshot slots are a separate, fixed pool, planned like the others.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridrt.config import ModelConfig

from .pools import BlockPool, SlotPool
from .tensors import CacheTensors


class CacheCapacityError(ValueError):
    """The memory budget cannot hold what was asked for."""


@dataclass(slots=True)
class CacheSizing:
    num_blocks: int
    num_slots: int
    block_size: int
    bytes_per_block: int
    bytes_per_slot: int
    max_num_seqs: int
    max_model_len: int
    num_snapshot_slots: int = 0  # the last ones, reserved for session snapshots

    @property
    def max_tokens(self) -> int:
        """KV tokens the pool holds in all."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max-length requests fit at once (bounded by the state slots)."""
        per_req = -(-self.max_model_len // self.block_size)
        return min(self.max_num_seqs, self.num_blocks / per_req)

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.max_tokens} "
            f"tokens ({self.num_blocks * self.bytes_per_block / 2**20:.1f} MiB); GDN state: "
            f"{self.num_slots - 1 - self.num_snapshot_slots} slots + {self.num_snapshot_slots} "
            f"session snapshot slots ({self.num_slots * self.bytes_per_slot / 2**20:.1f} MiB); "
            f"max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency:.2f}"
        )


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """How much of each store is taken, at one moment (``HybridCacheManager.usage``)."""

    num_blocks: int
    num_free_blocks: int
    num_slots: int  # request slots (the null slot and the snapshot slots not counted)
    num_free_slots: int
    num_snapshot_slots: int
    num_free_snapshot_slots: int

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


def available_memory(device: torch.device | str = "cpu") -> int:
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_cache(
    config: ModelConfig,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    slots_per_request: int = 1,
    num_extra_attention_layers: int = 0,
    device: torch.device | str = "cpu",
    lookahead_tokens: int = 0,
    num_snapshot_slots: int = 0,
) -> CacheSizing:
    """Size both stores from one budget: state slots for ``max_num_seqs`` requests and
    ``num_snapshot_slots`` session snapshots first, then as many KV blocks as the rest allows
    (never more than every sequence at full length needs). ``lookahead_tokens``: KV positions a
    request may write past its length (draft tokens). Refuses budgets that cannot hold one
    max-length request."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if num_snapshot_slots < 0:
        raise ValueError(f"num_snapshot_slots must be >= 0, got {num_snapshot_slots}")
    if memory_bytes is None:
        fraction = 0.3 if memory_fraction is None else memory_fraction
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
        memory_bytes = int(available_memory(device) * fraction)
    if memory_bytes <= 0:
        raise ValueError(f"cache memory budget must be positive, got {memory_bytes}")
    per_block = CacheTensors.bytes_per_block(config, block_size, dtype, num_extra_attention_layers)
    per_slot = CacheTensors.bytes_per_slot(config, dtype)
    blocks_per_req = -(-(max_model_len + lookahead_tokens) // block_size)
    fixed_slots = 1 + num_snapshot_slots  # the null slot and the session snapshots
    one_request = blocks_per_req * per_block + (slots_per_request + fixed_slots) * per_slot
    if memory_bytes < one_request:
        raise CacheCapacityError(
            f"cache budget {memory_bytes / 2**20:.1f} MiB cannot hold one request of "
            f"max_model_len={max_model_len} ({one_request / 2**20:.1f} MiB needed: "
            f"{blocks_per_req} KV blocks + {slots_per_request} state slot(s) + "
            f"{num_snapshot_slots} session snapshot slot(s)); raise the budget or lower "
            f"max_model_len"
        )
    num_slots = fixed_slots + max_num_seqs * slots_per_request
    while num_slots > fixed_slots + slots_per_request and (
        memory_bytes - num_slots * per_slot < blocks_per_req * per_block
    ):
        num_slots -= slots_per_request
    seqs = (num_slots - fixed_slots) // slots_per_request
    num_blocks = (memory_bytes - num_slots * per_slot) // per_block
    num_blocks = int(min(num_blocks, blocks_per_req * seqs))
    return CacheSizing(num_blocks, num_slots, block_size, per_block, per_slot, seqs, max_model_len,
                       num_snapshot_slots)


class HybridCacheManager:
    """Owns the KV block pool, the state-slot pool and the tensors behind them.

    Per owner (a request, or a session between its turns) it keeps a block table (list of
    block ids) and its state slots; callers read them through ``block_table`` /
    ``state_slots`` and change them only through the methods below. A request's KV needs
    ``ceil(num_tokens / block_size)`` blocks; ``allocate_blocks`` grows the table or returns
    False without taking anything, which the scheduler answers with preemption.
    """

    def __init__(self, config: ModelConfig, sizing: CacheSizing, dtype: torch.dtype,
                 device: torch.device | str = "cpu", slots_per_request: int = 1,
                 num_extra_attention_layers: int = 0):
        self.config = config
        self.sizing = sizing
        self.block_size = sizing.block_size
        self.slots_per_request = slots_per_request
        self.tensors = CacheTensors.allocate(
            config, sizing.num_blocks, sizing.num_slots, sizing.block_size, dtype, device,
            num_extra_attention_layers,
        )
        self._blocks = BlockPool(sizing.num_blocks)
        first_snapshot = sizing.num_slots - sizing.num_snapshot_slots
        self._slots = SlotPool(first_snapshot)
        self._free_snapshot_slots = list(range(first_snapshot, sizing.num_slots))
        self._block_tables: dict[str, list[int]] = {}
        self._state_slots: dict[str, list[int]] = {}

    # Reading -----------------------------------------------------------------------------
    def block_table(self, owner: str) -> Sequence[int]:
        """The KV block ids ``owner`` holds, in position order (empty if none). Read-only: the
        manager's own list, not a copy."""
        return self._block_tables.get(owner, ())

    def state_slots(self, owner: str) -> Sequence[int]:
        """The GDN state slots ``owner`` holds (empty if none). Read-only, as above."""
        return self._state_slots.get(owner, ())

    def state_slot(self, owner: str, index: int = 0) -> int:
        """``owner``'s state slot number ``index`` (a request's current state is in the one
        its ``slot_cursor`` names)."""
        return self._state_slots[owner][index]

    def owners(self) -> set[str]:
        """Every request or session that holds a block table or state slots."""
        return set(self._block_tables) | set(self._state_slots)

    def holds(self, owner: str) -> bool:
        """Whether ``owner`` (a request or a session) holds any blocks or slots."""
        return bool(self._block_tables.get(owner) or self._state_slots.get(owner))

    def usage(self) -> CacheUsage:
        s = self.sizing
        return CacheUsage(self._blocks.num_blocks, self._blocks.num_free, self._slots.capacity,
                          self._slots.num_free, s.num_snapshot_slots,
                          len(self._free_snapshot_slots))

    def all_free(self) -> bool:
        return (self._blocks.num_free == self._blocks.num_blocks
                and self._slots.num_free == self._slots.capacity
                and len(self._free_snapshot_slots) == self.sizing.num_snapshot_slots)

    # KV blocks ---------------------------------------------------------------------------
    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self._block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate_blocks(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's blocks cover ``num_tokens`` tokens; False (nothing taken) if the
        pool is short."""
        need = self.blocks_needed(request_id, num_tokens)
        if need == 0:
            self._block_tables.setdefault(request_id, [])
            return True
        got = self._blocks.allocate(need)
        if got is None:
            return False
        self._block_tables.setdefault(request_id, []).extend(got)
        return True

    # State slots -------------------------------------------------------------------------
    def allocate_state(self, request_id: str, num_slots: int = 1) -> bool:
        """Take ``num_slots`` slots (1, or 1 + k to verify k drafts) for a request being
        admitted; False (nothing taken) if too few are free."""
        if request_id in self._state_slots:
            return True
        if num_slots > self.slots_per_request:
            raise ValueError(f"{num_slots} state slots asked for, at most "
                             f"{self.slots_per_request} per request")
        got = self._slots.allocate(num_slots)
        if got is None:
            return False
        self._state_slots[request_id] = got
        return True

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy the conv + recurrent state of every GDN layer from one slot to another."""
        t = self.tensors
        t.conv_states[:, dst_slot] = t.conv_states[:, src_slot]
        t.ssm_states[:, dst_slot] = t.ssm_states[:, src_slot]

    # Session snapshot slots --------------------------------------------------------------------
    def take_snapshot_slot(self) -> int | None:
        """A free session snapshot slot, or None when every one is taken."""
        return self._free_snapshot_slots.pop() if self._free_snapshot_slots else None

    def release_snapshot_slot(self, slot: int) -> None:
        self._free_snapshot_slots.append(slot)

    # Ownership moves (session reuse) ----------------------------------------------------------
    def transfer(self, src: str, dst: str) -> None:
        """Hand everything ``src`` holds to ``dst`` (which must hold nothing)."""
        if dst in self._block_tables or dst in self._state_slots:
            raise ValueError(f"{dst!r} already holds cache resources")
        if src in self._block_tables:
            self._block_tables[dst] = self._block_tables.pop(src)
        if src in self._state_slots:
            self._state_slots[dst] = self._state_slots.pop(src)

    def truncate(self, owner: str, num_tokens: int) -> None:
        """Keep only the blocks covering the first ``num_tokens`` positions (KV rollback)."""
        table = self._block_tables.get(owner)
        if table is None:
            return
        keep = -(-num_tokens // self.block_size)
        self._blocks.free(table[keep:])
        del table[keep:]

    # Release -----------------------------------------------------------------------------
    def free(self, owner: str) -> None:
        """Return everything a request (finish, abort or preemption) or a session (eviction,
        reset, close) holds. Idempotent."""
        self._blocks.free(self._block_tables.pop(owner, []))
        self._slots.free(self._state_slots.pop(owner, []))

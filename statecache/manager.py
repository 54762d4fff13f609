"""The hybrid cache manager: one object, one memory budget, both stores, and the prefix cache
over them.

| store | unit | held by |
| --- | --- | --- |
| paged KV (attention + MTP layers) | block of ``block_size`` tokens | requests, sessions |
| GDN conv + recurrent state (+ KV tail) | slot | a request (1, or 1 + k), or a checkpoint |

A request holds ceil(tokens / block_size) blocks; cached blocks no one holds wait to be evicted.

With prefix caching (statecache/prefix.py) a request's full blocks are indexed by their
tokens' hash as soon as their content is final, and its GDN state is saved at chosen positions
(checkpoints); a new request resumes from the longest cached prefix that ends at a checkpoint
(``admit``). Nothing cached is ever in the way of a running request: an allocation evicts
unreferenced cached blocks (least recently released first) and checkpoints (never hit first,
then least recently used; sessions' pinned ones last) before it fails, and only a failure
leads the scheduler to preempt. The checkpoints beyond the requests' own slots take
``checkpoint_share`` of the budget (``plan_cache``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridrt.config import ModelConfig
from hybridrt.kernels import kvquant
from hybridrt.options import parse_memory

from . import tiering
from .disk import DiskTier
from .pools import BlockPool, SlotPool
from .prefix import BlockHashes, Checkpoint, Hit, PrefixIndex, root_hash
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
    num_checkpoint_slots: int = 0  # slots beyond the requests' (GDN state checkpoints)

    @property
    def max_tokens(self) -> int:
        """KV tokens the pool holds in all."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max-length requests fit at once (bounded by the state slots)."""
        per_req = -(-self.max_model_len // self.block_size)
        return min(self.max_num_seqs, self.num_blocks / per_req)

    def context_tokens(self, concurrency: int = 1) -> int:
        """KV tokens each of ``concurrency`` requests can hold at once (whole blocks)."""
        return self.num_blocks // concurrency * self.block_size

    @property
    def total_bytes(self) -> int:
        """The budget both stores may fill (memory is taken as they fill it, on the CPU)."""
        return self.num_blocks * self.bytes_per_block + self.num_slots * self.bytes_per_slot

    @property
    def num_request_slots(self) -> int:
        return self.num_slots - 1 - self.num_checkpoint_slots

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.max_tokens} "
            f"tokens ({self.num_blocks * self.bytes_per_block / 2**20:.1f} MiB); GDN state: "
            f"{self.num_request_slots} request slots + {self.num_checkpoint_slots} checkpoint "
            f"slots ({self.num_slots * self.bytes_per_slot / 2**20:.1f} MiB); "
            f"max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency:.2f}"
        )


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """How much of each store is taken, at one moment (``HybridCacheManager.usage``)."""

    num_blocks: int
    num_free_blocks: int  # free or cached unreferenced (an allocation may take them)
    num_slots: int  # every slot but the null one
    num_free_slots: int  # free or holding an evictable checkpoint
    num_cached_blocks: int = 0  # indexed by the prefix cache (referenced or not)
    num_checkpoints: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


@dataclass(slots=True)
class Admitted:
    """What ``admit`` gave a request: ``num_tokens`` prompt tokens from the cache (0: none) and,
    with them, the target's hidden state at the last of them (the MTP layer's input there)."""

    num_tokens: int
    hidden: torch.Tensor | None = None


@dataclass(slots=True)
class PendingCheckpoint:
    """A checkpoint being written by this step (its slot reserved, not yet in the index)."""

    key: tuple
    num_tokens: int
    num_shared: int
    slot: int
    has_tail: bool


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
    checkpoint_share: float = 0.0,
    kv_dtype: torch.dtype | None = None,
) -> CacheSizing:
    """Size both stores from one budget: state slots for ``max_num_seqs`` requests, checkpoint
    slots for ``checkpoint_share`` of the budget, then as many KV blocks as the rest allows
    (never more than every sequence at full length needs; a model without attention layers
    gets those, as blocks of no bytes). ``lookahead_tokens``: KV positions a
    request may write past its length (draft tokens). Refuses budgets that cannot hold one
    max-length request; checkpoint slots give way first. ``kv_dtype``: the KV tensors' (None:
    ``dtype``; torch.int8 counts its codes and scales)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if not 0.0 <= checkpoint_share < 1.0:
        raise ValueError(f"checkpoint_share must be in [0, 1), got {checkpoint_share}")
    if memory_bytes is None:
        fraction = 0.3 if memory_fraction is None else memory_fraction
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
        memory_bytes = int(available_memory(device) * fraction)
    if memory_bytes <= 0:
        raise ValueError(f"cache memory budget must be positive, got {memory_bytes}")
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    per_block = CacheTensors.bytes_per_block(config, block_size, kv_dtype,
                                             num_extra_attention_layers)
    per_slot = CacheTensors.bytes_per_slot(config, dtype, block_size, num_extra_attention_layers,
                                           kv_dtype)
    blocks_per_req = -(-(max_model_len + lookahead_tokens) // block_size)
    one_request = blocks_per_req * per_block + (slots_per_request + 1) * per_slot
    if memory_bytes < one_request:
        raise CacheCapacityError(
            f"cache budget {memory_bytes / 2**20:.1f} MiB cannot hold one request of "
            f"max_model_len={max_model_len} ({one_request / 2**20:.1f} MiB needed: "
            f"{blocks_per_req} KV blocks + {slots_per_request} state slot(s)); raise the budget "
            f"or lower max_model_len"
        )
    num_slots = 1 + max_num_seqs * slots_per_request  # with the null slot
    while num_slots > 1 + slots_per_request and (
        memory_bytes - num_slots * per_slot < blocks_per_req * per_block
    ):
        num_slots -= slots_per_request
    seqs = (num_slots - 1) // slots_per_request
    room = memory_bytes - num_slots * per_slot - blocks_per_req * per_block
    num_ckpt = max(0, min(int(checkpoint_share * memory_bytes), room) // per_slot)
    num_slots += num_ckpt
    num_blocks = blocks_per_req * seqs  # KV blocks of no bytes (no attention layer): all
    if per_block:
        num_blocks = int(min((memory_bytes - num_slots * per_slot) // per_block, num_blocks))
    return CacheSizing(num_blocks, num_slots, block_size, per_block, per_slot, seqs, max_model_len,
                       num_ckpt)


class HybridCacheManager:
    """Owns the KV block pool, the state-slot pool, the tensors behind them and the prefix
    cache's index.

    Per owner (a request, or a session) it keeps a block table (list of block ids, shared
    ones included) and its state slots; callers read them through ``block_table`` /
    ``state_slots`` and change them only through the methods below. ``admit`` gives a request
    being admitted its slots and blocks (from the cache where it can), ``allocate_blocks``
    more blocks, ``release`` takes them back, keeping what the prefix cache wants of them; a
    False / None return means nothing was taken, which the scheduler answers with preemption.
    """

    def __init__(self, config: ModelConfig, sizing: CacheSizing, dtype: torch.dtype,
                 device: torch.device | str = "cpu", slots_per_request: int = 1,
                 num_extra_attention_layers: int = 0, prefix_caching: bool = False,
                 salt: str = "", disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 0, kv_dtype: torch.dtype | None = None):
        self.config = config
        self.sizing = sizing
        self.block_size = sizing.block_size
        self.slots_per_request = slots_per_request
        self.tensors = CacheTensors.allocate(
            config, sizing.num_blocks, sizing.num_slots, sizing.block_size, dtype, device,
            num_extra_attention_layers, kv_dtype,
        )
        self._blocks = BlockPool(sizing.num_blocks)
        self._slots = SlotPool(sizing.num_slots)
        self._block_tables: dict[str, list[int]] = {}
        self._state_slots: dict[str, list[int]] = {}
        self._registered: dict[str, int] = {}  # owner -> its leading blocks already indexed
        self._pending: dict[int, PendingCheckpoint] = {}  # slot -> the checkpoint it receives
        self.prefix: PrefixIndex | None = None
        self._roots = {False: root_hash(f"{salt}|mtp=0"), True: root_hash(f"{salt}|mtp=1")}
        self.disk: DiskTier | None = None  # the disk tier (statecache/disk.py), if on
        if prefix_caching:
            self.prefix = PrefixIndex(self.block_size)
            self._blocks.is_cached = self.prefix.is_cached
            self._blocks.on_evict = self.prefix.forget_block
            if disk_dir is not None:
                self.disk = DiskTier(disk_dir, tiering.identity(salt, self.tensors), disk_bytes)
                self._blocks.on_evict = self._spill_block
        elif disk_dir is not None:
            raise ValueError("prefix_cache_dir needs prefix caching on")
        self.on_checkpoint_evicted = None  # sessions: told which pinned checkpoint went

    @classmethod
    def for_engine(cls, args, config: ModelConfig, dtype: torch.dtype,
                   num_extra_attention_layers: int, salt: str) -> HybridCacheManager:
        """The cache of an engine run with ``args`` (a resolved ``EngineArgs``): sized by
        ``plan_cache`` from its memory budget, 1 + speculative_tokens state slots a request."""
        mem_bytes, mem_fraction = parse_memory(args.cache_memory)
        k = args.speculative_tokens
        kv_dtype = kvquant.resolve(args.kv_cache_dtype, dtype)
        sizing = plan_cache(
            config, args.max_model_len, args.max_num_seqs, args.block_size, dtype,
            memory_bytes=mem_bytes, memory_fraction=mem_fraction, slots_per_request=1 + k,
            num_extra_attention_layers=num_extra_attention_layers, device=args.device,
            lookahead_tokens=k,
            checkpoint_share=args.checkpoint_share if args.enable_prefix_caching else 0.0,
            kv_dtype=kv_dtype,
        )
        disk_bytes = parse_memory(args.prefix_cache_dir_size)[0] if (
            args.prefix_cache_dir is not None) else 0
        return cls(config, sizing, dtype, args.device, slots_per_request=1 + k,
                   num_extra_attention_layers=num_extra_attention_layers,
                   prefix_caching=args.enable_prefix_caching, salt=f"{salt}|kv={kv_dtype}",
                   disk_dir=args.prefix_cache_dir, disk_bytes=disk_bytes, kv_dtype=kv_dtype)

    @property
    def prefix_caching(self) -> bool:
        return self.prefix is not None

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
        p = self.prefix
        return CacheUsage(self._blocks.num_blocks, self._blocks.num_free, self._slots.capacity,
                          self._slots.num_free + self._num_evictable_checkpoints(),
                          len(p.hash_of) if p else 0, len(p.checkpoints) if p else 0)

    def tier_stats(self) -> dict[str, int]:
        """The disk tier's counters and holdings, and the hits it gave (zeros when it is off;
        memory's are ``prefix.stats`` and ``usage``)."""
        disk, prefix = self.disk, self.prefix.stats if self.prefix is not None else {}
        st = {"disk_hits": prefix.get("disk_hits", 0),
              "disk_hit_tokens": prefix.get("disk_hit_tokens", 0),
              "disk_blocks": len(disk.blocks) if disk else 0,
              "disk_checkpoints": len(disk.checkpoints) if disk else 0,
              "disk_bytes": disk.bytes if disk else 0}
        for k in ("disk_block_writes", "disk_checkpoint_writes", "disk_block_restores",
                  "disk_checkpoint_restores", "disk_evictions", "disk_bad_files"):
            st[k] = disk.stats[k] if disk else 0
        return st

    def all_free(self) -> bool:
        """Nothing is held: no owner has blocks or slots, no block is referenced, no checkpoint
        is pinned or pending (what the prefix cache keeps is evictable)."""
        if self.owners() or self._pending or any(self._blocks.refs):
            return False
        ckpts = list(self.prefix.checkpoints.values()) if self.prefix is not None else []
        return (not any(c.pins for c in ckpts)
                and self._slots.num_free + len(ckpts) == self._slots.capacity)

    def check(self) -> None:
        """Every block's reference count equals its holders (requests' and sessions' tables), every
        indexed block is held or evictable, every slot is free or has one owner; AssertionError
        otherwise (the tests call it after every step)."""
        refs = [0] * self._blocks.num_blocks
        for table in self._block_tables.values():
            for b in table:
                refs[b] += 1
        slots = [s for own in self._state_slots.values() for s in own] + list(self._pending)
        if self.prefix is not None:
            slots += [c.slot for c in self.prefix.checkpoints.values()]
            for b in self.prefix.hash_of:
                assert refs[b] or b in self._blocks._evictable, f"indexed block {b} is free"
        assert refs == self._blocks.refs, "block reference counts disagree with their holders"
        assert len(slots) == len(set(slots)), "a state slot has two owners"
        assert not set(slots) & set(self._slots._free), "a held state slot is also free"
        assert len(slots) + self._slots.num_free == self._slots.capacity, "a state slot is lost"

    # Hashes ------------------------------------------------------------------------------
    def block_hashes(self, mtp: bool) -> BlockHashes:
        """A new request's hash chain: blocks that hold MTP KV (``mtp``) have their own."""
        return BlockHashes(self._roots[mtp], self.block_size, 1 if mtp else 0)

    # Admission ---------------------------------------------------------------------------
    def peek(self, tokens: Sequence[int], hashes: BlockHashes) -> Hit | None:
        """What ``admit`` would reuse for a request with these tokens now (no side effects)."""
        if self.prefix is None or len(tokens) < 2:
            return None
        return self.prefix.lookup(tokens[:len(tokens) - 1], hashes)

    def blocks_to_admit(self, tokens: Sequence[int], hashes: BlockHashes, num_tokens: int) -> int:
        """Blocks ``admit`` would take from the free ones to cover ``num_tokens`` positions (the
        cached blocks a hit shares count when nothing else holds them)."""
        need = -(-num_tokens // self.block_size)
        hit = self.peek(tokens, hashes)
        if hit is None:
            return need
        idle = sum(1 for b in hit.shared_blocks if self._blocks.refs[b] == 0)
        return need - len(hit.shared_blocks) + idle

    def admit(self, owner: str, tokens: Sequence[int], hashes: BlockHashes | None,
              num_slots: int, num_tokens: Callable[[int], int]) -> Admitted | None:
        """State slots and KV blocks for a request being admitted, with its tokens' longest
        cached prefix restored into them (``hashes`` None: no look-up) -> what it got, or None
        (nothing taken, nothing evicted) when there is no room. ``num_tokens(hit)``: the
        positions its blocks must cover when the first ``hit`` tokens come from the cache."""
        if owner in self._state_slots or owner in self._block_tables:
            raise ValueError(f"{owner!r} already holds cache resources")
        if num_slots > self.slots_per_request:
            raise ValueError(f"{num_slots} state slots asked for, at most "
                             f"{self.slots_per_request} per request")
        if self.disk is not None and hashes is not None:
            tiering.restore(self, tokens, hashes, num_slots)
        hit = self.peek(tokens, hashes) if hashes is not None else None
        p = hit.num_tokens if hit is not None else 0
        ck = hit.checkpoint if hit is not None else None
        shared = hit.shared_blocks if hit is not None else []
        need = -(-num_tokens(p) // self.block_size) - len(shared)
        idle_shared = sum(1 for b in shared if self._blocks.refs[b] == 0)
        if (num_slots > self._slots.num_free + self._num_evictable_checkpoints(ck)
                or need + idle_shared > self._blocks.num_free):
            return None
        self._blocks.ref(shared)  # before allocating: the allocation must not evict them
        slots = self._take_slots(num_slots, spare=ck)
        own = self._blocks.allocate(need)
        assert slots is not None and own is not None  # counted above
        self._block_tables[owner] = list(shared) + own
        self._state_slots[owner] = slots
        self._registered[owner] = len(shared)
        if ck is None:
            if hashes is not None:
                self._count_query(len(tokens), 0)
            return Admitted(0)
        self.copy_state(ck.slot, slots[0])
        if ck.tail_len:
            self._copy_tail(ck.slot, own[0], ck.tail_len, restore=True)
        self.prefix.touch(ck, hit=True)
        self._count_query(len(tokens), p)
        if ck.restored:
            ck.restored = False
            self.prefix.stats["disk_hits"] += 1
            self.prefix.stats["disk_hit_tokens"] += p
        return Admitted(p, ck.hidden)

    def _count_query(self, num_tokens: int, hit: int) -> None:
        st = self.prefix.stats
        st["queries"] += 1
        st["query_tokens"] += num_tokens
        st["hits"] += hit > 0
        st["hit_tokens"] += hit

    # KV blocks ---------------------------------------------------------------------------
    def blocks_needed(self, owner: str, num_tokens: int) -> int:
        have = len(self._block_tables.get(owner, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate_blocks(self, owner: str, num_tokens: int) -> bool:
        """Make the owner's blocks cover ``num_tokens`` positions; False (nothing taken) if
        the pool is short."""
        need = self.blocks_needed(owner, num_tokens)
        if need == 0:
            self._block_tables.setdefault(owner, [])
            return True
        got = self._blocks.allocate(need)
        if got is None:
            return False
        self._block_tables.setdefault(owner, []).extend(got)
        return True

    def commit_blocks(self, owner: str, tokens: Sequence[int], hashes: BlockHashes,
                      num_final: int) -> None:
        """Index the owner's full blocks whose content is final: those before position
        ``num_final`` (the MTP layer's KV included, which the engine writes after the target's)."""
        if self.prefix is None:
            return
        table = self._block_tables.get(owner)
        if not table:
            return
        n = min(num_final // self.block_size, len(table), hashes.num_hashable(len(tokens)))
        done = self._registered.get(owner, 0)
        if n <= done:
            return
        for i, h in enumerate(hashes.upto(tokens, n)[done:], done):
            self.prefix.register_block(h, table[i])
        self._registered[owner] = n

    def commit_step(self, seqs: Sequence, row_starts: Sequence[int], hidden: torch.Tensor,
                    settled: Sequence[int]) -> list[torch.Tensor | None]:
        """The prefix cache's part of a step's end, after the MTP layer has written its KV for
        the step's positions. ``seqs``: the step's scheduled sequences (``ScheduledSeq``, read
        only); ``row_starts[b]``: the first row of ``seqs[b]`` in ``hidden`` (the target's
        final hidden states); ``settled[b]``: its positions the step computed. The GDN
        checkpoints the step wrote are indexed (with the target's hidden state before each, the
        MTP layer's input there) and each request's newly final full blocks -> per sequence,
        the hidden state after its last computed token, to keep with its state when it is
        released (None: nothing new to keep)."""
        kept: list[torch.Tensor | None] = [None] * len(seqs)
        if self.prefix is None:
            return kept
        rows, wants = [], []  # hidden rows to keep: (sequence index, checkpoint or None)
        for b, s in enumerate(seqs):
            req = s.request
            if req.block_hashes is None or req.cache_dirty or settled[b] == 0 and not (
                    s.checkpoints):
                continue
            mtp = req.block_hashes.lookahead > 0
            for ck in s.checkpoints:
                if mtp:
                    rows.append(row_starts[b] + ck.num_tokens - s.start - 1)
                    wants.append((b, ck))
                else:
                    self.save_checkpoint(ck, req.request_id, None)
            if mtp and settled[b]:
                rows.append(row_starts[b] + settled[b] - 1)
                wants.append((b, None))
        if rows:
            got = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
            for (b, ck), h in zip(wants, got):
                if ck is None:
                    kept[b] = h
                else:
                    self.save_checkpoint(ck, seqs[b].request.request_id, h)
        for s in seqs:
            req = s.request
            if req.block_hashes is not None and not req.cache_dirty:
                self.commit_blocks(req.request_id, req.token_ids, req.block_hashes,
                                   req.mtp_written)
        return kept

    # State slots -------------------------------------------------------------------------
    def _num_evictable_checkpoints(self, spare: Checkpoint | None = None) -> int:
        if self.prefix is None:
            return 0
        return self.prefix.num_evictable - (spare is not None and not spare.pins)

    def _take_slots(self, n: int, spare: Checkpoint | None = None) -> list[int] | None:
        """``n`` free slots, evicting checkpoints (never ``spare`` nor pinned ones) for them;
        None, with nothing evicted, when that is not enough."""
        if n > self._slots.num_free + self._num_evictable_checkpoints(spare):
            return None
        while self._slots.num_free < n:
            self.evict_checkpoint(self.prefix.victim(spare))
        return self._slots.allocate(n)

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy the conv + recurrent state of every GDN layer from one slot to another."""
        t = self.tensors
        t.conv_states[:, dst_slot] = t.conv_states[:, src_slot]
        t.ssm_states[:, dst_slot] = t.ssm_states[:, src_slot]

    def _copy_tail(self, slot: int, block: int, n: int, restore: bool = False) -> None:
        """The KV of a block's first ``n`` positions into the slot's tail (every attention
        layer, the MTP layer's too), or back into the block (``restore``)."""
        t = self.tensors
        for cache, tail in zip((*t.key_caches, *t.value_caches),
                               (*t.key_tails, *t.value_tails)):
            if restore:
                cache[block, :n] = tail[slot, :n]
            else:
                tail[slot, :n] = cache[block, :n]

    # Checkpoints -------------------------------------------------------------------------
    def checkpoint_key(self, tokens: Sequence[int], hashes: BlockHashes,
                       num_tokens: int) -> tuple[tuple, int, bool]:
        """(index key, shared full blocks, whether a hit copies the block holding position
        num_tokens - 1) of a checkpoint after ``num_tokens`` tokens."""
        bs = self.block_size
        has_tail = hashes.lookahead > 0 or num_tokens % bs != 0
        num_shared = (num_tokens - 1) // bs if has_tail else num_tokens // bs
        tail = tuple(tokens[num_shared * bs:num_tokens]) if has_tail else ()
        return (hashes.anchor(tokens, num_shared), tail), num_shared, has_tail

    def touch_checkpoints(self, tokens: Sequence[int], hashes: BlockHashes,
                          positions: Sequence[int]) -> None:
        """Count the cached checkpoints at ``positions`` as used: a request resumed from a
        checkpoint past them, so they are on a path requests take (kept like hit ones)."""
        if self.prefix is None:
            return
        for p in positions:
            ck = self.prefix.checkpoints.get(self.checkpoint_key(tokens, hashes, p)[0])
            if ck is not None:
                self.prefix.touch(ck, hit=True)

    def reserve_checkpoint(self, tokens: Sequence[int], hashes: BlockHashes,
                           num_tokens: int) -> PendingCheckpoint | None:
        """A slot for the GDN state after ``num_tokens`` tokens, which this step writes; None
        when the cache has it already, or has no slot to spare (only never-hit and least recently
        used checkpoints give way to a new one, never a request)."""
        if self.prefix is None or num_tokens < 1:
            return None
        key, num_shared, has_tail = self.checkpoint_key(tokens, hashes, num_tokens)
        if key in self.prefix.checkpoints or any(p.key == key for p in self._pending.values()):
            return None
        slots = self._take_slots(1)
        if slots is None:
            return None
        pending = PendingCheckpoint(key, num_tokens, num_shared, slots[0], has_tail)
        self._pending[pending.slot] = pending
        return pending

    def save_checkpoint(self, pending: PendingCheckpoint, owner: str,
                        hidden: torch.Tensor | None) -> Checkpoint:
        """Index a checkpoint whose state the step wrote into its slot, with the KV of the
        positions after its shared blocks copied from the owner's block into the slot's tail
        (final now: the MTP layer's KV is written after the target's)."""
        del self._pending[pending.slot]
        tail = pending.num_tokens - pending.num_shared * self.block_size if (
            pending.has_tail) else 0
        if tail:
            self._copy_tail(pending.slot, self._block_tables[owner][pending.num_shared], tail)
        ck = Checkpoint(pending.key, pending.num_tokens, pending.num_shared, pending.slot, tail,
                        hidden)
        self.prefix.add_checkpoint(ck)
        return ck

    def drop_pending(self, pending: PendingCheckpoint) -> None:
        """A reserved checkpoint the step did not write after all (its request was aborted)."""
        if self._pending.pop(pending.slot, None) is not None:
            self._slots.free([pending.slot])

    def _spill_block(self, block: int) -> None:
        """A cached block evicted for an allocation: to the disk tier, then out of the index."""
        tiering.spill_block(self, block)
        self.prefix.forget_block(block)

    def evict_checkpoint(self, ck: Checkpoint, spill: bool = True) -> None:
        """Drop a checkpoint (to the disk tier first, with ``spill`` and the tier on)."""
        if spill and self.disk is not None:
            tiering.spill_checkpoint(self, ck)
        self.prefix.remove_checkpoint(ck)
        self.prefix.stats["checkpoint_evictions"] += 1
        self._slots.free([ck.slot])
        if ck.pins and self.on_checkpoint_evicted is not None:
            self.on_checkpoint_evicted(ck)

    def pin(self, ck: Checkpoint) -> None:
        self.prefix.pin(ck)

    def unpin(self, ck: Checkpoint) -> None:
        self.prefix.unpin(ck)

    def hold(self, owner: str, blocks: Sequence[int]) -> None:
        """``owner`` (a session) takes a reference to each of ``blocks``."""
        self._blocks.ref(blocks)
        self._block_tables.setdefault(owner, []).extend(blocks)

    def clear_prefix_cache(self) -> bool:
        """Forget every unpinned checkpoint, every cached block no one holds and the disk
        tier's files -> whether the index is empty now (vLLM's ``reset_prefix_cache``)."""
        if self.prefix is None:
            return True
        for ck in [c for c in self.prefix.checkpoints.values() if not c.pins]:
            self.evict_checkpoint(ck, spill=False)
            self.prefix.stats["checkpoint_evictions"] -= 1
        for b in list(self.prefix.hash_of):
            if self._blocks.refs[b] == 0:
                self.prefix.forget_block(b)
                self.prefix.stats["block_evictions"] -= 1
                self._blocks.uncache(b)
        if self.disk is not None:
            self.disk.clear()
        return not self.prefix.checkpoints and not self.prefix.hash_of

    # Release -----------------------------------------------------------------------------
    def release(self, owner: str, tokens: Sequence[int] | None = None,
                hashes: BlockHashes | None = None, num_final: int = 0,
                keep_slot: int | None = None, hidden: torch.Tensor | None = None) -> None:
        """Return everything a request (finish, abort or preemption) or a session holds.
        With prefix caching and ``tokens``: its full blocks before ``num_final`` are indexed
        first, and with ``keep_slot`` (the index of the slot holding its state after
        ``num_final`` tokens) that state becomes a checkpoint, unless one is there already.
        Idempotent."""
        if self.prefix is not None and tokens is not None and hashes is not None:
            self.commit_blocks(owner, tokens, hashes, num_final)
            kept = None
            slots = self._state_slots.get(owner)
            if keep_slot is not None and slots and 0 < num_final <= len(tokens) and (
                    hidden is not None or hashes.lookahead == 0):
                key, num_shared, has_tail = self.checkpoint_key(tokens, hashes, num_final)
                if key not in self.prefix.checkpoints and (
                        len(self._block_tables.get(owner, ())) > num_shared or not has_tail):
                    slot = slots.pop(keep_slot)
                    self._pending[slot] = PendingCheckpoint(key, num_final, num_shared, slot,
                                                            has_tail)
                    kept = self.save_checkpoint(self._pending[slot], owner, hidden)
            if self.disk is not None and keep_slot is not None:
                tiering.write_through(self, owner, tokens, hashes, kept)
        self._blocks.free(self._block_tables.pop(owner, []))
        self._slots.free(self._state_slots.pop(owner, []))
        self._registered.pop(owner, None)

    free = release

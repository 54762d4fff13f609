"""Moving prefix-cache entries between the cache's memory and its disk tier (statecache/disk.py):
what the ``HybridCacheManager`` calls when the disk tier is on.

- **spill**: a cached block or checkpoint evicted from memory is written to disk first;
- **write-through**: the end of every released request (its checkpoint and its full blocks) is
  written at once, so that a conversation survives a restart or a kill;
- **restore**: before a request is admitted, when the disk holds a longer prefix of its prompt
  than memory (a checkpoint past the memory hit whose blocks are in memory or on disk), the
  missing blocks are read into free blocks (indexed, unreferenced) and the checkpoint into a
  slot: the admission then hits in memory. A file that fails its check is skipped (logged,
  deleted) and the request takes what memory has.

The bytes restored are the bytes spilled: the state a hit restores is the state a cold run
computes, through the disk too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .prefix import BlockHashes, Checkpoint

if TYPE_CHECKING:
    from .manager import HybridCacheManager
    from .tensors import CacheTensors


def identity(salt: str, t: CacheTensors) -> str:
    """The cache's salt and the geometry of its tensors: a disk file is only read by a cache
    with the same."""
    kv = t.key_caches[0] if t.key_caches else torch.empty(0)
    return (f"{salt}|attn={len(t.key_caches)}x{tuple(kv.shape[1:])}:{kv.dtype}|"
            f"conv={tuple(t.conv_states[:, 0].shape)}:{t.conv_states.dtype}|"
            f"ssm={tuple(t.ssm_states[:, 0].shape)}:{t.ssm_states.dtype}")


def _block_tensors(t: CacheTensors, b: int) -> dict[str, torch.Tensor]:
    d = {f"k{i}": k[b] for i, k in enumerate(t.key_caches)}
    d.update({f"v{i}": v[b] for i, v in enumerate(t.value_caches)})
    return d


def _load_block(t: CacheTensors, b: int, d: dict[str, torch.Tensor]) -> None:
    for i, k in enumerate(t.key_caches):
        k[b].copy_(d[f"k{i}"])
    for i, v in enumerate(t.value_caches):
        v[b].copy_(d[f"v{i}"])


def _checkpoint_tensors(t: CacheTensors, ck: Checkpoint) -> dict[str, torch.Tensor]:
    s, n = ck.slot, ck.tail_len
    d = {"conv": t.conv_states[:, s], "ssm": t.ssm_states[:, s]}
    d.update({f"k{i}": k[s, :n] for i, k in enumerate(t.key_tails)})
    d.update({f"v{i}": v[s, :n] for i, v in enumerate(t.value_tails)})
    if ck.hidden is not None:
        d["hidden"] = ck.hidden
    return d


def _load_checkpoint(t: CacheTensors, slot: int, n: int, d: dict[str, torch.Tensor]) -> None:
    t.conv_states[:, slot].copy_(d["conv"])
    t.ssm_states[:, slot].copy_(d["ssm"])
    for i, k in enumerate(t.key_tails):
        k[slot, :n].copy_(d[f"k{i}"])
    for i, v in enumerate(t.value_tails):
        v[slot, :n].copy_(d[f"v{i}"])


def _fits(t: CacheTensors, slot_tail: int, d: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint file's tensors have this cache's shapes."""
    return (d["conv"].shape == t.conv_states[:, 0].shape
            and d["ssm"].shape == t.ssm_states[:, 0].shape
            and all(d[f"k{i}"].shape == k[0, :slot_tail].shape
                    for i, k in enumerate(t.key_tails)))


def spill_block(mgr: HybridCacheManager, block: int) -> None:
    h = mgr.prefix.hash_of.get(block)
    if h is not None:
        name = mgr.disk.block_name(h)
        if name not in mgr.disk.blocks:
            mgr.disk.put(name, _block_tensors(mgr.tensors, block))


def spill_checkpoint(mgr: HybridCacheManager, ck: Checkpoint) -> None:
    mgr.disk.put_checkpoint(ck.key, ck.num_tokens, ck.num_shared,
                            _checkpoint_tensors(mgr.tensors, ck))


def write_through(mgr: HybridCacheManager, owner: str, tokens: Sequence[int],
                  hashes: BlockHashes, ck: Checkpoint | None) -> None:
    """The released ``owner``'s indexed full blocks and its end checkpoint ``ck`` to disk."""
    table = mgr.block_table(owner)
    n = min(mgr._registered.get(owner, 0), len(table))
    for h, b in zip(hashes.upto(tokens, n), table):
        if mgr.prefix.hash_of.get(b) == h:
            name = mgr.disk.block_name(h)
            if name not in mgr.disk.blocks:
                mgr.disk.put(name, _block_tensors(mgr.tensors, b))
    if ck is not None:
        spill_checkpoint(mgr, ck)


def restore(mgr: HybridCacheManager, tokens: Sequence[int], hashes: BlockHashes,
            num_slots: int) -> int:
    """Bring into memory the disk's longest prefix of ``tokens`` past what memory gives (the
    module docstring) -> the tokens it covers (0: nothing restored). Only while what it takes
    leaves the request's ``num_slots`` state slots and the blocks of its prompt after it."""
    prefix, disk, bs = mgr.prefix, mgr.disk, mgr.block_size
    if len(tokens) < 2 or not disk.by_anchor:
        return 0
    toks = tokens[:len(tokens) - 1]
    hit = prefix.lookup(toks, hashes)
    have = hit.num_tokens if hit is not None else 0
    chain = hashes.upto(toks, hashes.num_hashable(len(toks)))
    avail = 0
    while avail < len(chain) and (chain[avail] in prefix.block_of
                                  or disk.block_name(chain[avail]) in disk.blocks):
        avail += 1
    best, best_j = None, 0
    for j in range(avail, -1, -1):
        if (j + 1) * bs <= have:
            break  # no checkpoint anchored here reaches past the memory hit
        for c in disk.by_anchor.get(chain[j - 1] if j else hashes.root, ()):
            if have < c.num_tokens <= len(toks) and (
                    best is None or c.num_tokens > best.num_tokens) and (
                    tuple(toks[j * bs:c.num_tokens]) == c.tail):
                best, best_j = c, j
        if best is not None:
            break
    if best is None:
        return 0
    missing = [i for i in range(best_j) if chain[i] not in prefix.block_of]
    datas = []
    for i in missing:
        d = disk.get(disk.block_name(chain[i]))
        if d is None:
            return 0
        datas.append(d)
    key = (best.anchor, best.tail)
    ckd = None
    tail_len = best.num_tokens - best.num_shared * bs
    if key not in prefix.checkpoints:
        ckd = disk.get(best.name)
        if ckd is None:
            return 0
        if not _fits(mgr.tensors, tail_len, ckd):
            disk._bad(best.name, "its tensors have another shape")
            return 0
    room = -(-(len(tokens) - best.num_tokens) // bs) + 1  # the request's own blocks
    if (mgr._blocks.num_free < len(missing) + room or ckd is not None and (
            mgr._slots.num_free + mgr._num_evictable_checkpoints() < 1 + num_slots)):
        return 0
    held = [prefix.block_of[chain[i]] for i in range(best_j) if chain[i] in prefix.block_of]
    mgr._blocks.ref(held)  # the allocations below must not evict them
    got = mgr._blocks.allocate(len(missing)) if missing else []
    if got is None:
        mgr._blocks.free(held)
        return 0
    for i, b, d in zip(missing, got, datas):
        _load_block(mgr.tensors, b, d)
        prefix.register_block(chain[i], b)
    disk.stats["disk_block_restores"] += len(missing)
    done = 0
    if ckd is not None:
        slots = mgr._take_slots(1)
        if slots is not None:
            _load_checkpoint(mgr.tensors, slots[0], tail_len, ckd)
            hidden = ckd.get("hidden")
            if hidden is not None:
                hidden = hidden.to(mgr.tensors.ssm_states.device)
            ck = Checkpoint(key, best.num_tokens, best.num_shared, slots[0], tail_len, hidden,
                            restored=True)
            prefix.add_checkpoint(ck)
            prefix.stats["checkpoints_saved"] -= 1  # restored, not computed
            disk.stats["disk_checkpoint_restores"] += 1
            done = best.num_tokens
    else:
        done = best.num_tokens
    mgr._blocks.free(held + got)
    return done

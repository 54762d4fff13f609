"""The prefix cache's index: full KV blocks by the hash chain of their tokens, and GDN state
checkpoints by the tokens before them.

A GDN layer's state after p tokens cannot be cut back from a later state, so a prompt can
resume from a cached prefix only at a position where the conv + recurrent state was saved: a
**checkpoint**. A hit is the longest prefix of the new prompt (at most all but its last token)
that ends at a checkpoint whose KV blocks are all cached:

| piece | holds | indexed by |
| --- | --- | --- |
| full block i | KV (target + MTP layers) of tokens [16i, 16i+16) | h_i = H(h_i-1, its tokens) |
| checkpoint at p | GDN state after p tokens, KV tail, hidden at p-1 | (h of last shared, rest) |

``h_-1`` is the cache's salt; with the MTP layer's KV in a block, its hash covers token 16i+16
too. A checkpoint is a state slot: the conv + recurrent state in the state tensors' own dtypes,
and in the slot's KV tail the positions after its last shared full block; with the MTP, the
target's hidden state at p-1 besides.

The salt covers what changes a block's content besides its tokens: the model's dtype,
quantization and block size, and whether the MTP layer's KV is in it (requests that speculate
write it; those that do not, leave it empty, so the two never share).

Sharing rules (each one a regression test in tests/test_prefix_cache.py):

- the MTP layer's KV at position q is computed from token q+1 (its input is shifted by one), so
  a block holding MTP KV is hashed with the token after it: two prompts that share a block but
  not the token after it do not share that block;
- full blocks are shared read-only; a hit copies the block holding position p-1 into a block of
  its own when p is not a block boundary (the request writes on in it) or when the MTP runs
  (it rewrites the MTP KV at p-1 with the new prompt's token p: ``carry``);
- a block's hash is dropped from the index before its id is handed out again (``on_evict``);
- a checkpoint is never restored in another dtype: it is a slot of the same state tensors.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def root_hash(salt: str) -> bytes:
    return hashlib.blake2b(salt.encode(), digest_size=16).digest()


def chain_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full block: its tokens after the hash of the block before it."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockHashes:
    """A token sequence's full-block hash chain, extended as the sequence grows (its tokens
    only grow: a request's prompt and output). ``lookahead``: tokens after a block that its
    content depends on (1 with the MTP layer's KV in it, else 0)."""

    __slots__ = ("root", "block_size", "lookahead", "hashes")

    def __init__(self, root: bytes, block_size: int, lookahead: int = 0):
        self.root, self.block_size, self.lookahead, self.hashes = root, block_size, lookahead, []

    def num_hashable(self, num_tokens: int) -> int:
        """Full blocks whose hash ``num_tokens`` tokens determine."""
        return max(0, num_tokens - self.lookahead) // self.block_size

    def upto(self, tokens: Sequence[int], num_blocks: int) -> list[bytes]:
        """The hashes of the first ``num_blocks`` full blocks of ``tokens``."""
        bs, hs, extra = self.block_size, self.hashes, self.lookahead
        if num_blocks > self.num_hashable(len(tokens)):
            raise ValueError(f"{len(tokens)} tokens do not determine {num_blocks} blocks")
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(chain_hash(hs[-1] if hs else self.root,
                                 tokens[i * bs:(i + 1) * bs + extra]))
        return hs[:num_blocks]

    def anchor(self, tokens: Sequence[int], num_blocks: int) -> bytes:
        """The hash the first ``num_blocks`` blocks end with (the root for none)."""
        return self.upto(tokens, num_blocks)[-1] if num_blocks else self.root


@dataclass(slots=True, eq=False)
class Checkpoint:
    """GDN state after ``num_tokens`` tokens, and what a hit on it needs besides the shared
    full blocks before ``num_shared`` * block_size."""

    key: tuple[bytes, tuple[int, ...]]  # (anchor hash, tokens after the shared blocks)
    num_tokens: int
    num_shared: int  # full blocks a hit shares
    slot: int
    tail_len: int  # KV positions [num_shared * bs, num_tokens) in the slot's tail: copied on a hit
    hidden: torch.Tensor | None  # the target's final hidden state at num_tokens - 1 (MTP)
    hits: int = 0  # requests that resumed from it or from a later one on its path
    last_used: int = 0
    pins: int = 0  # sessions holding it: evicted after every unpinned checkpoint
    sessions: list = field(default_factory=list)  # the pinning sessions (told on eviction)
    restored: bool = False  # read from the disk tier, not hit since


@dataclass(slots=True)
class Hit:
    """What a prompt can take from the cache: ``num_tokens`` tokens, from ``checkpoint``."""

    num_tokens: int
    checkpoint: Checkpoint
    shared_blocks: list[int]


class PrefixIndex:
    """Hash -> block and key -> checkpoint maps, with the checkpoints' eviction order. Holds no
    references itself: the manager takes and drops them (``HybridCacheManager``)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.checkpoints: dict[tuple[bytes, tuple[int, ...]], Checkpoint] = {}
        self.by_anchor: dict[bytes, list[Checkpoint]] = {}
        # the unpinned checkpoints in eviction order: never hit first, least recently used first
        self._order: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())
        self._clock = itertools.count(1)
        self.stats = {"queries": 0, "hits": 0, "hit_tokens": 0, "query_tokens": 0,
                      "disk_hits": 0, "disk_hit_tokens": 0,
                      "checkpoints_saved": 0, "checkpoint_evictions": 0, "block_evictions": 0}

    # Blocks ----------------------------------------------------------------------------------
    def register_block(self, h: bytes, block: int) -> bool:
        """Index ``block`` under ``h`` unless an equal block already is -> whether it was."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h] = block
        self.hash_of[block] = h
        return True

    def forget_block(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]
            self.stats["block_evictions"] += 1

    def is_cached(self, block: int) -> bool:
        return block in self.hash_of

    # Checkpoints -----------------------------------------------------------------------------
    def add_checkpoint(self, ck: Checkpoint) -> None:
        ck.last_used = next(self._clock)
        self.checkpoints[ck.key] = ck
        self.by_anchor.setdefault(ck.key[0], []).append(ck)
        self._order[ck.hits > 0][ck.key] = ck
        self.stats["checkpoints_saved"] += 1

    def remove_checkpoint(self, ck: Checkpoint) -> None:
        del self.checkpoints[ck.key]
        same = self.by_anchor[ck.key[0]]
        same.remove(ck)
        if not same:
            del self.by_anchor[ck.key[0]]
        self._order[ck.hits > 0].pop(ck.key, None)

    def touch(self, ck: Checkpoint, hit: bool = False) -> None:
        """``ck`` was used (``hit``: a request resumed from it, or from a later checkpoint past
        it): it is evicted last of its kind."""
        ck.last_used = next(self._clock)
        if not ck.pins:
            self._order[ck.hits > 0].pop(ck.key, None)
        ck.hits += hit
        if not ck.pins:
            self._order[ck.hits > 0][ck.key] = ck

    def pin(self, ck: Checkpoint) -> None:
        if not ck.pins:
            self._order[ck.hits > 0].pop(ck.key, None)
        ck.pins += 1

    def unpin(self, ck: Checkpoint) -> None:
        ck.pins -= 1
        if not ck.pins and ck.key in self.checkpoints:
            self._order[ck.hits > 0][ck.key] = ck

    def anchors(self) -> set[bytes]:
        """The anchors of the checkpoints a prompt can resume from now: each one's last shared
        block, still indexed (those inside the first block, anchored at the root, are left out).
        A replica's prefix summary for routing (hybridrt/prefix_routing.py)."""
        return {key[0] for key in self.checkpoints if key[0] in self.block_of}

    @property
    def num_evictable(self) -> int:
        """Checkpoints no session pins."""
        return len(self._order[0]) + len(self._order[1])

    def victim(self, spare: Checkpoint | None = None, which=None) -> Checkpoint | None:
        """The checkpoint to evict first: unpinned, never hit before hit, then least recently
        used; never ``spare``; only one for which ``which(ck)`` holds, if given."""
        for order in self._order:
            for ck in order.values():
                if ck is not spare and (which is None or which(ck)):
                    return ck
        return None

    # Look-up ---------------------------------------------------------------------------------
    def _num_present(self, chain: Sequence[bytes]) -> int:
        present = 0
        while present < len(chain) and chain[present] in self.block_of:
            present += 1
        return present

    def num_cached_blocks(self, tokens: Sequence[int], hashes: BlockHashes) -> int:
        """How many leading full blocks of ``tokens`` are cached (whether or not a checkpoint
        lets a prompt resume there)."""
        return self._num_present(hashes.upto(tokens, hashes.num_hashable(len(tokens))))

    def lookup(self, tokens: Sequence[int], hashes: BlockHashes) -> Hit | None:
        """The longest cached prefix of ``tokens`` (all of them may be taken: the caller passes
        the prompt without its last token) that ends at a checkpoint whose shared blocks are all
        cached -> the hit, or None."""
        bs = self.block_size
        chain = hashes.upto(tokens, hashes.num_hashable(len(tokens)))
        present = self._num_present(chain)
        for j in range(present, -1, -1):
            anchor = chain[j - 1] if j else hashes.root
            best = None
            for ck in self.by_anchor.get(anchor, ()):
                p = ck.num_tokens
                if p <= len(tokens) and (best is None or p > best.num_tokens) and (
                        tuple(tokens[j * bs:p]) == ck.key[1]):
                    best = ck
            if best is not None:
                return Hit(best.num_tokens, best, [self.block_of[h] for h in chain[:j]])
        return None


LEAD_IN = 256  # the first of the lead-in checkpoints before the first interval position


def checkpoint_positions(prompt: Sequence[int], boundary_token_ids: frozenset[int] | set[int],
                         interval: int, requested: Sequence[int] = ()) -> list[int]:
    """Where a prompt's GDN state is saved (positions p: the state after its first p tokens),
    the policy docs/prefix_cache.md measures:

    - before every message of a chat-templated prompt (each ``boundary_token_ids`` token, e.g.
      ``<|im_start|>``), where conversations and agents diverge: after the system prompt, each
      turn, each tool result, and where the generation prompt starts;
    - before its last token, so that the same prompt again (a retry, ``n`` > 1, a rerun)
      computes one token;
    - every ``interval`` tokens (0: never), for long prompts without messages, and before
      that at the powers of two from ``LEAD_IN`` (256, 512, 1024 under an interval of 2048):
      a prompt sharing L >= 256 tokens with one computed before resumes after at least L / 2
      of them, for log2(interval / 256) checkpoints a long prompt;
    - at ``requested`` positions (a session's ``snapshot_at``).

    The end of every finished (or preempted) request is saved too, by its release."""
    n = len(prompt)
    at = {p for p in range(1, n) if prompt[p] in boundary_token_ids}
    if n > 1:
        at.add(n - 1)
    if interval > 0:
        at.update(range(interval, n, interval))
        p = LEAD_IN
        while p < min(interval, n):
            at.add(p)
            p *= 2
    at.update(p for p in requested if 0 < p < n)
    return sorted(at)


def message_start_ids(tokenizer: Any) -> list[int]:
    """The token a chat template starts each message with (ChatML's ``<|im_start|>``), if the
    tokenizer has it: prefix-cache checkpoints go before each."""
    if tokenizer is None:
        return []
    try:
        tid = tokenizer.convert_tokens_to_ids("<|im_start|>")
    except Exception:  # a tokenizer without that method or token: no message boundaries
        return []
    unk = getattr(tokenizer, "unk_token_id", None)
    return [tid] if isinstance(tid, int) and tid != unk else []

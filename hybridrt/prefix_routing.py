"""Prefix-aware routing over engine replicas (``hybridrt serve --replicas``): which replica holds
the longest cached prefix of a prompt, and whether it may take one more request. Plain Python:
``hybridrt.ray_router`` wraps it in Ray Serve's ``RequestRouter``; the tests drive it directly.

A hybrid model resumes a prompt only where a GDN state checkpoint was saved
(statecache/prefix.py): KV blocks past the last checkpoint are of no use to it. So a replica's
summary is its checkpoints, not its blocks:

| piece | holds | costs |
| --- | --- | --- |
| summary (``replica_summary``) | 8 bytes of each checkpoint's anchor hash | <= 8 B a state slot |
| a prompt's chain (``prompt_chain``) | 8 bytes of each full block's chain hash | ~1 us a block |
| match (``matched_blocks``) | the longest j with hash j - 1 reported | a set look-up a block |
| recent (``PrefixTable.routed``) | blocks of prompts sent to a replica | ``recent_ttl`` s |

A checkpoint's anchor is the chain hash of the full blocks before it; the summary (Ray Serve's
routing stats of the replica, every period) also names the chain's root, block size and
lookahead, so the router hashes a prompt exactly as the replica's engine does. Its size depends
on the number of state slots, not on the context length or the number of cached blocks.

Reports come a period late (Ray polls them, then broadcasts), and a conversation's next turn
comes the moment its answer ends: the router therefore also counts what it sent to a replica as
held there for a while. A checkpoint's tail (the tokens after its anchor block) is not checked,
so a match may count one block more than the engine will reuse; the engine's own look-up is
exact (``usage.prompt_tokens_details.cached_tokens`` says what it reused).

The rule (``rank``): among replicas whose load is known, the ones holding the longest match go
first unless one's ongoing requests exceed the least loaded replica's by more than
``max_imbalance``; with no match, or every holder overloaded, the least loaded goes first.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from hybridrt.statecache.prefix import BlockHashes

ANCHOR_BYTES = 8  # a 64-bit prefix of a 128-bit chain hash: collisions are routing noise only
# hybridrt.ray_router's routers in this process, by deployment name: the ingress reads its own
# (Ray Serve pickles a router's module by value, so the registry cannot live there)
ROUTERS: dict = {}


def replica_summary(engine) -> dict:
    """What a router needs of an engine's prefix cache (call it on the engine thread:
    ``EngineLoop.call``): the root, block size and lookahead of the hash chain of its requests,
    and its checkpoints' anchors, sorted and joined."""
    cache = engine.cache
    hashes = cache.block_hashes(mtp=engine.speculative_tokens > 0)
    anchors = cache.prefix.anchors() if cache.prefix is not None else set()
    return {"root": hashes.root, "block_size": hashes.block_size, "lookahead": hashes.lookahead,
            "anchors": b"".join(sorted(a[:ANCHOR_BYTES] for a in anchors))}


def prompt_chain(ids: Sequence[int], root: bytes, block_size: int,
                 lookahead: int) -> list[bytes]:
    """The first ANCHOR_BYTES of the chain hash of each full block of ``ids`` that an engine's
    look-up covers (all but the prompt's last token)."""
    hashes = BlockHashes(root, block_size, lookahead)
    n = hashes.num_hashable(max(0, len(ids) - 1))
    return [h[:ANCHOR_BYTES] for h in hashes.upto(ids, n)]


class PrefixTable:
    """The router's view of what each replica holds: its last report, and the prompts sent to
    it since (``recent_ttl`` seconds, at most ``max_recent`` blocks a replica). Replicas are
    any hashable keys."""

    def __init__(self, recent_ttl: float = 10.0, max_recent: int = 1 << 17, clock=time.monotonic):
        self.recent_ttl, self.max_recent, self.clock = recent_ttl, max_recent, clock
        self._reported: dict[Hashable, tuple[bytes, frozenset[bytes]]] = {}
        self._chain_of: dict[Hashable, tuple[bytes, int, int]] = {}  # root, block size, lookahead
        self._recent: dict[Hashable, OrderedDict[bytes, float]] = {}

    def report(self, replica: Hashable, summary: Mapping | None) -> None:
        """A replica's summary (``replica_summary``), or None before its first."""
        if not summary or "anchors" not in summary:
            return
        self._chain_of[replica] = (summary["root"], summary["block_size"], summary["lookahead"])
        blob = summary["anchors"]
        old = self._reported.get(replica)
        if old is None or old[0] != blob:
            n = ANCHOR_BYTES
            self._reported[replica] = (blob, frozenset(blob[i:i + n]
                                                      for i in range(0, len(blob), n)))

    def chain_params(self, replica: Hashable) -> tuple[bytes, int, int] | None:
        """The hash chain a replica's engine uses (that of any replica before it reported:
        replicas of one deployment share it); None before any report."""
        own = self._chain_of.get(replica)
        if own is not None:
            return own
        return next(iter(self._chain_of.values()), None)

    def routed(self, replica: Hashable, chain: Sequence[bytes]) -> None:
        """A prompt with these block hashes was sent to ``replica``."""
        recent = self._recent.setdefault(replica, OrderedDict())
        now = self.clock()
        for h in chain:
            recent.pop(h, None)
            recent[h] = now
        while len(recent) > self.max_recent:
            recent.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica that is gone (its successor starts with an empty cache)."""
        for table in (self._reported, self._chain_of, self._recent):
            table.pop(replica, None)

    def matched_blocks(self, replica: Hashable, chain: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its ``prompt_chain``) ``replica`` is believed
        to hold up to a checkpoint."""
        reported = self._reported.get(replica, (b"", frozenset()))[1]
        recent = self._recent.get(replica)
        if recent:
            old = self.clock() - self.recent_ttl
            while recent and next(iter(recent.values())) < old:
                recent.popitem(last=False)
        for j in range(len(chain), 0, -1):
            h = chain[j - 1]
            if h in reported or (recent and h in recent):
                return j
        return 0


def rank(candidates: Sequence, matched: Mapping, loads: Mapping, max_imbalance: int,
         rng: random.Random | None = None) -> tuple[list[list], str]:
    """Ranks of ``candidates`` (first rank preferred; Ray Serve takes the least loaded of a rank
    with room) and the decision: "prefix" (the holders of the longest match first),
    "overloaded" (every holder's load exceeds the least loaded's by more than
    ``max_imbalance``: least loaded first), "least_loaded" (nothing matched). ``matched``:
    blocks each replica holds; ``loads``: its ongoing requests, None where unknown (those
    come last). Ties go in random order."""
    order = list(candidates)
    (rng or random).shuffle(order)
    known = sorted((c for c in order if loads.get(c) is not None), key=lambda c: loads[c])
    unknown = [c for c in order if loads.get(c) is None]
    if not known:
        return [order], "least_loaded"
    least = loads[known[0]]
    best = max(matched.get(c, 0) for c in known)
    if best == 0:
        return [known, unknown] if unknown else [known], "least_loaded"
    fit = [c for c in known if matched.get(c, 0) == best and loads[c] - least <= max_imbalance]
    if not fit:
        return [known + unknown], "overloaded"
    rest = [c for c in known if c not in fit] + unknown
    return ([fit, rest] if rest else [fit]), "prefix"

"""Branch points found, not guessed: where the prompts the engine holds share a prefix, so that
the GDN state is checkpointed exactly there (statecache/prefix.py explains why a prompt can
resume only at a checkpoint).

Two sources, both cheap when nothing is shared (a dict probe per block of a new prompt):

- **the queued prompts**: every request from its arrival to its finish (waiting, running,
  preempted) is indexed by the hash chain of its prompt's full blocks (the chain its prefix
  cache look-up computes anyway). A new prompt's deepest block that another request also holds
  gives the requests it shares most with; the exact common prefix with each (a comparison
  inside the next block) becomes a checkpoint position of both. A batch submitted together
  (``LLM.generate(list)``, a JSONL file, requests queued at once in the server) has every
  common prefix known before its first prefill; the scheduler then holds the later requests
  while the first one writes the checkpoint (``Scheduler._prefix_in_flight``).
- **the cached KV blocks**: a request admitted from a checkpoint short of the cached full
  blocks its prompt matches (the blocks of a finished request that went another way after
  them) gets a checkpoint where those blocks end; its prefill writes it and the next request
  with that prefix resumes there (within a block of the true branch).

Requests are duck-typed (``request_id``, ``prompt_token_ids``, ``token_ids``,
``block_hashes``, ``checkpoint_at``, ``num_computed_tokens``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

# A new prompt is compared with at most this many of the requests holding its deepest shared
# block (the earliest queued first: they compute the prefix first).
MAX_PEERS = 32


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """The length of the common prefix of ``a`` and ``b``, given that it is at least
    ``start``."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prompt_of(req) -> Sequence[int]:
    """The request's prompt as the prefix cache keys it: ``token_ids`` (an image's tokens there
    carry its content's key, hybridrt.vision), never the raw ``prompt_token_ids``."""
    return req.token_ids[:len(req.prompt_token_ids)]


def add_position(req, p: int) -> bool:
    """Checkpoint ``req``'s state after ``p`` tokens, at most all but its prompt's last token
    and only where it has not computed yet -> whether a position was added."""
    p = min(p, len(req.prompt_token_ids) - 1)
    if p <= req.num_computed_tokens or p < 1:
        return False
    at = req.checkpoint_at
    i = bisect.bisect_left(at, p)
    if i < len(at) and at[i] == p:
        return False
    at.insert(i, p)
    return True


class BranchPoints:
    """The hash chains of the prompts the scheduler holds (block hash -> the requests whose
    prompt has that block, in arrival order), and the positions found from them."""

    def __init__(self):
        self._holders: dict[bytes, dict[str, object]] = {}
        self._chains: dict[str, list[bytes]] = {}
        self.stats = {"branch_points_queued": 0, "branch_points_cached": 0}

    def add(self, req) -> None:
        """Index a request that arrives; checkpoint it and the requests it shares most with
        where their prompts part."""
        hashes = req.block_hashes
        if hashes is None or req.request_id in self._chains:
            return
        tokens = prompt_of(req)
        chain = hashes.upto(tokens, hashes.num_hashable(len(tokens)))
        holders = self._holders
        lo, hi = 0, len(chain)  # the deepest shared block: chains are prefix-closed
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in holders:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            start = lo * hashes.block_size
            for peer in itertools.islice(holders[chain[lo - 1]].values(), MAX_PEERS):
                c = common_prefix(tokens, prompt_of(peer), start)
                found = add_position(req, c)
                found = add_position(peer, c) or found
                self.stats["branch_points_queued"] += found
        for h in chain:
            holders.setdefault(h, {})[req.request_id] = req
        self._chains[req.request_id] = chain

    def remove(self, req) -> None:
        """Forget a request that finished (idempotent)."""
        for h in self._chains.pop(req.request_id, ()):
            same = self._holders[h]
            del same[req.request_id]
            if not same:
                del self._holders[h]

    def admitted(self, req, prefix, num_cached: int) -> None:
        """``req`` was admitted with ``num_cached`` tokens from the cache: when its prompt
        matches cached full blocks at least a block beyond that (``prefix``: the cache's
        ``PrefixIndex``), checkpoint it where they end."""
        hashes = req.block_hashes
        if hashes is None or prefix is None:
            return
        bs = hashes.block_size
        p = prefix.num_cached_blocks(req.token_ids, hashes) * bs
        if num_cached + bs <= p < len(req.prompt_token_ids) and add_position(req, p):
            self.stats["branch_points_cached"] += 1

"""Prompt lookup (n-gram) drafting: a request's next tokens guessed from its own context.

The drafts continue the most recent earlier occurrence of the context's last n tokens, the
longest n in [min_n, max_n] that has one: with tokens ``t[0..L)`` and an earlier end ``e < L``
where ``t[e-n:e] == t[L-n:L]``, draft j is ``t[e + j]``, and past ``L`` the drafts themselves
(a repeating span continues with its period ``L - e``; with ``extend`` False the drafts stop
at ``L`` instead, where the MTP extends them). No match gives no drafts.

``NgramIndex`` keeps, per n, where each n-gram of a request's tokens last ended, grown by the
tokens appended since the last look-up (a request's tokens only grow), so a look-up costs
O(new tokens + max_n) whatever the context length. ``NgramDrafter`` holds one index per
running request; the index of a request that finished is dropped at the next look-up.

A drafted token's distribution is a point mass: verification accepts it with probability
p(d) and, on a rejection, samples from p with d removed (``specdec.verify``), so sampled output
keeps the target's distribution; greedy output is the target's argmax as always.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Where each n-gram of one token list last ended (exclusive), for n in [min_n, max_n];
    only ends that have a following token are recorded, so the list's own suffix never
    matches itself."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}
        self.next_end = 1  # the smallest end not recorded yet

    def extend(self, tokens: Sequence[int]) -> None:
        """Record the n-grams ending before ``len(tokens) - 1``'s token (each end e < L)."""
        for e in range(self.next_end, len(tokens)):
            for n, ends in self.last_end.items():
                if e >= n:
                    ends[tuple(tokens[e - n:e])] = e
        self.next_end = max(self.next_end, len(tokens))

    def lookup(self, tokens: Sequence[int], k: int, extend: bool = True) -> list[int]:
        """Up to ``k`` drafts after ``tokens`` (the module's docstring); ``tokens`` must be the
        list this index was extended with."""
        self.extend(tokens)
        L = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = self.last_end[n].get(tuple(tokens[L - n:]))
            if e is None:
                continue
            drafts: list[int] = []
            for j in range(k if extend else min(k, L - e)):
                p = e + j
                drafts.append(tokens[p] if p < L else drafts[p - L])
            return drafts
        return []


class NgramDrafter:
    """The prompt-lookup drafts of running requests (one ``NgramIndex`` each)."""

    def __init__(self, min_n: int = 1, max_n: int = 4, extend: bool = True):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {min_n} and {max_n}")
        self.min_n, self.max_n, self.extend = min_n, max_n, extend
        self._indexes: dict[str, tuple[object, NgramIndex]] = {}

    def drafts(self, req, k: int) -> list[int]:
        """Up to ``k`` drafts for ``req`` (a ``Request``) after its tokens so far."""
        entry = self._indexes.get(req.request_id)
        if entry is None or entry[0] is not req:
            entry = (req, NgramIndex(self.min_n, self.max_n))
            self._indexes[req.request_id] = entry
        drafts = entry[1].lookup(req.token_ids, k, self.extend)
        # an image token (a negative content key in token_ids, hybridrt.vision) is no draft
        cut = next((j for j, t in enumerate(drafts) if t < 0), len(drafts))
        return drafts[:cut]

    def prune(self) -> None:
        """Drop the indexes of finished requests."""
        done = [rid for rid, (req, _) in self._indexes.items() if req.is_finished]
        for rid in done:
            del self._indexes[rid]

"""Sessions: a conversation's cache kept between requests (multi-turn without re-prefill).

A session owns, between turns, the KV blocks and GDN state slots of the tokens it has
computed. A request on a session reuses the longest prefix its prompt shares with those
tokens; it takes them over when it is admitted, not before, so a waiting request holds no cache.
KV can be cut back to any prefix, GDN state cannot, so each turn also saves the GDN state just
before the last prompt token into the session's snapshot slot: a request that diverges inside
the previous answer (``/regen``) restarts from there, any other divergence recomputes from
scratch.

Snapshot slots are planned in the cache budget, one per session (``max_num_sessions``). The
rest of a session's cache is evictable: when a request needs room, the engine frees the cache
of the least recently used session whose cache no request holds; that session's next turn
prefills from scratch and reports ``session_cache_evicted`` in its metrics.

| field | meaning |
| --- | --- |
| token_ids | tokens whose KV / GDN state the session holds (all computed) |
| slot_cursor | which of its state slots holds the current GDN state |
| snapshot_len | GDN state after ``token_ids[:snapshot_len]`` is in ``snapshot_slot`` |
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Session:
    session_id: str
    snapshot_slot: int
    token_ids: list[int] = field(default_factory=list)
    slot_cursor: int = 0
    snapshot_len: int | None = None
    busy: bool = False  # a request on this session is waiting or running
    closed: bool = False
    evicted: bool = False  # its cache was evicted since its last turn
    last_reused_tokens: int = 0  # prompt tokens the last request did not have to prefill

    @property
    def cache_key(self) -> str:
        return f"session:{self.session_id}"

"""The session manager: the pins a conversation keeps in the prefix cache between its requests
(see ``hybridrt/session.py`` for what a session holds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrt.session import Session

if TYPE_CHECKING:
    from hybridrt.request import Request
    from hybridrt.statecache import HybridCacheManager


class SessionManager:
    """Owns the open sessions (least recently used first) and what they pin: ``keep`` when a
    request on one finishes, ``evict_idle`` when a request needs room. Writes session fields
    only."""

    def __init__(self, cache: HybridCacheManager, max_num_sessions: int | None = None):
        self.cache = cache
        self.max_num_sessions = max_num_sessions
        self.sessions: dict[str, Session] = {}
        self.num_evictions = 0
        cache.on_checkpoint_evicted = self._checkpoint_evicted

    def open(self, session_id: str) -> Session:
        if self.max_num_sessions is not None and len(self.sessions) >= self.max_num_sessions:
            raise RuntimeError(f"all {self.max_num_sessions} sessions are open: close a session "
                               f"or raise max_num_sessions")
        session = Session(session_id)
        self.sessions[session_id] = session
        return session

    def close(self, session: Session) -> None:
        if session.closed:
            return
        if session.busy:
            raise ValueError("close_session: the session has a running request")
        self._unpin(session)
        del self.sessions[session.session_id]
        session.closed = True

    def reset(self, session: Session) -> None:
        """Give up what the session pins (``/clear``); the session stays usable."""
        if session.busy:
            raise ValueError("reset_session: the session has a running request")
        self._unpin(session)

    def claim(self, session: Session) -> None:
        """Mark ``session`` busy for a new request; ValueError if it cannot take one."""
        if session.closed:
            raise ValueError("session is closed")
        if session.busy:
            raise ValueError("session already has a running request")
        session.busy = True

    def admitted(self, req: Request) -> None:
        """A session request was admitted: what it reused, and whether the session lost
        anything since its last turn."""
        session = req.session
        req.metrics.session_cache_evicted = session.evicted
        session.evicted = False
        session.last_reused_tokens = req.num_computed_tokens

    def release(self, req: Request) -> None:
        """A finished (or aborted) session request: the session takes another."""
        session = req.session
        session.busy = False
        self.sessions[session.session_id] = self.sessions.pop(session.session_id)  # most recent

    def keep(self, req: Request) -> None:
        """After a session request released its cache: pin the checkpoints it left (after its
        last computed token, and at its ``snapshot_at``, else before its last prompt token) and
        hold the blocks before the furthest of them, in place of the previous turn's."""
        session, cache = req.session, self.cache
        self._unpin(session)
        if cache.prefix is None or req.block_hashes is None:
            return
        done = req.num_computed_tokens
        tokens = req.token_ids[:done]
        snap = req.requested_snapshot_at
        wanted = {done, req.num_prompt_tokens - 1 if snap is None else snap}
        for p in sorted(wanted):
            if not 0 < p <= done:
                continue
            key, _, _ = cache.checkpoint_key(tokens, req.block_hashes, p)
            ck = cache.prefix.checkpoints.get(key)
            if ck is not None:
                cache.pin(ck)
                ck.sessions.append(session)
                session.pins.append(ck)
        hit = cache.prefix.lookup(tokens, req.block_hashes)
        if hit is not None and hit.shared_blocks:
            cache.hold(session.cache_key, hit.shared_blocks)

    def evict_idle(self) -> bool:
        """Give up the pins of the least recently used session that holds any while no request
        of it is running, one without a waiting request first; what it pinned stays cached
        until the room is needed -> whether anything was given up."""
        order = sorted(self.sessions.values(), key=lambda s: s.busy)  # stable: LRU within
        for session in order:
            if session.pins or self.cache.holds(session.cache_key):
                self._unpin(session)
                session.evicted = True
                self.num_evictions += 1
                return True
        return False

    def _unpin(self, session: Session) -> None:
        for ck in session.pins:
            self.cache.unpin(ck)
            ck.sessions.remove(session)
        session.pins = []
        self.cache.release(session.cache_key)

    def _checkpoint_evicted(self, ck) -> None:
        for session in ck.sessions:
            session.pins.remove(ck)
            session.evicted = True
        ck.sessions.clear()

"""The session manager: moves a conversation's cache between its session and the request that
continues it (see ``hybridrt/session.py`` for what a session holds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridrt.session import Session

if TYPE_CHECKING:
    from hybridrt.request import Request
    from hybridrt.statecache import HybridCacheManager


@dataclass(slots=True)
class Attached:
    """What a session request takes over from its session as it is admitted; the scheduler
    writes it into the request."""

    num_computed_tokens: int  # prompt tokens reused from the session's cache
    slot_cursor: int  # which of the request's state slots holds the GDN state
    pending_snapshot_at: int | None  # the prompt length to save the GDN state at (None: none)
    cache_evicted: bool  # the session's cache was evicted since its last turn


class SessionManager:
    """Owns the open sessions (least recently used first) and moves cache between a session and
    its request: ``attach`` when the request is admitted, ``detach`` when it could not be after
    all, ``release`` when it finishes, ``save_snapshot`` at its snapshot point. Writes session
    fields only; what a request takes over it returns."""

    def __init__(self, cache: HybridCacheManager):
        self.cache = cache
        self.sessions: dict[str, Session] = {}
        self.num_evictions = 0

    def open(self, session_id: str) -> Session:
        slot = self.cache.take_snapshot_slot()
        if slot is None:
            raise RuntimeError(f"all {self.cache.sizing.num_snapshot_slots} session slots are in "
                               f"use: close a session or raise max_num_sessions")
        session = Session(session_id, slot)
        self.sessions[session_id] = session
        return session

    def close(self, session: Session) -> None:
        if session.closed:
            return
        if session.busy:
            raise ValueError("close_session: the session has a running request")
        self.cache.free(session.cache_key)
        self.cache.release_snapshot_slot(session.snapshot_slot)
        del self.sessions[session.session_id]
        session.closed = True

    def reset(self, session: Session) -> None:
        """Forget the cached conversation (``/clear``); the session stays usable."""
        if session.busy:
            raise ValueError("reset_session: the session has a running request")
        self._forget(session)

    def claim(self, session: Session) -> None:
        """Mark ``session`` busy for a new request; ValueError if it cannot take one."""
        if session.closed:
            raise ValueError("session is closed")
        if session.busy:
            raise ValueError("session already has a running request")
        session.busy = True

    def reusable_tokens(self, session: Session, prompt_token_ids: list[int],
                        spec_k: int = 0) -> int:
        """How many leading prompt tokens a request on ``session`` would take from its cache
        now: the common prefix with the session's tokens (at most all but the last prompt
        token); where the prompt diverges inside them, the snapshot if it lies before the
        divergence, else none."""
        reuse = min(common_prefix(prompt_token_ids, session.token_ids),
                    len(prompt_token_ids) - 1)
        slots = self.cache.state_slots(session.cache_key)
        if slots and len(slots) != 1 + spec_k:
            return 0  # slot layout changed with speculative_tokens: start over
        if 0 < reuse < len(session.token_ids):
            snap = session.snapshot_len
            return snap if snap is not None and snap <= reuse else 0
        return reuse

    def attach(self, req: Request) -> Attached:
        """Hand a session request, as it is admitted, the session's cache for the longest
        reusable prompt prefix -> what the request takes over."""
        session, cache, key = req.session, self.cache, req.session.cache_key
        ids = req.prompt_token_ids
        reuse = self.reusable_tokens(session, ids, req.spec_k)
        if 0 < reuse < len(session.token_ids):  # the GDN state at the snapshot
            cache.copy_state(session.snapshot_slot, cache.state_slot(key, session.slot_cursor))
        if reuse == 0:
            cache.free(key)
            session.slot_cursor, session.snapshot_len = 0, None
        else:
            cache.truncate(key, reuse)
            if session.snapshot_len is not None and session.snapshot_len > reuse:
                session.snapshot_len = None
        cache.transfer(key, req.request_id)
        asked = req.requested_snapshot_at
        at = len(ids) - 1 if asked is None else min(asked, len(ids) - 1)
        attached = Attached(reuse, session.slot_cursor if reuse else 0,
                            at if at > reuse else None, session.evicted)
        session.evicted = False
        session.last_reused_tokens = reuse
        return attached

    def detach(self, req: Request) -> None:
        """Undo ``attach`` for a request that could not be admitted after all: the session
        holds the reused prefix again (the scheduler resets the request)."""
        self._take_back(req)

    def release(self, req: Request) -> None:
        """A finished (or aborted) session request hands its cache back to the session."""
        session = req.session
        session.busy = False
        self.sessions[session.session_id] = self.sessions.pop(session.session_id)  # most recent
        if not req.session_attached:  # never admitted: the session kept its cache
            return
        self._take_back(req)
        if session.snapshot_len is not None and session.snapshot_len > len(session.token_ids):
            session.snapshot_len = None

    def save_snapshot(self, req: Request) -> bool:
        """At the request's snapshot point, save its GDN state into the session's snapshot
        slot -> whether it did (the request's ``pending_snapshot_at`` is then spent)."""
        if req.pending_snapshot_at is None or req.num_computed_tokens != req.pending_snapshot_at:
            return False
        own = self.cache.state_slot(req.request_id, req.slot_cursor)
        self.cache.copy_state(own, req.session.snapshot_slot)
        req.session.snapshot_len = req.pending_snapshot_at
        return True

    def evict_idle(self) -> bool:
        """Free the cache of the least recently used session that holds one while no request
        of it is running, one without a waiting request first; its next turn prefills from
        scratch -> whether anything was freed."""
        order = sorted(self.sessions.values(), key=lambda s: s.busy)  # stable: LRU within
        for session in order:
            if self.cache.holds(session.cache_key):
                self._forget(session)
                session.evicted = True
                self.num_evictions += 1
                return True
        return False

    def _take_back(self, req: Request) -> None:
        session = req.session
        self.cache.transfer(req.request_id, session.cache_key)
        session.token_ids = req.token_ids[:req.num_computed_tokens]
        session.slot_cursor = req.slot_cursor

    def _forget(self, session: Session) -> None:
        self.cache.free(session.cache_key)
        session.token_ids, session.slot_cursor, session.snapshot_len = [], 0, None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

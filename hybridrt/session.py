"""Sessions: a conversation whose cache outlives its requests (multi-turn without re-prefill).

Every request reuses the longest cached prefix of its prompt (the prefix cache,
``statecache/prefix.py``); a session makes that likely for a conversation. When a request on a
session finishes, the session pins the GDN checkpoints the request left (after its last
computed token, before its last prompt token, and at the ``snapshot_at`` position it asked for,
where a chat's generation prompt starts) and holds the KV blocks before them, so that the
next turn finds them whatever other traffic does meanwhile (two checkpoints: give the cache
room for them, ``checkpoint_share``):

- a follow-up that extends the conversation resumes after the previous answer;
- one that diverges inside the previous answer (``/regen``, or a template that rewrites the
  history, as Qwen3.5's does with old think blocks) resumes at the snapshot or before the last
  prompt token;
- any other divergence resumes at the longest cached prefix there is, as any request does.

What a session holds is evictable: when a request needs room, the engine gives up the pins of
the least recently used session that has no request running; its cached blocks and checkpoints
then stay in the cache like any others and are evicted when the room is needed, and its next
turn reports ``session_cache_evicted`` in its metrics. A session holds no memory of its own.

| field | meaning |
| --- | --- |
| pins | the checkpoints it pins (its last finished request's) |
| held | whether it holds the blocks before them (under ``cache_key``) |
| last_reused_tokens | prompt tokens its last request took from the cache |
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Session:
    session_id: str
    pins: list = field(default_factory=list)  # statecache.prefix.Checkpoint
    busy: bool = False  # a request on this session is waiting or running
    closed: bool = False
    evicted: bool = False  # a checkpoint or block it pinned was evicted since its last turn
    last_reused_tokens: int = 0  # prompt tokens the last request did not have to prefill

    @property
    def cache_key(self) -> str:
        return f"session:{self.session_id}"

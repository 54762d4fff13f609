"""The engine side of ``hybridrt serve``: ``EngineLoop`` runs the ``LLMEngine`` in its own
thread. Between steps it takes new requests and aborts from a queue, runs a step when anything
is unfinished, and posts each request's progress (``Progress``) to its ``Handle`` on the event
loop. An exception inside a step fails the requests in flight and the loop goes on. It keeps
the counters and gauges /metrics reads (hybridrt.server.metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hybridrt.parallel_sampling import ParentRequest
from hybridrt.sampling_params import SamplingParams
from hybridrt.server.job import Job


@dataclass(slots=True)
class Progress:
    """What one step did to a request, posted to its handle."""

    new_token_ids: list[int]
    new_logprobs: list[dict] | None
    text: str  # all of the output's text so far
    finish_reason: str | None = None
    error: Exception | None = None
    num_prompt_tokens: int = 0
    num_reused_tokens: int = 0
    index: int = 0  # the choice (n > 1) it is of
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(eq=False)
class Handle:
    """The HTTP side's end of one request (one choice: the n choices of one HTTP request
    share ``queue``, and their items say whose they are by ``index``)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: str | None = None
    sent_tokens: int = 0
    index: int = 0
    parent_id: str | None = None

    def post(self, item: Progress) -> None:
        item.index = self.index
        with contextlib.suppress(RuntimeError):  # a closed event loop: shutting down
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Runs ``llm.engine`` in its own thread; ``submit`` / ``abort`` from any thread."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.engine
        self.inbox: queue.Queue = queue.Queue()
        self.active: dict[str, Handle] = {}
        self.counters = {"requests": {}, "prompt_tokens": 0, "generation_tokens": 0,
                         "prefix_reused_tokens": 0, "engine_errors": 0}
        self.gauges: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, name="hybridrt-engine", daemon=True)
        self._stopping = False
        self._publish()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop the thread and abort what is in flight."""
        self._stopping = True
        self.inbox.put(("stop",))
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        for rid in list(self.active):
            self.engine.abort_request(rid)
            self.engine.pop_request(rid)
        self.active.clear()
        while True:  # calls that came too late: their callers must not wait forever
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "call":
                cmd[2].set_exception(RuntimeError("the engine loop has stopped"))

    def submit(self, handle: Handle, ids: list[int], params: SamplingParams,
               prompt: str | None, snapshot_at: int | None, vision=None) -> None:
        self.inbox.put(("add", handle, ids, params, prompt, snapshot_at, vision))

    def abort(self, handle: Handle) -> None:
        self.inbox.put(("abort", handle))

    def call(self, fn) -> Future:
        """``fn(engine)`` on the engine thread between two steps -> a future of its result (what
        reads the engine's state from another thread: the cache's index changes during a
        step)."""
        fut: Future = Future()
        self.inbox.put(("call", fn, fut))
        return fut

    # The engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            busy = self.engine.has_unfinished_requests()
            try:
                cmd = self.inbox.get(block=not busy)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._command(cmd)
                try:
                    cmd = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopping or not self.engine.has_unfinished_requests():
                self._publish()
                continue
            try:
                progressed = self.engine.step()
            except Exception as e:  # a bug or a device error: fail what is in flight, go on
                traceback.print_exc()
                self._fail_all(e)
                self._publish()
                continue
            for req in progressed:
                self._post(req)
            self._publish()

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, handle, ids, params, prompt, snapshot_at, vision = cmd
            try:
                rid = self.engine.add_request(ids, params, prompt=prompt,
                                              snapshot_at=snapshot_at,
                                              parent_id=handle.parent_id, vision=vision)
            except Exception as e:
                handle.post(Progress([], None, "", "error", e, len(ids)))
                return
            handle.request_id = rid
            self.active[rid] = handle
        elif cmd[0] == "abort":
            rid = cmd[1].request_id
            if rid in self.active:
                del self.active[rid]
                self.engine.abort_request(rid)
                self._count(self.engine.pop_request(rid))
        elif cmd[0] == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _post(self, req) -> None:
        handle = self.active.get(req.request_id)
        if handle is None:
            return
        out = req.output_token_ids
        new = out[handle.sent_tokens:]
        lps = None if req.logprobs is None else req.logprobs[handle.sent_tokens:len(out)]
        handle.sent_tokens = len(out)
        item = Progress(list(new), lps, req.text)
        if req.is_finished:
            item.finish_reason, item.error = req.finish_reason, req.error
            item.stop_reason = req.stop_reason
            item.num_prompt_tokens = req.num_prompt_tokens
            item.num_reused_tokens = req.metrics.num_cached_tokens
            del self.active[req.request_id]
            self._count(self.engine.pop_request(req.request_id))
        handle.post(item)

    def _count(self, req, reason: str | None = None) -> None:
        """Count a finished request under ``reason`` (default: its finish reason)."""
        if req is None:
            return
        c = self.counters
        reason = reason or req.finish_reason or "abort"
        c["requests"][reason] = c["requests"].get(reason, 0) + 1
        c["prompt_tokens"] += req.num_prompt_tokens
        c["generation_tokens"] += req.num_output_tokens
        c["prefix_reused_tokens"] += req.metrics.num_cached_tokens

    def _fail_all(self, error: Exception) -> None:
        self.counters["engine_errors"] += 1
        for rid, handle in list(self.active.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                traceback.print_exc()
            req = self.engine.pop_request(rid)
            self._count(req, "error")
            handle.post(Progress([], None, "", "error", RuntimeError(f"engine error: {error}")))
        self.active.clear()

    def _publish(self) -> None:
        """Numbers for /metrics, replaced as a whole so the HTTP side reads a consistent
        set."""
        e, cache = self.engine, self.engine.cache
        usage = cache.usage()
        spec = e.spec_stats
        prefix = dict(cache.prefix.stats) if cache.prefix is not None else {}
        self.gauges = {
            "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
            "blocks_total": usage.num_blocks,
            "blocks_used": usage.num_used_blocks,
            "blocks_cached": usage.num_cached_blocks,
            "checkpoints": usage.num_checkpoints,
            "checkpoint_bytes": usage.num_checkpoints * cache.sizing.bytes_per_slot,
            "prefilled_tokens": e.stats["num_prefill_tokens"],
            "prefix_queries": prefix.get("queries", 0),
            "prefix_query_tokens": prefix.get("query_tokens", 0),
            "prefix_cache_hits": prefix.get("hits", 0),
            "prefix_hit_tokens": prefix.get("hit_tokens", 0),
            "block_evictions": prefix.get("block_evictions", 0),
            "checkpoint_evictions": prefix.get("checkpoint_evictions", 0),
            "checkpoints_saved": prefix.get("checkpoints_saved", 0),
            "preemptions": e.stats["num_preemptions"],
            **spec.counters(),
            "branch_points": sum(e.scheduler.branch_points.stats.values())
            if e.scheduler.branch_points is not None else 0,
            **cache.tier_stats(),
        }


def submit_job(loop: EngineLoop, job: Job) -> list[Handle]:
    """A prepared request to the engine: one request, or n choices as child requests of one
    parent (hybridrt.parallel_sampling), their handles on one queue of the running event
    loop."""
    event_loop, params = asyncio.get_running_loop(), job.params
    if params.n == 1:
        handles = [Handle(event_loop)]
        children = [params]
    else:
        parent = ParentRequest(job.id, params)
        shared = asyncio.Queue()
        handles = [Handle(event_loop, shared, index=i, parent_id=parent.request_id)
                   for i in range(params.n)]
        children = [parent.child_params(i) for i in range(params.n)]
    for handle, child in zip(handles, children):
        loop.submit(handle, job.ids, child, job.prompt, job.snapshot_at, job.vision)
    return handles

"""``hybridrt serve``: an OpenAI-compatible HTTP server over one engine.

Two threads. The HTTP side (Starlette on uvicorn's event loop) parses requests, applies the
chat template, tokenizes, and turns progress into responses or server-sent events. The
engine thread (``EngineLoop``) owns the ``LLMEngine``: between steps it takes new requests and
aborts from a queue, runs a step when anything is unfinished, and posts each request's
progress (``Progress``) back to the event loop. A client that disconnects aborts its request;
an exception inside a step fails the requests in flight (HTTP 500) and the loop goes on.

Prefix reuse is the engine's prefix cache (``statecache/prefix.py``): every request resumes
from the longest cached prefix of its prompt, so a client that resends the conversation with
one more turn prefills only that turn, and clients that share a system prompt share its cache
(``usage.prompt_tokens_details.cached_tokens``). Chat prompts are checkpointed before every
message, so a next turn whose template re-renders the last answer (Qwen3.5 drops old think
blocks) still reuses everything before it. Under memory pressure the cache gives way before any
running request is preempted.

Hostile and careless clients (docs/server.md): the body is read with a size limit (413 from
Content-Length before reading, or as soon as the bytes read pass it) and a deadline (408);
parsing, validation, chat templating and tokenizing run in a small thread pool
(``Server.workers`` threads, one request each at a time) so the event loop keeps answering
/health and other clients while a large request is parsed; every size a request may ask for
is bounded (``openai_protocol.Limits``). An unexpected exception in a handler is logged and
answered with a JSON 500 that names nothing internal; the connection stays usable. The API
key is compared in constant time (``hmac.compare_digest``) and guards /v1/* and /metrics
(unless ``metrics_public``); /health is always open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hybridrt import openai_protocol as api
from hybridrt.parallel_sampling import ParentRequest
from hybridrt.reasoning import ReasoningSplitter, opens_thinking, split_reasoning
from hybridrt.sampling_params import SamplingParams
from hybridrt.tool_calls import ToolCallParser, parse_tool_calls, tool_constraint

log = logging.getLogger("hybridrt.server")


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
               prompt: str | None, snapshot_at: int | None) -> None:
        self.inbox.put(("add", handle, ids, params, prompt, snapshot_at))

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
            _, handle, ids, params, prompt, snapshot_at = cmd
            try:
                rid = self.engine.add_request(ids, params, prompt=prompt,
                                              snapshot_at=snapshot_at,
                                              parent_id=handle.parent_id)
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
            "spec_draft_tokens": spec.num_draft_tokens, "spec_accepted_tokens": spec.num_accepted,
        }


def submit_job(loop: EngineLoop, job: dict) -> list[Handle]:
    """A prepared request (``Server._prepare``'s job: ids, params, prompt, snapshot_at, id) to
    the engine: one request, or n choices as child requests of one parent
    (hybridrt.parallel_sampling), their handles on one queue of the running event loop."""
    event_loop, params = asyncio.get_running_loop(), job["params"]
    if params.n == 1:
        handles = [Handle(event_loop)]
        children = [params]
    else:
        parent = ParentRequest(job["id"], params)
        shared = asyncio.Queue()
        handles = [Handle(event_loop, shared, index=i, parent_id=parent.request_id)
                   for i in range(params.n)]
        children = [parent.child_params(i) for i in range(params.n)]
    for handle, child in zip(handles, children):
        loop.submit(handle, job["ids"], child, job["prompt"], job["snapshot_at"])
    return handles


# Metrics -------------------------------------------------------------------------------------
_METRICS = [  # name, type, help, how to read it from (counters, gauges)
    ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
     lambda c, g: c["prompt_tokens"]),
    ("generation_tokens_total", "counter", "Generated tokens of finished requests.",
     lambda c, g: c["generation_tokens"]),
    ("prefill_tokens_total", "counter", "Prompt tokens computed (prefilled).",
     lambda c, g: g["prefilled_tokens"]),
    ("prefix_reused_tokens_total", "counter",
     "Prompt tokens of finished requests taken from the prefix cache.",
     lambda c, g: c["prefix_reused_tokens"]),
    ("prefix_cache_queries_total", "counter", "Requests admitted with a prefix-cache look-up.",
     lambda c, g: g["prefix_queries"]),
    ("prefix_cache_query_tokens_total", "counter", "Tokens of the looked-up requests.",
     lambda c, g: g["prefix_query_tokens"]),
    ("prefix_cache_hits_total", "counter", "Admissions that resumed from a cached prefix.",
     lambda c, g: g["prefix_cache_hits"]),
    ("prefix_cache_hit_tokens_total", "counter", "Tokens taken from the prefix cache.",
     lambda c, g: g["prefix_hit_tokens"]),
    ("prefix_cache_checkpoints_saved_total", "counter", "GDN state checkpoints saved.",
     lambda c, g: g["checkpoints_saved"]),
    ("prefix_cache_checkpoint_evictions_total", "counter", "GDN state checkpoints evicted.",
     lambda c, g: g["checkpoint_evictions"]),
    ("prefix_cache_block_evictions_total", "counter", "Cached KV blocks evicted.",
     lambda c, g: g["block_evictions"]),
    ("preemptions_total", "counter", "Running requests preempted for room.",
     lambda c, g: g["preemptions"]),
    ("engine_errors_total", "counter", "Engine steps that raised.",
     lambda c, g: c["engine_errors"]),
    ("spec_draft_tokens_total", "counter", "Speculative draft tokens verified.",
     lambda c, g: g["spec_draft_tokens"]),
    ("spec_accepted_tokens_total", "counter", "Speculative draft tokens accepted.",
     lambda c, g: g["spec_accepted_tokens"]),
    ("requests_running", "gauge", "Requests running.", lambda c, g: g["running"]),
    ("requests_waiting", "gauge", "Requests waiting.", lambda c, g: g["waiting"]),
    ("cache_blocks_total", "gauge", "KV blocks in the cache.", lambda c, g: g["blocks_total"]),
    ("cache_blocks_used", "gauge", "KV blocks held by requests.",
     lambda c, g: g["blocks_used"]),
    ("cache_blocks_cached", "gauge", "KV blocks indexed by the prefix cache.",
     lambda c, g: g["blocks_cached"]),
    ("cache_usage", "gauge", "Fraction of KV blocks in use.",
     lambda c, g: g["blocks_used"] / max(1, g["blocks_total"])),
    ("prefix_cache_checkpoints", "gauge", "GDN state checkpoints held.",
     lambda c, g: g["checkpoints"]),
    ("prefix_cache_checkpoint_bytes", "gauge", "Bytes of the checkpoints held.",
     lambda c, g: g["checkpoint_bytes"]),
]


def metrics_text(loop: EngineLoop) -> str:
    """Prometheus text exposition of the loop's counters and gauges."""
    return "\n".join(metrics_lines([("", loop.counters, loop.gauges)])) + "\n"


def metrics_lines(sources: list[tuple[str, dict, dict]]) -> list[str]:
    """The metrics of several engines, each ``(labels, counters, gauges)`` (labels: '' or
    'replica="r1"'), one family at a time as the text format wants."""
    lines = ["# HELP hybridrt_requests_total Finished requests, by finish reason.",
             "# TYPE hybridrt_requests_total counter"]
    for labels, c, _ in sources:
        for reason, n in sorted(dict(c["requests"]).items()):
            both = ",".join(x for x in (labels, f'finish_reason="{reason}"') if x)
            lines.append(f"hybridrt_requests_total{{{both}}} {n}")
    for name, kind, text, read in _METRICS:
        lines += [f"# HELP hybridrt_{name} {text}", f"# TYPE hybridrt_{name} {kind}"]
        lines += [f"hybridrt_{name}{{{labels}}} {read(c, g)}" if labels else
                  f"hybridrt_{name} {read(c, g)}" for labels, c, g in sources]
    return lines


# HTTP ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Frontend:
    """What the HTTP side needs of a model, weights aside: its tokenizer (and chat template),
    its directory (the generation defaults) and a prompt's bounds. ``of(llm)``: a loaded
    model's; ``hybridrt.ray_serve``'s ingress builds one from the checkpoint's files."""

    tokenizer: Any
    model_path: str
    vocab_size: int
    max_model_len: int

    @classmethod
    def of(cls, llm) -> Frontend:
        return cls(llm.tokenizer, str(llm.model_path), llm.config.vocab_size,
                   llm.engine.engine_config.max_model_len)

    def apply_chat_template(self, messages: list[dict], kwargs: dict | None,
                            add_generation_prompt: bool) -> str:
        from hybridrt.llm import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, kwargs, add_generation_prompt)

    def validate_prompt(self, ids) -> list[int]:
        from hybridrt.request import validate_prompt

        return validate_prompt(ids, self.vocab_size, self.max_model_len)


class Server:
    """The OpenAI endpoints over an ``EngineLoop``. ``limits``: what one request may ask for
    (default ``openai_protocol.Limits()``); ``workers``: threads that parse and tokenize;
    ``body_timeout``: seconds a client may take to send its body."""

    def __init__(self, llm, model_name: str, api_key: str | None = None,
                 limits: api.Limits | None = None, metrics_public: bool = False,
                 workers: int = 2, body_timeout: float = 60.0, front: Frontend | None = None):
        from hybridrt.llm import generation_defaults

        self.llm, self.model_name = llm, model_name
        self.front = front if front is not None else Frontend.of(llm)
        self.tokenizer = self.front.tokenizer
        self.api_key, self.metrics_public = api_key, metrics_public
        self.max_model_len = self.front.max_model_len
        self.limits = (limits or api.Limits()).resolved(self.max_model_len)
        self.body_timeout = body_timeout
        self.defaults = generation_defaults(self.front.model_path)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hybridrt-parse")
        self.pool_slots = asyncio.Semaphore(workers)  # queue in the loop, not in the pool
        self.loop = EngineLoop(llm) if llm is not None else None  # None: engines elsewhere
        self.app = self._build_app()

    def _build_app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = [Route("/v1/chat/completions", _guarded(self.chat), methods=["POST"]),
                  Route("/v1/completions", _guarded(self.completions), methods=["POST"]),
                  Route("/v1/models", _guarded(self.models), methods=["GET"]),
                  Route("/health", _guarded(self.health), methods=["GET"]),
                  Route("/metrics", _guarded(self.metrics), methods=["GET"])]
        return Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.loop.start()
        try:
            yield
        finally:
            self.loop.stop()
            self.pool.shutdown(wait=False, cancel_futures=True)

    # Plain endpoints ----------------------------------------------------------------------
    async def models(self, request):
        from starlette.responses import JSONResponse

        if (denied := self._auth(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": api.now(),
            "owned_by": "hybridrt", "max_model_len": self.max_model_len}]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        ok = self.loop.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine thread stopped"},
                            status_code=200 if ok else 503)

    async def metrics(self, request):
        from starlette.responses import PlainTextResponse

        if not self.metrics_public and (denied := self._auth(request)) is not None:
            return denied
        return PlainTextResponse(metrics_text(self.loop),
                                 media_type="text/plain; version=0.0.4")

    def _auth(self, request):
        """None when the request may go on, else the 401 to answer. The key is compared as
        bytes in constant time: how long the check takes tells nothing about the key."""
        if self.api_key is None:
            return None
        sent = next((v for k, v in request.scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(sent, b"Bearer " + self.api_key.encode()):
            return None
        return _error(api.ApiError(401, "invalid or missing API key (send Authorization: "
                                        "Bearer <key>)", kind="authentication_error"))

    # Generation ---------------------------------------------------------------------------
    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def _generate(self, request, chat: bool):
        if (denied := self._auth(request)) is not None:
            return denied
        big = False
        try:
            raw = await self._read_body(request)
            big = len(raw) > 1 << 20
            async with self.pool_slots:
                job = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self._parse_and_prepare, raw, chat)
        except api.ApiError as e:
            return _error(e.with_traceback(None))
        finally:
            raw = None  # hold only the job while the request runs
            if big:  # hand a large body's memory back to the system, refused or not
                self.pool.submit(_release_memory)
        handles = self._submit(job)
        if job["stream"]:
            try:
                first = await handles[0].queue.get()  # refusals still get a status code
            except asyncio.CancelledError:
                self._abort(handles)
                raise
            if first.error is not None:
                self._abort(handles)
                return _error(_as_api_error(first.error))
            from starlette.responses import StreamingResponse

            return StreamingResponse(self._events(handles, first, job, chat),
                                     media_type="text/event-stream")
        return await self._collect(request, handles, job, chat)

    def _submit(self, job: dict) -> list[Handle]:
        return submit_job(self.loop, job)

    def _abort(self, handles: list[Handle]) -> None:
        for handle in handles:
            self.loop.abort(handle)

    async def _read_body(self, request) -> bytes:
        """The body, refused with 413 as soon as it is known to pass the limit (from
        Content-Length, before reading; else while reading) and 408 if it takes longer than
        ``body_timeout`` to arrive."""
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise api.bad("Content-Length must be a number of bytes")
            if int(length) > limit:
                raise _too_large(limit)
        from starlette.requests import ClientDisconnect

        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise api.ApiError(408, f"the request body did not arrive within "
                                    f"{self.body_timeout:g} s") from None
        except ClientDisconnect:
            raise api.bad("the client closed the connection before the end of its body") from None
        return b"".join(chunks)

    def _parse_and_prepare(self, raw: bytes, chat: bool) -> dict:
        """In a pool thread: the body -> the job (``_prepare``). A refusal is raised without
        the traceback of where it was found: those frames hold the parsed body and the
        prompt's encoding, which must be freed before ``_generate`` trims the heap."""
        try:
            return self._prepare(api.parse_body(raw, self.limits.max_json_depth), chat)
        except api.ApiError as e:
            error = e.with_traceback(None)
        del raw
        raise error

    def _prepare(self, body: Any, chat: bool) -> dict:
        """Validate a request body -> prompt ids, text, params and the snapshot point."""
        api.check_common(body, self.model_name)
        api.check_limits(body, self.limits)
        params = api.sampling_params(body, self.defaults, chat)
        snapshot_at, tools, choice, parallel = None, None, "none", True
        if chat:
            if self.tokenizer is None:
                raise api.bad("this model has no tokenizer, so it has no chat template")
            messages = api.chat_messages(body)
            kwargs = api.template_kwargs(body)
            tools, choice, parallel = api.chat_tools(body)
            if tools:
                kwargs["tools"] = tools
            gen = body.get("add_generation_prompt", True)
            try:
                text = self.front.apply_chat_template(messages, kwargs, gen)
                base = self.front.apply_chat_template(messages, kwargs, False) if gen else None
            except Exception as e:
                raise api.bad(f"the chat template failed on these messages: {e}",
                              "messages") from None
            ids = self._encode(text, body, "messages")
            if base is not None:
                base_ids = self._encode(base, body, "messages")
                if 0 < len(base_ids) < len(ids) and ids[:len(base_ids)] == base_ids:
                    snapshot_at = len(base_ids)
        else:
            prompt = api.completion_prompt(body)
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise api.bad("this model has no tokenizer: send token ids", "prompt")
                text, ids = prompt, self._encode(prompt, body, "prompt")
            else:
                text, ids = None, prompt
        where, num_ids = "messages" if chat else "prompt", len(ids)
        ids, params = self._fit(ids, params, body, where)
        if len(ids) != num_ids:
            snapshot_at = None  # truncated: the rendered prefix is no longer at the start
        try:
            ids = self.front.validate_prompt(ids)
        except ValueError as e:
            raise api.bad(str(e), where) from None
        thinks = chat and text is not None and opens_thinking(text)
        if choice not in ("none", "auto"):  # required / named: the output is made calls
            if params.structured_outputs is not None:
                raise api.bad(f"tool_choice {_short_choice(choice)} makes the output tool "
                              f"calls: it cannot go with response_format or "
                              f"structured_outputs", "tool_choice")
            try:
                params = params.clone(structured_outputs=tool_constraint(
                    tools, choice, thinks, parallel))
            except ValueError as e:
                raise api.bad(str(e), "tools") from None
        opts = body.get("stream_options") or {}
        return {"ids": ids, "params": params, "prompt": text, "snapshot_at": snapshot_at,
                "thinks": thinks, "tools": tools if choice != "none" else None,
                "parallel": parallel, "id": api.new_id("chatcmpl" if chat else "cmpl"),
                "created": api.now(), "top": params.logprobs or 0,
                "stream": bool(body.get("stream")), "usage": bool(opts.get("include_usage"))}

    def _fit(self, ids: list[int], params: SamplingParams, body: dict,
             where: str) -> tuple[list[int], SamplingParams]:
        """The prompt and max_tokens within max_model_len: a prompt cut to its last
        ``truncate_prompt_tokens`` tokens (-1: as many as fit); a prompt over the token limit,
        or whose client-given max_tokens cannot fit beside it, refused; a default max_tokens
        lowered to the room left."""
        n, cap = self.max_model_len, self.limits.max_prompt_tokens
        explicit = any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens"))
        truncate = body.get("truncate_prompt_tokens")
        if truncate is not None:
            keep = truncate if truncate > 0 else n - (params.max_tokens or 1)
            ids = ids[-max(1, min(keep, cap)):]
        if len(ids) > cap:
            raise _too_many_tokens(len(ids), cap, n, where)
        room = n - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            if explicit:
                raise api.bad(f"the prompt has {len(ids)} tokens and max_tokens is "
                              f"{params.max_tokens}: together over max_model_len {n} (at most "
                              f"{room} for this prompt; or send truncate_prompt_tokens)",
                              "max_tokens")
            params = params.clone(max_tokens=max(1, room),
                                  min_tokens=min(params.min_tokens, max(1, room)))
        return ids, params

    def _encode(self, text: str, body: dict, where: str) -> list[int]:
        """The text's ids. A fast tokenizer's encoding is measured before its ids become a
        Python list: a prompt over the token limit (and not to be truncated) is refused
        without making a few hundred thousand int objects, whose memory would stay with the
        process. ``encode_batch``, not ``encode``: only the batch call releases the GIL (a
        3.5 MB prompt held it 3.1 s with ``encode``, stalling the event loop from the pool)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        (encoding,) = backend.encode_batch([text], add_special_tokens=False)
        if len(encoding) > self.limits.max_prompt_tokens and \
                body.get("truncate_prompt_tokens") is None:
            raise _too_many_tokens(len(encoding), self.limits.max_prompt_tokens,
                                   self.max_model_len, where)
        return encoding.ids

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, chat: bool, ids: list[int], entries: list[dict] | None, top: int,
                  offset: int) -> dict | None:
        if entries is None or not ids:
            return None
        if chat:
            return api.chat_logprobs(ids, entries, top, self._piece)
        return api.completion_logprobs(ids, entries, top, self._piece, offset)

    async def _collect(self, request, handles: list[Handle], job: dict, chat: bool):
        """A non-streaming answer; aborts the request if the client goes away meanwhile."""
        from starlette.responses import JSONResponse

        n = len(handles)
        ids: list[list[int]] = [[] for _ in range(n)]
        entries: list[list[dict]] = [[] for _ in range(n)]
        final: dict[int, Progress] = {}
        next_check = time.monotonic() + 0.5
        while len(final) < n:
            try:
                item = await asyncio.wait_for(handles[0].queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                item = None
            except asyncio.CancelledError:
                self._abort(handles)
                raise
            if time.monotonic() >= next_check:  # twice a second: is the client still there?
                next_check = time.monotonic() + 0.5
                if await request.is_disconnected():
                    self._abort(handles)
                    return JSONResponse({}, status_code=499)
            if item is None:
                continue
            ids[item.index] += item.new_token_ids
            entries[item.index] += item.new_logprobs or []
            if item.finish_reason is not None:
                final[item.index] = item
                if item.error is not None:
                    self._abort(handles)
                    return _error(_as_api_error(item.error))
        first = final[0]
        use = api.usage(first.num_prompt_tokens, sum(len(x) for x in ids),
                        max(f.num_reused_tokens for f in final.values()))
        choices = []
        for i in range(n):
            item = final[i]
            lps = self._logprobs(chat, ids[i],
                                 entries[i] if job["params"].logprobs is not None else None,
                                 job["top"], 0)
            choice = {"index": i, "logprobs": lps, "finish_reason": item.finish_reason}
            if chat:
                choice["message"] = self._message(item.text, job, choice)
            else:
                choice["text"] = item.text
            choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": job["id"], "object": obj, "created": job["created"],
                             "model": self.model_name, "choices": choices, "usage": use})

    @staticmethod
    def _message(text: str, job: dict, choice: dict) -> dict:
        """A finished choice's assistant message: reasoning apart, tool calls parsed (then
        finish_reason "tool_calls", as OpenAI answers)."""
        tools = job["tools"]
        reasoning, answer = split_reasoning(text, job["thinks"], tool_calls=tools is not None)
        msg = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
        if tools is not None:
            content, calls = parse_tool_calls(answer, tools)
            if not job["parallel"]:
                calls = calls[:1]
            msg["content"] = content
            msg["tool_calls"] = [c.as_openai() for c in calls]
            if calls and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        return msg

    async def _events(self, handles: list[Handle], item: Progress, job: dict, chat: bool):
        """Server-sent events of one streaming request (its n choices interleaved, each
        chunk naming its choice); closing it (a client that went away) aborts the request."""
        rid, created, model = job["id"], job["created"], self.model_name
        params: SamplingParams = job["params"]
        holdback = 0 if params.include_stop_str_in_output else max(0, params.max_stop_len - 1)
        n, tools = len(handles), job["tools"]
        splitters = [ReasoningSplitter(job["thinks"], tool_calls=tools is not None) if chat
                     else None for _ in range(n)]
        parsers = [ToolCallParser(tools) if chat and tools is not None else None
                   for _ in range(n)]
        sent, called = [0] * n, [False] * n
        num_tokens, done_count, finished = 0, 0, False
        prompt_tokens, reused = 0, 0
        try:
            if chat:
                for i in range(n):
                    yield _sse(api.chat_chunk(rid, model, created, {"role": "assistant",
                                                                     "content": ""}, index=i))
            while True:
                i = item.index
                done = item.finish_reason is not None
                if item.error is not None:
                    err = _as_api_error(item.error)
                    yield _sse(err.body())
                    break
                end = len(item.text) if done else len(item.text) - holdback
                text = item.text[sent[i]:end] if end > sent[i] else ""
                sent[i] = max(sent[i], end)
                lps = self._logprobs(chat, item.new_token_ids, item.new_logprobs, job["top"],
                                     sent[i] - len(text))
                num_tokens += len(item.new_token_ids)
                if chat:
                    pieces = splitters[i].feed(text) + (splitters[i].flush() if done else [])
                    delta = _delta(pieces, parsers[i], done)
                    if not job["parallel"] and "tool_calls" in delta:
                        delta["tool_calls"] = [d for d in delta["tool_calls"] if d["index"] == 0]
                        if not delta["tool_calls"]:
                            del delta["tool_calls"]
                    called[i] = called[i] or "tool_calls" in delta
                    if delta or lps:
                        yield _sse(api.chat_chunk(rid, model, created, delta or {"content": ""},
                                                  logprobs=lps, index=i))
                    if done:
                        reason = item.finish_reason
                        if called[i] and reason == "stop":
                            reason = "tool_calls"
                        yield _sse(api.chat_chunk(rid, model, created, {}, reason, index=i))
                elif text or lps or done:
                    yield _sse(api.completion_chunk(rid, model, created, text,
                                                    item.finish_reason if done else None, lps,
                                                    index=i))
                if done:
                    done_count += 1
                    prompt_tokens = prompt_tokens or item.num_prompt_tokens
                    reused = max(reused, item.num_reused_tokens)
                if done_count == n:
                    if job["usage"]:
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        yield _sse(api.usage_chunk(rid, model, created, obj, api.usage(
                            prompt_tokens, num_tokens, reused)))
                    break
                item = await handles[0].queue.get()
            finished = True
            yield "data: [DONE]\n\n"
        except Exception:  # a bug: end the stream with an error event, not a reset connection
            log.exception("unexpected error in a stream")
            yield _sse(_internal_error().body())
        finally:
            if not finished:
                self._abort(handles)


def _delta(pieces: list[str], parser: ToolCallParser | None = None,
           done: bool = False) -> dict:
    """A chat chunk's delta: reasoning, answer text and (with a tool-call parser) the
    calls' pieces: a call's name first, then its arguments fragment by fragment."""
    from hybridrt.reasoning import ReasoningDelta

    reasoning = "".join(p for p in pieces if isinstance(p, ReasoningDelta))
    answer = "".join(p for p in pieces if not isinstance(p, ReasoningDelta))
    calls = []
    if parser is not None:
        answer, calls = parser.feed(answer)
        if done:
            rest, more = parser.flush()
            answer, calls = answer + rest, calls + more
    delta = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if answer:
        delta["content"] = answer
    if calls:
        delta["tool_calls"] = [c.as_openai() for c in calls]
    return delta


def _short_choice(choice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice["function"]["name"])


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _guarded(handler):
    """``handler`` with every unexpected exception logged and answered by a JSON 500 that
    names nothing internal; returning it (not raising) keeps the connection open."""
    async def run(request):
        try:
            return await handler(request)
        except Exception:
            log.exception("unexpected error in %s %s", request.method, request.url.path)
            return _error(_internal_error())
    return run


def _internal_error() -> api.ApiError:
    return api.ApiError(500, "internal server error (the server's log has the details)",
                        kind="server_error")


def _too_many_tokens(num: int, cap: int, max_model_len: int, where: str) -> api.ApiError:
    return api.bad(f"the prompt has {num} tokens, over this server's limit of {cap} "
                   f"(max_model_len is {max_model_len}; --max-prompt-tokens; or send "
                   f"truncate_prompt_tokens)", where)


def _too_large(limit: int) -> api.ApiError:
    return api.too_large(f"the request body is over this server's limit of {limit} bytes "
                         f"(--max-body-bytes)")


def _release_memory() -> None:
    """Give freed heap back to the system: glibc keeps large freed blocks in the process
    otherwise (its mmap threshold grows with the largest block freed), so a refused 4 MB
    request would leave its parsed copies' pages resident."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def one_malloc_arena(environ=None) -> bool:
    """Put every thread's heap in glibc's main arena (``mallopt(M_ARENA_MAX, 1)``), unless
    MALLOC_ARENA_MAX or a ``glibc.malloc.arena_max`` tunable says otherwise; True when set.
    Call it before any thread allocates: a thread keeps the arena it first used. Why:
    ``malloc_trim`` (``_release_memory``) hands back the main arena's free top but not another
    arena's, and a parsing thread's arena keeps a free top of up to 64 MiB (glibc trims it on
    free only past a threshold it raises to twice the largest block freed) - docs/server.md."""
    import ctypes
    import ctypes.util
    import os

    environ = os.environ if environ is None else environ
    if "MALLOC_ARENA_MAX" in environ or "arena_max" in environ.get("GLIBC_TUNABLES", ""):
        return False
    with contextlib.suppress(OSError, AttributeError, TypeError):
        m_arena_max = -8  # malloc.h
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(
            m_arena_max, 1) == 1
    return False


def _as_api_error(e: Exception) -> api.ApiError:
    """A request's own error (bad input, can never fit: ValueError) is a 400; the rest 500
    (an ApiError as it is)."""
    if isinstance(e, api.ApiError):
        return e
    if isinstance(e, ValueError):
        return api.bad(str(e))
    return api.ApiError(500, str(e), kind="server_error")


def _error(e: api.ApiError):
    from starlette.responses import JSONResponse

    # 413 / 408: the body was not read whole, so this connection cannot carry another request
    close = {"connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(e.body(), status_code=e.status, headers=close)


def serve(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info", **options) -> None:
    """Run the server until interrupted; ``options``: ``Server``'s (limits, metrics_public,
    workers, body_timeout)."""
    import uvicorn

    server = Server(llm, model_name, api_key, **options)
    uvicorn.run(server.app, host=host, port=port, log_level=log_level)


def resolve_api_key(api_key: str | None, api_key_file: str | None,
                    environ=None) -> str | None:
    """The key from --api-key, else the file --api-key-file names, else HYBRIDRT_API_KEY;
    None: no key. Surrounding blanks (a file's newline) are dropped; an empty key is an
    error (it would let anyone in). ValueError for a file that cannot be read."""
    from hybridrt import env

    if api_key is None and api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                api_key = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {api_key_file}: {e}") from None
    if api_key is None:
        api_key = env.read("HYBRIDRT_API_KEY", environ) or None
    if api_key is not None:
        api_key = api_key.strip()
        if not api_key:
            raise ValueError("the API key is empty")
    return api_key

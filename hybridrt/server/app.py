"""The HTTP side of ``hybridrt serve``: the OpenAI routes, and Anthropic's Messages
(hybridrt.server.anthropic) and OpenAI's Responses (hybridrt.server.responses) translated into
chat completions, (Starlette) over an engine loop
(hybridrt.server.engine_loop), or over Ray Serve replicas (hybridrt.ray_serve overrides
``submit`` and ``abort``).

A request's body is read with a size limit (413 from Content-Length before reading, or as
soon as the bytes read pass it) and a deadline (408); parsing, validation, chat templating
and tokenizing (hybridrt.server.prepare) run in a small thread pool (``workers`` threads,
one request each at a time) so the event loop keeps answering /health and other clients
while a large request is parsed; a chat's http(s) image URLs, where the operator allows their
hosts (hybridrt.vision.fetch), are fetched on the event loop between two turns in the pool,
holding no worker. An unexpected exception in a handler is logged and answered
with a JSON 500 that names nothing internal; the connection stays usable; an unknown route
is a JSON 404. The API key (``Authorization: Bearer``, or Anthropic's ``x-api-key``) is
compared in constant time (``hmac.compare_digest``) and guards /v1/* and /metrics (unless
``metrics_public``); /health is always open. Outputs are shaped
by hybridrt.output_pipeline; streams are hybridrt.server.streaming's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from hybridrt import openai_protocol as api
from hybridrt.output_pipeline import FanIn, finish_message, finish_reason
from hybridrt.server import anthropic, responses
from hybridrt.server.engine_loop import EngineLoop, Handle, submit_job
from hybridrt.server.errors import as_api_error, internal_error, too_large
from hybridrt.server.job import Job
from hybridrt.server.metrics import metrics_text
from hybridrt.server.prepare import Frontend, MediaWait, Preparer
from hybridrt.server.process import release_memory
from hybridrt.server.streaming import events
from hybridrt.vision.fetch import MediaError, MediaPolicy

log = logging.getLogger("hybridrt.server")


class Server:
    """The OpenAI endpoints over an ``EngineLoop``. ``limits``: what one request may ask for
    (default ``openai_protocol.Limits()``); ``workers``: threads that parse and tokenize;
    ``body_timeout``: seconds a client may take to send its body; ``media``: which image URLs
    it fetches (default: none)."""

    def __init__(self, llm, model_name: str, api_key: str | None = None,
                 limits: api.Limits | None = None, metrics_public: bool = False,
                 workers: int = 2, body_timeout: float = 60.0, front: Frontend | None = None,
                 media: MediaPolicy | None = None):
        self.llm, self.model_name = llm, model_name
        self.front = front if front is not None else Frontend.of(llm)
        self.tokenizer = self.front.tokenizer
        self.api_key, self.metrics_public = api_key, metrics_public
        self.max_model_len = self.front.max_model_len
        self.limits = (limits or api.Limits()).resolved(self.max_model_len)
        self.preparer = Preparer(self.front, model_name, self.limits, media)
        self.body_timeout = body_timeout
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hybridrt-parse")
        self.pool_slots = asyncio.Semaphore(workers)  # queue in the loop, not in the pool
        self.loop = EngineLoop(llm) if llm is not None else None  # None: engines elsewhere
        self.app = self._build_app()

    def _build_app(self) -> Starlette:
        routes = [Route("/v1/chat/completions", _guarded(self.chat), methods=["POST"]),
                  Route("/v1/completions", _guarded(self.completions), methods=["POST"]),
                  Route("/v1/messages", _guarded(self.messages, anthropic.error_body),
                        methods=["POST"]),
                  Route("/v1/messages/count_tokens",
                        _guarded(self.count_tokens, anthropic.error_body), methods=["POST"]),
                  Route("/v1/responses", _guarded(self.responses), methods=["POST"]),
                  Route("/v1/models", _guarded(self.models), methods=["GET"]),
                  Route("/health", _guarded(self.health), methods=["GET"]),
                  Route("/metrics", _guarded(self.metrics), methods=["GET"])]
        return Starlette(routes=routes, lifespan=self._lifespan,
                         exception_handlers={HTTPException: _http_error})

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
        if (denied := self._auth(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": api.now(),
            "owned_by": "hybridrt", "max_model_len": self.max_model_len}]})

    async def health(self, request):
        ok = self.loop.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine thread stopped"},
                            status_code=200 if ok else 503)

    async def metrics(self, request):
        if not self.metrics_public and (denied := self._auth(request)) is not None:
            return denied
        return PlainTextResponse(metrics_text(self.loop),
                                 media_type="text/plain; version=0.0.4")

    def _auth(self, request):
        """None when the request may go on, else the 401 to answer."""
        denied = self._denied(request)
        return None if denied is None else error_response(denied)

    def _denied(self, request) -> api.ApiError | None:
        """None when the request may go on, else its 401. The key (``Authorization: Bearer``
        or ``x-api-key``) is compared as bytes in constant time: how long the check takes
        tells nothing about the key."""
        if self.api_key is None:
            return None
        headers = dict(request.scope["headers"])
        key = self.api_key.encode()
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + key)
        if hmac.compare_digest(headers.get(b"x-api-key", b""), key) | bearer:
            return None
        return api.ApiError(401, "invalid or missing API key (send Authorization: Bearer "
                                 "<key> or x-api-key: <key>)", kind="authentication_error")

    # Generation ---------------------------------------------------------------------------
    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def messages(self, request):
        return await self._generate(request, True, anthropic)

    async def responses(self, request):
        return await self._generate(request, True, responses)

    async def count_tokens(self, request):
        """Anthropic's /v1/messages/count_tokens: the prompt's tokens as /v1/messages would
        render them."""
        job = await self._prepare(request, anthropic.count_request)
        if isinstance(job, api.ApiError):
            return error_response(job, anthropic.error_body)
        return JSONResponse({"input_tokens": len(job.ids)})

    async def _prepare(self, request, translate=None, chat: bool = True):
        """The request's job (its body read and prepared in the pool), or its refusal."""
        if (denied := self._denied(request)) is not None:
            return denied
        big = False
        try:
            raw = await self._read_body(request)
            big = len(raw) > 1 << 20
            loop = asyncio.get_running_loop()
            async with self.pool_slots:
                job = await loop.run_in_executor(self.pool, self.preparer.parse, raw, chat,
                                                 translate)
            if isinstance(job, MediaWait):  # its image URLs fetched here, then back to the pool
                fetched = await self.preparer.media.fetch_all(job.urls)
                async with self.pool_slots:
                    job = await loop.run_in_executor(self.pool, self.preparer.resume, job,
                                                     fetched)
            return job
        except MediaError as e:
            return api.bad(str(e), "messages")
        except api.ApiError as e:
            return e.with_traceback(None)
        finally:
            raw = None  # hold only the job while the request runs
            if big:  # hand a large body's memory back to the system, refused or not
                self.pool.submit(release_memory)

    async def _generate(self, request, chat: bool, dialect=None):
        """A generation route; ``dialect``: the module of another API (hybridrt.server's
        anthropic, responses) with its ``translate``, ``answer``, ``events`` and
        ``error_body``."""
        def fail(e: api.ApiError) -> JSONResponse:
            return error_response(e, dialect and dialect.error_body)

        job = await self._prepare(request, dialect and dialect.translate, chat)
        if isinstance(job, api.ApiError):
            return fail(job)
        handles = self.submit(job)
        if job.stream:
            try:
                first = await handles[0].queue.get()  # refusals still get a status code
            except asyncio.CancelledError:
                self.abort(handles)
                raise
            if first.error is not None:
                self.abort(handles)
                return fail(as_api_error(first.error))
            stream = events(self, handles, first, job, chat) if dialect is None else \
                dialect.events(self, handles, first, job)
            return StreamingResponse(stream, media_type="text/event-stream")
        fan_in = await self._gather(request, handles)
        if isinstance(fan_in, api.ApiError):
            return fail(fan_in)
        if not isinstance(fan_in, FanIn):
            return fan_in  # 499: the client went away
        if dialect is not None:
            return JSONResponse(dialect.answer(self, job, fan_in))
        return self._answer(job, chat, fan_in)

    def submit(self, job: Job) -> list[Handle]:
        """The job to the engine -> its choices' handles (one shared queue)."""
        return submit_job(self.loop, job)

    def abort(self, handles: list[Handle]) -> None:
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
                raise too_large(limit)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise api.ApiError(408, f"the request body did not arrive within "
                                    f"{self.body_timeout:g} s") from None
        except ClientDisconnect:
            raise api.bad("the client closed the connection before the end of its body") from None
        return b"".join(chunks)

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, chat: bool, ids: list[int], entries: list[dict] | None, top: int,
                 offset: int) -> dict | None:
        """Some output tokens' ``logprobs`` object (chat's or completions'); None without."""
        if entries is None or not ids:
            return None
        if chat:
            return api.chat_logprobs(ids, entries, top, self._piece)
        return api.completion_logprobs(ids, entries, top, self._piece, offset)

    async def _gather(self, request, handles: list[Handle]):
        """A non-streaming request's outputs (a finished ``FanIn``), or its refusal
        (ApiError), or 499 when the client went away (the request aborted)."""
        fan_in = FanIn(len(handles))
        next_check = time.monotonic() + 0.5
        while not fan_in.done:
            try:
                item = await asyncio.wait_for(handles[0].queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                item = None
            except asyncio.CancelledError:
                self.abort(handles)
                raise
            if time.monotonic() >= next_check:  # twice a second: is the client still there?
                next_check = time.monotonic() + 0.5
                if await request.is_disconnected():
                    self.abort(handles)
                    return JSONResponse({}, status_code=499)
            if item is None:
                continue
            fan_in.add(item)
            if item.error is not None:
                self.abort(handles)
                return as_api_error(item.error)
        return fan_in

    def _answer(self, job: Job, chat: bool, fan_in: FanIn):
        """A chat or text completion's JSON answer."""
        choices = []
        for i in range(fan_in.n):
            item = fan_in.final[i]
            entries = fan_in.logprobs[i] if job.params.logprobs is not None else None
            lps = self.logprobs(chat, fan_in.token_ids[i], entries, job.top, 0)
            choice = {"index": i, "logprobs": lps, "finish_reason": item.finish_reason}
            if chat:
                choice["message"] = _message(item.text, job, choice)
            else:
                choice["text"] = item.text
            choices.append(choice)
        u = fan_in.usage
        return JSONResponse({
            "id": job.id, "object": "chat.completion" if chat else "text_completion",
            "created": job.created, "model": self.model_name, "choices": choices,
            "usage": api.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)})


def _message(text: str, job: Job, choice: dict) -> dict:
    """A finished choice's assistant message (hybridrt.output_pipeline.finish_message): with
    tools, its calls (then finish_reason "tool_calls", as OpenAI answers)."""
    m = finish_message(text, job.shape)
    msg = {"role": "assistant", "content": m.content, "reasoning_content": m.reasoning}
    if m.tool_calls is not None:
        msg["tool_calls"] = [c.as_openai() for c in m.tool_calls]
        choice["finish_reason"] = finish_reason(choice["finish_reason"], bool(m.tool_calls))
    return msg


def _guarded(handler, shape=None):
    """``handler`` with every unexpected exception logged and answered by a JSON 500 that
    names nothing internal (``shape``: its API's error body); returning it (not raising) keeps
    the connection open."""
    async def run(request):
        try:
            return await handler(request)
        except Exception:
            log.exception("unexpected error in %s %s", request.method, request.url.path)
            return error_response(internal_error(), shape)
    return run


async def _http_error(request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route: 404; a route without that method: 405) as
    OpenAI-shaped JSON errors."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    e = api.ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                     kind=kind)
    return JSONResponse(e.body(), status_code=e.status, headers=exc.headers)


def error_response(e: api.ApiError, shape=None) -> JSONResponse:
    """The JSON answer of an ``ApiError``: OpenAI's ``{"error": {...}}``, or ``shape(e)`` (an
    API's own error body)."""
    # 413 / 408: the body was not read whole, so this connection cannot carry another request
    close = {"connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(e.body() if shape is None else shape(e), status_code=e.status,
                        headers=close)


def serve(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info", **options) -> None:
    """Run the server until interrupted; ``options``: ``Server``'s (limits, metrics_public,
    workers, body_timeout, media)."""
    import uvicorn

    server = Server(llm, model_name, api_key, **options)
    uvicorn.run(server.app, host=host, port=port, log_level=log_level)

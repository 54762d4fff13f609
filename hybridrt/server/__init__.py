"""``hybridrt serve``: an OpenAI-compatible HTTP server over one engine.

Two threads. The HTTP side (``app``: Starlette on uvicorn's event loop) reads requests,
``prepare`` parses them, applies the chat template and tokenizes into a ``Job``, and progress
becomes responses or server-sent events (``streaming``), shaped by hybridrt.output_pipeline.
The engine thread (``engine_loop.EngineLoop``) owns the ``LLMEngine``: between steps it takes
new requests and aborts from a queue, runs a step when anything is unfinished, and posts each
request's progress (``Progress``) back to the event loop. A client that disconnects aborts its
request; an exception inside a step fails the requests in flight (HTTP 500) and the loop goes
on. ``metrics``: /metrics; ``process``: the malloc arena and the API key; ``errors``: the
refusals as OpenAI's JSON errors.

Prefix reuse is the engine's prefix cache (``statecache/prefix.py``): every request resumes
from the longest cached prefix of its prompt, so a client that resends the conversation with
one more turn prefills only that turn, and clients that share a system prompt share its cache
(``usage.prompt_tokens_details.cached_tokens``). Chat prompts are checkpointed before every
message, so a next turn whose template re-renders the last answer (Qwen3.5 drops old think
blocks) still reuses everything before it. Under memory pressure the cache gives way before any
running request is preempted. docs/server.md has the limits against hostile clients.

Importing this package does not import the HTTP stack: ``Server`` and ``serve`` load it when
first asked for.
"""

from hybridrt.server.engine_loop import EngineLoop, Handle, Progress, submit_job
from hybridrt.server.job import Job
from hybridrt.server.metrics import metrics_lines, metrics_text
from hybridrt.server.prepare import Frontend
from hybridrt.server.process import one_malloc_arena, release_memory, resolve_api_key

__all__ = ["EngineLoop", "Frontend", "Handle", "Job", "Progress", "Server", "metrics_lines",
           "metrics_text", "one_malloc_arena", "release_memory", "resolve_api_key", "serve",
           "submit_job"]


def __getattr__(name: str):
    if name in ("Server", "serve"):
        from hybridrt.server import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

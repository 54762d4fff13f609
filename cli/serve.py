"""``hybridrt serve``: the OpenAI-compatible server (``hybridrt.server``); ``hybridrt bench
serve``, a load test of it, is in cli/bench.py."""

from __future__ import annotations

from typing import Annotated

import typer

from hybridrt.cli.common import (
    CacheMemoryOpt,
    CliError,
    DeviceOpt,
    DtypeOpt,
    MaxModelLenOpt,
    ModelArg,
    SpecOpt,
    ThreadsOpt,
    check_device_available,
    check_model_options,
    check_port,
    resolve_model,
)

NEEDS = "needs starlette, uvicorn and httpx: pip install 'hybridrt[serve]'"


def _check_deps(what: str) -> None:
    try:
        import httpx  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise CliError(f"{what} {NEEDS}") from None


def serve(
    model: ModelArg = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every "
                                      "interface; then set --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/* (default: none).",
        show_default=False)] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The model id clients send (default: MODEL as given, or "
        "hybridrt-demo).", show_default=False)] = None,
    max_cached_prefixes: Annotated[int, typer.Option(
        "--max-cached-prefixes", min=0, help="Finished requests' prefixes kept for reuse "
        "(each holds one GDN state snapshot in the cache budget; 0: no prefix reuse).")] = 16,
    max_num_seqs: Annotated[int, typer.Option(
        "--max-num-seqs", min=1, help="Requests running at once.")] = 32,
    dtype: DtypeOpt = "auto",
    max_model_len: MaxModelLenOpt = None,
    cache_memory: CacheMemoryOpt = None,
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    speculative_tokens: SpecOpt = 0,
    log_level: Annotated[str, typer.Option(
        "--log-level", help="uvicorn's log level: critical, error, warning, info, debug.")
    ] = "info",
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics), reusing cached conversation prefixes across requests.

    The address is tried before the model loads: a port in use is one error line (exit 2).
    """
    _check_deps("hybridrt serve")
    dtype = check_model_options(dtype=dtype, max_model_len=max_model_len,
                                cache_memory=cache_memory, device=device)
    if port != 0:
        check_port(host, port)
    path = resolve_model(model)
    check_device_available(device)
    from hybridrt.llm import LLM
    from hybridrt.server import serve as run

    llm = LLM(path, dtype=dtype, max_model_len=max_model_len, cache_memory=cache_memory,
              device=device, speculative_tokens=speculative_tokens, max_num_seqs=max_num_seqs,
              threads=threads, max_num_sessions=max_cached_prefixes)
    name = served_model_name or (model if model is not None else "hybridrt-demo")
    typer.echo(f"hybridrt serve: {llm.model_path} as {name!r} on http://{host}:{port}/v1 "
               f"({llm.cache_sizing.describe()})", err=True)
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                   f"this port can use the model", err=True)
    run(llm, name, host, port, max_cached_prefixes, api_key, log_level)

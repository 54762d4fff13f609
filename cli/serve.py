"""``hybridrt serve``: the OpenAI-compatible server (``hybridrt.server``); ``hybridrt bench
serve``, a load test of it, is in cli/bench.py."""

from __future__ import annotations

from typing import Annotated

import typer

from hybridrt.cli.common import (
    BatchInvariantOpt,
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
        "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: "
        "--api-key-file, else $HYBRIDRT_API_KEY, else none; a key given here shows in ps).",
        show_default=False)] = None,
    api_key_file: Annotated[str | None, typer.Option(
        "--api-key-file", help="Read the API key from this file, surrounding blanks dropped "
        "(default: none).",
        show_default=False)] = None,
    metrics_public: Annotated[bool, typer.Option(
        "--metrics-public", help="Serve /metrics without the API key (default: behind it "
        "when there is one).")] = False,
    max_body_bytes: Annotated[int, typer.Option(
        "--max-body-bytes", min=1, help="Largest request body; larger: 413.")] = 4 << 20,
    max_prompt_chars: Annotated[int | None, typer.Option(
        "--max-prompt-chars", min=1, help="Longest prompt in characters, checked before "
        "tokenizing (default: 32 x max_model_len).", show_default=False)] = None,
    max_prompt_tokens: Annotated[int | None, typer.Option(
        "--max-prompt-tokens", min=1, help="Longest prompt in tokens (default: max_model_len "
        "- 1).", show_default=False)] = None,
    max_messages: Annotated[int, typer.Option(
        "--max-messages", min=1, help="Most messages in one chat request.")] = 512,
    max_stop: Annotated[int, typer.Option(
        "--max-stop", min=0, help="Most stop strings (and stop_token_ids) per request.")] = 16,
    max_stop_chars: Annotated[int, typer.Option(
        "--max-stop-chars", min=1, help="Longest stop string.")] = 256,
    max_json_depth: Annotated[int, typer.Option(
        "--max-json-depth", min=2, help="Deepest nesting of a request body.")] = 32,
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
    batch_invariant: BatchInvariantOpt = False,
    log_level: Annotated[str, typer.Option(
        "--log-level", help="uvicorn's log level: critical, error, warning, info, debug.")
    ] = "info",
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics), reusing cached conversation prefixes across requests.

    The address is tried before the model loads: a port in use is one error line (exit 2).
    """
    _check_deps("hybridrt serve")
    from hybridrt.openai_protocol import Limits
    from hybridrt.server import resolve_api_key

    try:
        key = resolve_api_key(api_key, api_key_file)
    except ValueError as e:
        raise CliError(str(e), 2) from None
    dtype = check_model_options(dtype=dtype, max_model_len=max_model_len,
                                cache_memory=cache_memory, device=device,
                                batch_invariant=batch_invariant)
    if port != 0:
        check_port(host, port)
    path = resolve_model(model)
    check_device_available(device)
    from hybridrt.llm import LLM
    from hybridrt.server import serve as run

    llm = LLM(path, dtype=dtype, max_model_len=max_model_len, cache_memory=cache_memory,
              device=device, speculative_tokens=speculative_tokens, max_num_seqs=max_num_seqs,
              threads=threads, max_num_sessions=max_cached_prefixes,
              batch_invariant=batch_invariant)
    name = served_model_name or (model if model is not None else "hybridrt-demo")
    typer.echo(f"hybridrt serve: {llm.model_path} as {name!r} on http://{host}:{port}/v1 "
               f"({llm.cache_sizing.describe()})", err=True)
    if key is None and host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                   f"this port can use the model", err=True)
    limits = Limits(max_body_bytes, max_prompt_chars, max_prompt_tokens, max_messages, max_stop,
                    max_stop_chars, max_json_depth)
    run(llm, name, host, port, max_cached_prefixes, key, log_level, limits=limits,
        metrics_public=metrics_public)

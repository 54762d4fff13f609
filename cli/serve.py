"""``hybridrt serve``: the OpenAI-compatible server (``hybridrt.server``); ``hybridrt bench
serve``, a load test of it, is in cli/bench.py."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from hybridrt.cli.common import (
    CliError,
    check_device_available,
    check_port,
    load_llm,
    needs_extra,
    resolve_model,
)
from hybridrt.cli.options import ModelOptions, model_options


def _check_deps(what: str) -> None:
    """The server's stack not installed -> CliError (exit 2) with the pip command."""
    try:
        import httpx  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise needs_extra(what, "starlette, uvicorn and httpx", "serve") from None


@model_options()
def serve(
    options: ModelOptions,
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
    allowed_media_domains: Annotated[str | None, typer.Option(
        "--allowed-media-domains", help="Hosts whose http(s) image URLs chat requests may "
        "give, comma-separated (e.g. example.com,localhost; exact names, redirects followed "
        "only to them) (default: none: images as data URLs only).", show_default=False)
    ] = None,
    media_max_bytes: Annotated[int, typer.Option(
        "--media-max-bytes", min=1, help="With --allowed-media-domains: the most bytes "
        "fetched for one request's image URLs together; more: 400.")] = 20 << 20,
    media_fetch_timeout: Annotated[float, typer.Option(
        "--media-fetch-timeout", min=0.001, help="With --allowed-media-domains: seconds to "
        "fetch one image URL (redirects and body included); longer: 400.")] = 10.0,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The model id clients send (default: MODEL as given, or "
        "hybridrt-demo).", show_default=False)] = None,
    log_level: Annotated[str, typer.Option(
        "--log-level", help="uvicorn's log level: critical, error, warning, info, debug.")
    ] = "info",
    replicas: Annotated[int | None, typer.Option(
        "--replicas", min=1, help="Run N engine replicas on Ray Serve behind the same routes "
        "(needs the ray extra; --threads and --device are per replica; default: one engine "
        "in this process, no Ray).", show_default=False)] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="With --replicas: an existing Ray cluster (e.g. "
        "ray://head:10001 or auto), whose nodes the replicas spread over (default: a local Ray "
        "instance on 127.0.0.1, stopped with the server).", show_default=False)] = None,
    autoscaling: Annotated[str | None, typer.Option(
        "--autoscaling", help="With --replicas: Ray Serve's autoscaling_config as JSON, e.g. "
        "'{\"min_replicas\": 1, \"max_replicas\": 4, \"target_ongoing_requests\": 8}' "
        "(default: a fixed --replicas).", show_default=False)] = None,
    router: Annotated[str, typer.Option(
        "--router", help="With --replicas: prefix (to the replica holding the longest cached "
        "prefix of the prompt) or pow2 (Ray Serve's power-of-two choice).")] = "prefix",
    router_imbalance: Annotated[int, typer.Option(
        "--router-imbalance", min=0, help="With --router prefix: a replica holding the prefix "
        "is passed over when its ongoing requests exceed the least loaded replica's by more "
        "than this.")] = 4,
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics), reusing cached conversation prefixes across requests.

    The address is tried before the model loads: a port in use is one error line (exit 2).
    With --replicas, the engines are Ray Serve replicas (docs/scale.md).
    """
    _check_deps("hybridrt serve")
    media = _media_policy(allowed_media_domains, media_max_bytes, media_fetch_timeout)
    autoscaling_config = _check_replica_options(replicas, ray_address, autoscaling, router,
                                                router_imbalance, port)
    from hybridrt.openai_protocol import Limits
    from hybridrt.server import one_malloc_arena, resolve_api_key

    one_malloc_arena()  # before any thread allocates: docs/server.md

    try:
        key = resolve_api_key(api_key, api_key_file)
    except ValueError as e:
        raise CliError(str(e), 2) from None
    options = options.checked()
    if port != 0:
        check_port(host, port)
    path = resolve_model(options.model)
    check_device_available(options.device)
    name = served_model_name or (options.model if options.model is not None
                                 else "hybridrt-demo")
    limits = Limits(max_body_bytes, max_prompt_chars, max_prompt_tokens, max_messages, max_stop,
                    max_stop_chars, max_json_depth)
    if replicas is not None:
        from hybridrt.llm import default_model
        from hybridrt.ray_serve import serve_replicas

        if key is None and host not in ("127.0.0.1", "localhost", "::1"):
            typer.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                       f"this port can use the model", err=True)
        llm_options = options.llm_kwargs()  # but threads and device: per replica
        threads, device = llm_options.pop("threads"), llm_options.pop("device")
        serve_replicas(path or default_model(), name, llm_options, host=host, port=port,
                       ray_address=ray_address, replicas=replicas,
                       autoscaling=autoscaling_config, threads=threads, device=device,
                       router=router, max_imbalance=router_imbalance,
                       server_options={"api_key": key, "limits": limits,
                                       "metrics_public": metrics_public, "media": media},
                       announce=lambda line: typer.echo(line, err=True))
        return
    from hybridrt.server import serve as run

    llm = load_llm(dataclasses.replace(options, model=path), announce=False)
    typer.echo(f"hybridrt serve: {llm.model_path} as {name!r} on http://{host}:{port}/v1 "
               f"({llm.cache_sizing.describe()})", err=True)
    if key is None and host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                   f"this port can use the model", err=True)
    run(llm, name, host, port, key, log_level, limits=limits, metrics_public=metrics_public,
        media=media)


def _media_policy(domains: str | None, max_bytes: int, timeout: float):
    """The image URLs the server fetches (hybridrt.vision.fetch.MediaPolicy); a bad host name
    -> CliError (exit 2), before anything loads."""
    from hybridrt.vision.fetch import MediaPolicy

    try:
        return MediaPolicy(domains or (), max_bytes, timeout)
    except ValueError as e:
        raise CliError(f"--allowed-media-domains: {e}", 2) from None


def _check_replica_options(replicas: int | None, ray_address: str | None,
                           autoscaling: str | None, router: str, router_imbalance: int,
                           port: int) -> dict | None:
    """The --replicas options' mistakes -> CliError (exit 2) before anything loads; -> the
    autoscaling config (None: fixed replicas)."""
    if replicas is None:
        given = [flag for flag, value in (("--ray-address", ray_address),
                                          ("--autoscaling", autoscaling),
                                          ("--router", router != "prefix" or None),
                                          ("--router-imbalance", router_imbalance != 4 or None))
                 if value is not None]
        if given:
            raise CliError(f"{', '.join(given)} go(es) with --replicas N (Ray Serve)", 2)
        return None
    if port == 0:
        raise CliError("--port 0 does not go with --replicas: Ray Serve's proxy needs the "
                       "port given", 2)
    if router not in ("prefix", "pow2"):
        raise CliError(f"--router must be prefix or pow2, got {router!r}", 2)
    config = None
    if autoscaling is not None:
        import json

        try:
            config = json.loads(autoscaling)
        except json.JSONDecodeError as e:
            raise CliError(f"--autoscaling is not JSON: {e}", 2) from None
        if not isinstance(config, dict):
            raise CliError("--autoscaling must be a JSON object (Ray Serve's "
                           "autoscaling_config)", 2)
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise needs_extra("hybridrt serve --replicas", "Ray Serve", "ray") from None
    if config is not None:
        from ray.serve.config import AutoscalingConfig

        fields = getattr(AutoscalingConfig, "model_fields", None) or {}
        unknown = sorted(set(config) - set(fields)) if fields else []
        if unknown:
            raise CliError(f"--autoscaling: {', '.join(unknown)}: not a field of Ray Serve's "
                           f"autoscaling_config (e.g. min_replicas, max_replicas, "
                           f"target_ongoing_requests)", 2)
        try:
            AutoscalingConfig(**config)
        except Exception as e:  # pydantic's ValidationError: its messages, one line
            errors = e.errors() if hasattr(e, "errors") else [{"msg": str(e)}]
            what = "; ".join(f"{'.'.join(map(str, x.get('loc', ())))} {x['msg']}".strip()
                             for x in errors)
            raise CliError(f"--autoscaling: {what}", 2) from None
    return config

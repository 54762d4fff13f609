"""What every command shares: option checks, loading the model, sampling options and defaults,
one-line errors."""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from hybridrt import env

if TYPE_CHECKING:
    from hybridrt.cli.options import ModelOptions

try:  # typer >= 0.20 vendors click; older releases use click itself
    from typer.exceptions import TyperException as _ClickException
except ImportError:  # pragma: no cover
    from click import ClickException as _ClickException


# Exit statuses: one per kind of failure, whichever command it is (main.EXIT_STATUS says them).
RUNTIME_FAILURE = 1  # the command was right but something failed while it ran
USAGE_ERROR = 2  # the command cannot run as given: a bad option or value, a MODEL not found,
# a missing extra (the message says what to pip install), a device or port this machine lacks


class CliError(Exception):
    """A user-facing failure: printed as one ``error: ...`` line, then exit ``exit_code``."""

    def __init__(self, message: str, exit_code: int = RUNTIME_FAILURE):
        super().__init__(message)
        self.exit_code = exit_code


def needs_extra(what: str, packages: str, extra: str) -> CliError:
    """The one-line error for a missing optional dependency: what needs it and the pip
    command that installs it (a usage error: exit 2)."""
    return CliError(f"{what} needs {packages}: pip install 'hybridrt[{extra}]'", USAGE_ERROR)


def error_line(message: object) -> None:
    text = " ".join(str(message).split()) or type(message).__name__
    typer.echo(f"error: {text}", err=True)


# Sampling options shared by chat / generate (typer reads them from the annotations) ----------
# Every option's help states its default: typer prints "[default: ...]" where the default is a
# value, and options whose default is decided later (None) say it in their help text.
_GEN = "default: the model's generation_config.json, else"
TemperatureOpt = Annotated[float | None, typer.Option(
    "--temperature", help=f"0 = greedy ({_GEN} 1.0).", show_default=False)]
TopPOpt = Annotated[float | None, typer.Option(
    "--top-p", help=f"Nucleus sampling mass in (0, 1] ({_GEN} 1.0: off).", show_default=False)]
TopKOpt = Annotated[int | None, typer.Option(
    "--top-k", help=f"Sample from the k likeliest tokens; 0 or -1: off ({_GEN} off).",
    show_default=False)]
MinPOpt = Annotated[float | None, typer.Option(
    "--min-p", help=f"Drop tokens below min_p x the top probability ({_GEN} 0).",
    show_default=False)]
PresenceOpt = Annotated[float | None, typer.Option(
    "--presence-penalty", help="Penalty in [-2, 2] for tokens already generated (default: 0).",
    show_default=False)]
FrequencyOpt = Annotated[float | None, typer.Option(
    "--frequency-penalty", help="Penalty in [-2, 2] per earlier occurrence of a token "
    "(default: 0).", show_default=False)]
RepetitionOpt = Annotated[float | None, typer.Option(
    "--repetition-penalty", help=f"> 1 discourages repeating prompt and output tokens "
    f"({_GEN} 1.0: off).", show_default=False)]
SeedOpt = Annotated[int | None, typer.Option(
    "--seed", help="Per-request sampling seed, for reproducible samples (default: none).",
    show_default=False)]
StopOpt = Annotated[list[str] | None, typer.Option(
    "--stop", help="Stop string; repeat for more (default: none).", show_default=False)]
ThinkOpt = Annotated[bool | None, typer.Option(
    "--think/--no-think", help="enable_thinking for the chat template (default: the "
    "template's own default).", show_default=False)]


def check_draft_vocab(draft_vocab: int | None, speculative_tokens: int) -> None:
    """--draft-vocab mistakes -> CliError (exit 2), before the model loads."""
    if draft_vocab is None:
        return
    if draft_vocab < 1:
        raise CliError(f"--draft-vocab must be a positive integer, got {draft_vocab}", 2)
    if speculative_tokens == 0:
        raise CliError("--draft-vocab is for MTP drafts: it needs -k/--speculative-tokens > 0",
                       2)


def int8_parts(flag: str, text: str) -> tuple[str, ...]:
    """A comma-separated list of weight-name parts kept at 8 bits under int4 (``hybridrt
    quantize --int8``, ``bench quality --mixed``); none named: the flag's usage error."""
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    if not parts:
        raise CliError(f"{flag}: name at least one part (e.g. self_attn,linear_attn)", 2)
    return parts


def resolve_dtype(dtype: str) -> str:
    from hybridrt.options import check_dtype_name

    try:
        return check_dtype_name(dtype)
    except ValueError as e:
        raise CliError(f"--dtype: {e}", 2) from None


def check_model_options(*, dtype: str, max_model_len: int | None, cache_memory: str | None,
                        device: str = "cpu", quantization: str | None = None,
                        batch_invariant: bool = False) -> str:
    """Option mistakes -> CliError (exit 2), before anything imports torch. -> the dtype."""
    from hybridrt.options import check_device_name, check_quantization, parse_memory

    dtype = resolve_dtype(dtype)
    try:
        if check_quantization(quantization) and device != "cpu":
            raise ValueError(f"{quantization} runs on the CPU only, not --device {device}")
    except ValueError as e:
        raise CliError(f"--quantization: {e}", 2) from None
    if max_model_len is not None and max_model_len <= 1:
        raise CliError(f"--max-model-len must be an integer > 1, got {max_model_len}", 2)
    try:
        parse_memory(cache_memory)
    except ValueError as e:
        raise CliError(f"--cache-memory: {e}", 2) from None
    try:
        check_device_name(device)
    except ValueError as e:
        raise CliError(f"--{e}", 2) from None
    return dtype


# What can be checked before the model loads ---------------------------------------------------
def resolve_model(model: str | None) -> str | None:
    """MODEL -> a checkpoint directory (None: the embedded demo model), by the loader's own
    rules (``hybridrt.model_path``), without importing torch: a wrong MODEL is one line at
    once rather than after torch has loaded. Otherwise a CliError (exit 2) naming MODEL."""
    if model is None:
        return None
    from hybridrt.model_path import ModelNotFoundError, resolve_model_path

    try:
        return str(resolve_model_path(model))
    except ModelNotFoundError as e:
        raise CliError(str(e), USAGE_ERROR) from None


def check_device_available(device: str) -> None:
    """--device cuda without a usable GPU -> CliError (exit 2): at once where the machine has
    no GPU driver at all, else after importing torch (not the model)."""
    if device == "cpu":
        return
    from hybridrt.cli import cuda_driver

    why = cuda_driver.missing_gpu_driver()
    if why is not None:
        raise CliError(f"--device {device}: CUDA is not available: {why}; use --device cpu",
                       USAGE_ERROR)
    from hybridrt.llm import check_device

    try:
        check_device(device)
    except ValueError as e:
        raise CliError(f"--device {device}: {e}", 2) from None


def check_port(host: str, port: int) -> None:
    """--host/--port that cannot be listened on (in use, not an address of this machine) ->
    CliError (exit 2), by binding a socket as the server will, before the model loads."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CliError(f"--host {host}: {e.strerror}", 2) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            why = "already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise CliError(f"cannot listen on {host}:{port}: {why}", 2) from None


def load_llm(options: ModelOptions, *, announce: bool = True):
    """Build the LLM ``options`` (cli/options.py) describe: option mistakes are CliErrors
    (exit 2) raised before the slow imports, then MODEL is resolved (torch-free) and the device
    checked, before the model loads. ``announce``: one 'loaded ...' line on stderr when it is a
    terminal. Sets ``llm.load_seconds``."""
    options = options.checked()
    model = resolve_model(options.model)
    check_device_available(options.device)
    if sys.stderr.isatty():  # within a second of start: torch, the model (and, on a new
        # machine, the kernels' compile, which says so itself) follow
        typer.echo(f"hybridrt: loading {model or 'the embedded demo model'} ...", err=True)
    from hybridrt.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model, **options.llm_kwargs())
    llm.load_seconds = time.perf_counter() - t0
    if announce and sys.stderr.isatty():
        typer.echo(f"loaded {llm.model_path} ({weights_name(llm)}, {options.device}, "
                   f"max_model_len {llm.engine.engine_config.max_model_len}) in "
                   f"{llm.load_seconds:.1f}s", err=True)
    return llm


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weights_name(llm) -> str:
    """'bfloat16', or with int8 weights 'int8 weights, bfloat16'."""
    name = dtype_name(llm.dtype)
    quantization = getattr(llm, "quantization", None)
    return f"{quantization} weights, {name}" if quantization else name


def sampling_defaults(model_path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's recommended sampling settings (generation_config.json), as vLLM uses
    them and LLM does without sampling params: explicit flags and per-request fields override
    these. Not max_new_tokens: the commands have their own --max-tokens."""
    from hybridrt.llm import generation_defaults

    defaults = generation_defaults(model_path)
    defaults.pop("max_tokens", None)
    return defaults


def sampling_overrides(max_tokens: int, **flags: Any) -> dict[str, Any]:
    """The sampling flags given (not None), checked with ``max_tokens`` as SamplingParams
    checks them: a bad value is a CliError (exit 2) before the model loads."""
    from hybridrt.sampling_params import SamplingParams

    given = {k: v for k, v in flags.items() if v is not None}
    try:
        SamplingParams(**given, max_tokens=max_tokens)
    except ValueError as e:
        raise CliError(f"invalid sampling option: {e}", USAGE_ERROR) from None
    return given


def template_kwargs(think: bool | None) -> dict[str, Any]:
    return {} if think is None else {"enable_thinking": think}


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions whose message is the whole story for the user (no traceback). hybridrt's
    own (ModelNotFoundError, CheckpointError, ConfigError) subclass these."""
    return (CliError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError,
            NotADirectoryError)


def exit_status(error: BaseException) -> int:
    """A user error's exit status: CliError's own; 2 for a MODEL that resolves to nothing
    (where a command hands MODEL to the loader itself); else 1."""
    from hybridrt.model_path import ModelNotFoundError

    if isinstance(error, CliError):
        return error.exit_code
    return USAGE_ERROR if isinstance(error, ModelNotFoundError) else RUNTIME_FAILURE


class OneLineErrorGroup(TyperGroup):
    """Click's standalone error handling, but every failure is one ``error: ...`` line on
    stderr: usage errors (exit 2), our own errors (exit_status), and unexpected ones (exit 1;
    HYBRIDRT_DEBUG=1 shows the traceback)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             windows_expand_args=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, windows_expand_args,
                                **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, windows_expand_args,
                              **extra)
        except _ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `hybridrt`: the help, exit 0
                typer.echo(e.format_message())
                sys.exit(0)
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            error_line(f"{e.format_message()}{hint}")
            sys.exit(e.exit_code)
        except typer.Abort:
            sys.exit(130)
        except KeyboardInterrupt:
            typer.echo("", err=True)
            sys.exit(130)
        except Exception as e:
            if env.debug():
                raise
            if isinstance(e, user_errors()):
                error_line(e)
                sys.exit(exit_status(e))
            error_line(f"{type(e).__name__}: {e} (HYBRIDRT_DEBUG=1 shows the traceback)")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

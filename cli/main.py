"""The ``hybridrt`` command line: ``chat``, ``generate``, ``serve``,
``bench throughput|spec|gemm|serve``, ``draft-vocab``, ``quantize``, ``trace``.

Every failure is one ``error: ...`` line on stderr and a non-zero exit code (see EXIT_STATUS);
what can be checked before the model loads (options, MODEL, --device, the server's port, the
output directory) is checked first. HYBRIDRT_DEBUG=1 shows tracebacks of unexpected errors.
Bare ``hybridrt`` prints the help and exits 0.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from hybridrt.cli.bench import bench_app
from hybridrt.cli.chat import chat
from hybridrt.cli.common import OneLineErrorGroup, error_line
from hybridrt.cli.draft_vocab import draft_vocab
from hybridrt.cli.generate import generate
from hybridrt.cli.quantize import quantize
from hybridrt.cli.serve import serve
from hybridrt.cli.trace import trace

EXIT_STATUS = ("Exit status: 0 on success; 1 when something failed while running (a prompt "
               "that failed, a broken checkpoint); 2 for a usage error (a bad option or value, "
               "a MODEL not found, a missing extra: the message says what to pip install, "
               "--device cuda without a GPU, a port in use), reported before the model loads; "
               "130 when interrupted (Ctrl-C).")

app = typer.Typer(
    name="hybridrt",
    cls=OneLineErrorGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="hybridrt: inference for hybrid Gated-DeltaNet + attention models (Qwen3.5).",
    epilog=EXIT_STATUS,
)
app.command("chat")(chat)
app.command("generate")(generate)
app.command("serve")(serve)
app.add_typer(bench_app, name="bench")
app.command("draft-vocab")(draft_vocab)
app.command("quantize")(quantize)
app.command("trace")(trace)


def _print_version(value: bool) -> None:
    if value:
        from hybridrt import __version__

        typer.echo(f"hybridrt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", help="Print the version and exit.", is_eager=True,
        callback=_print_version)] = False,
) -> None:
    """hybridrt: inference for hybrid Gated-DeltaNet + attention models (Qwen3.5)."""


def shadowing_folder() -> str | None:
    """A folder named ``hybridrt`` without an ``__init__.py`` (in the current directory, for
    ``python -m hybridrt``) that Python imported as ``hybridrt`` instead of this package: with
    an editable install the subpackages still resolve, so the commands would start and then
    fail on the first name hybridrt's ``__init__`` defines. -> its path, else None."""
    import hybridrt

    if getattr(hybridrt, "__file__", None) is not None:
        return None
    return next(iter(getattr(hybridrt, "__path__", [])), "hybridrt")


def main() -> None:
    folder = shadowing_folder()
    if folder is not None:
        error_line(f"the folder {folder} hides the hybridrt package (Python imports it as "
                   f"'hybridrt'): run from another directory, or use the hybridrt command")
        sys.exit(1)
    app(prog_name="hybridrt")


if __name__ == "__main__":
    main()

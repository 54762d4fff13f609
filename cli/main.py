"""The ``hybridrt`` command line: ``chat``, ``generate``, ``serve``,
``bench throughput|spec|gemm|serve``, ``draft-vocab``, ``quantize``.

Every failure is one ``error: ...`` line on stderr and a non-zero exit code (2 for bad
options, 1 otherwise); HYBRIDRT_DEBUG=1 shows tracebacks of unexpected errors. Bare
``hybridrt`` prints the help and exits 0.
"""

from __future__ import annotations

from typing import Annotated

import typer

from hybridrt.cli.bench import bench_app
from hybridrt.cli.chat import chat
from hybridrt.cli.common import OneLineErrorGroup
from hybridrt.cli.draft_vocab import draft_vocab
from hybridrt.cli.generate import generate
from hybridrt.cli.quantize import quantize
from hybridrt.cli.serve import serve

app = typer.Typer(
    name="hybridrt",
    cls=OneLineErrorGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="hybridrt: inference for hybrid Gated-DeltaNet + attention models (Qwen3.5).",
)
app.command("chat")(chat)
app.command("generate")(generate)
app.command("serve")(serve)
app.add_typer(bench_app, name="bench")
app.command("draft-vocab")(draft_vocab)
app.command("quantize")(quantize)


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


def main() -> None:
    app(prog_name="hybridrt")


if __name__ == "__main__":
    main()

"""The ``hybridrt`` command line: ``chat``, ``generate``, ``bench throughput|spec|gemm``.

Every failure is one ``error: ...`` line on stderr and a non-zero exit code (2 for bad
options, 1 otherwise); HYBRIDRT_DEBUG=1 shows tracebacks of unexpected errors.
"""

from __future__ import annotations

import typer

from hybridrt.cli.bench import bench_app
from hybridrt.cli.chat import chat
from hybridrt.cli.common import OneLineErrorGroup
from hybridrt.cli.generate import generate

app = typer.Typer(
    name="hybridrt",
    cls=OneLineErrorGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="hybridrt: inference for hybrid Gated-DeltaNet + attention models (Qwen3.5).",
)
app.command("chat")(chat)
app.command("generate")(generate)
app.add_typer(bench_app, name="bench")


def main() -> None:
    app(prog_name="hybridrt")


if __name__ == "__main__":
    main()

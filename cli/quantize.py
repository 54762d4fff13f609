"""``hybridrt quantize IN OUT``: a checkpoint with its weights stored in int8."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridrt.cli.common import CliError, resolve_model


def quantize(
    model: Annotated[str, typer.Argument(metavar="IN", help="Checkpoint dir or hub id.")],
    out: Annotated[Path, typer.Argument(
        metavar="OUT", help="New (or empty) directory to write.")],
) -> None:
    """Write IN with its weights quantized to int8 (as --quantization int8 does at load time)
    into OUT, with IN's config and tokenizer files.

    OUT loads like any checkpoint (chat, generate, serve, LLM(OUT)) and runs int8 without
    quantizing at start-up; it computes exactly what --quantization int8 computes on IN.
    """
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CliError(f"{out} exists and is not an empty directory", 2)
    path = resolve_model(model)
    from hybridrt.loader import save_quantized

    try:
        info = save_quantized(path, out)
    except FileExistsError as e:
        raise CliError(str(e), 2) from None
    typer.echo(f"wrote {info['path']}: {info['tensors']} tensors, "
               f"{info['bytes'] / 2**30:.2f} GiB", err=True)

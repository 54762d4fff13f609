"""``hybridrt quantize IN OUT``: a checkpoint with its weights stored in int8 or 4 bits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridrt.cli.common import CliError, int8_parts, resolve_model


def quantize(
    model: Annotated[str, typer.Argument(metavar="IN", help="Checkpoint dir or hub id.")],
    out: Annotated[Path, typer.Argument(
        metavar="OUT", help="New (or empty) directory to write.")],
    quantization: Annotated[str, typer.Option(
        "--quantization", help="int8 or int4 (4-bit weights; the embedding / LM head in "
        "6 bits).")] = "int8",
    int8: Annotated[str | None, typer.Option(
        "--int8", metavar="PARTS", help="Under int4, keep at 8 bits the weights whose names "
        "hold one of these comma-separated parts, e.g. self_attn,linear_attn,shared_expert "
        "(as llama-quantize's --tensor-type keeps some at Q8_0; docs/moe.md measures it) "
        "(default: none).", show_default=False)] = None,
) -> None:
    """Write IN with its weights quantized (as --quantization int8 or int4 does at load time)
    into OUT, with IN's config and tokenizer files.

    IN is read one shard at a time (memory: about one shard's output). A GGUF file keeps each
    weight's own type, re-laid into hybridrt's formats (config and tokenizer files written from
    its metadata). OUT loads like any
    checkpoint (chat, generate, serve, LLM(OUT)) and runs quantized without
    quantizing at start-up; it computes exactly what --quantization computes on IN.
    """
    from hybridrt.options import check_quantization

    try:
        if check_quantization(quantization) is None:
            raise ValueError("choose int8 or int4")
    except ValueError as e:
        raise CliError(f"--quantization: {e}", 2) from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CliError(f"{out} exists and is not an empty directory", 2)
    parts = int8_parts("--int8", int8) if int8 is not None else ()
    if parts and check_quantization(quantization) != "int4":
        raise CliError("--int8 applies under --quantization int4", 2)
    path = resolve_model(model)
    if parts and Path(path).is_file():
        raise CliError("--int8: a GGUF file keeps each weight's own type", 2)
    from hybridrt.loader import Int8PartsError, save_quantized
    from hybridrt.quantize_stream import quantize_streaming

    try:
        if Path(path).is_file():  # a GGUF file: loaded once (memory-mapped), its types kept
            info = save_quantized(path, out, quantization)
        else:
            info = quantize_streaming(path, out, quantization, int8_parts=parts)
    except FileExistsError as e:
        raise CliError(str(e), 2) from None
    except Int8PartsError as e:
        raise CliError(f"--int8: {e}", 2) from None
    typer.echo(f"wrote {info['path']}: {info['tensors']} tensors, "
               f"{info['bytes'] / 2**30:.2f} GiB", err=True)

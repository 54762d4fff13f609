"""``hybridrt draft-vocab MODEL CORPUS``: the token-frequency table of reduced draft heads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridrt.cli.common import CliError, resolve_model


def draft_vocab(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="Checkpoint dir or hub id.")],
    corpus: Annotated[list[Path], typer.Argument(
        metavar="CORPUS...", help="Text files to count tokens in.")],
    size: Annotated[int | None, typer.Option(
        "--size", min=1, help="Keep the N most frequent ids (default: every id of the "
        "vocabulary, unseen ones last).", show_default=False)] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Where to write (default: MODEL/draft_vocab.json, where "
        "--draft-vocab / draft_vocab_size read it).", show_default=False)] = None,
) -> None:
    """Count the model's tokens in a corpus and write them most frequent first.

    With the table in the model directory, --draft-vocab N (chat, generate; bench spec
    --draft-vocabs N,...) and LLM(draft_vocab_size=N) draft from its first N ids.
    """
    path = Path(resolve_model(model))
    from hybridrt.loader import load_config
    from hybridrt.specdec.draft_vocab import (
        DRAFT_VOCAB_FILE,
        count_tokens,
        rank_tokens,
        write_draft_vocab,
    )

    vocab_size = load_config(path).vocab_size
    if size is not None and size > vocab_size:
        raise CliError(f"--size {size} is larger than the model's vocab_size {vocab_size}", 2)
    tokenizer = _tokenizer(path)
    texts = []
    for f in corpus:
        try:
            texts.append(f.read_text(errors="replace"))
        except OSError as e:
            raise CliError(f"{f}: {e.strerror or e}") from None
    counts = count_tokens(tokenizer(lines) for text in texts
                          for lines in _batches(text.splitlines(keepends=True)))
    if not counts:
        raise CliError("the corpus has no tokens")
    ids = rank_tokens(counts, vocab_size)[:size]
    out = output or path / DRAFT_VOCAB_FILE
    names = ", ".join(f.name for f in corpus)
    write_draft_vocab(out, ids, f"{sum(counts.values())} tokens of {names}")
    typer.echo(f"wrote {out}: {len(ids)} ids, {len(counts)} of {vocab_size} seen in "
               f"{sum(counts.values())} tokens", err=True)


def _tokenizer(path: Path):
    """-> a function from a list of lines to their token ids, all in one list."""
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return lambda lines: [t for e in tok.encode_batch(lines, add_special_tokens=False)
                              for t in e.ids]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise CliError(f"{path} has no tokenizer to count the corpus with ({e})") from None
    return lambda lines: [t for line in lines for t in tok.encode(line, add_special_tokens=False)]


def _batches(lines: list[str], n: int = 1024):
    for i in range(0, len(lines), n):
        yield lines[i:i + n]

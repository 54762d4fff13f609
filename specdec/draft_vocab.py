"""Reduced draft vocabularies: the MTP head drafts from the N most frequent tokens only.

A frequency table is ``draft_vocab.json`` in the model directory: ``{"token_ids": [...],
"source": "..."}`` with token ids most frequent first (``hybridrt draft-vocab MODEL CORPUS``
writes one from a text corpus). ``draft_vocab_size=N`` takes its first N ids; a model directory
without a table falls back to the first N ids of the vocabulary (for a byte-level BPE, the
bytes and the earliest merges) and says so in the returned source.

Verification always scores the full vocabulary, so drafting from a subset changes only how
many drafts are accepted, never the output: the draft distribution q is zero outside the
subset, and rejection sampling's residual max(p - q, 0) covers those tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from hybridrt.engine_args import check_int

DRAFT_VOCAB_FILE = "draft_vocab.json"
# adaptive k's probe head (specdec.proposer): the most frequent ids, where they are at most a
# quarter of the vocabulary (Qwen3.5's 248k: an eighth of the full head's rows, in int8)
PROBE_VOCAB = 32768


def draft_vocabs(model_dir: str | Path, vocab_size: int, n: int | None, args
                 ) -> tuple[list[int] | None, str | None, list[int] | None]:
    """-> (the draft vocabulary of ``draft_vocab_size`` ``n`` and where it came from, both None
    without one; the probe head's ids, None unless adaptive k drafts MTP drafts through the
    full head of a vocabulary of at least 4 x ``PROBE_VOCAB`` ids). ``args``: resolved
    ``EngineArgs``."""
    if n is not None:
        return (*load_draft_vocab(model_dir, vocab_size, n), None)
    if (args.speculative_tokens and args.speculative_adaptive and "mtp" in
            args.speculative_method.split("+") and vocab_size >= 4 * PROBE_VOCAB):
        return None, None, load_draft_vocab(model_dir, vocab_size, PROBE_VOCAB, at_most=True)[0]
    return None, None, None


def load_draft_vocab(model_dir: str | Path, vocab_size: int, n: int,
                     at_most: bool = False) -> tuple[list[int], str]:
    """-> (the N token ids to draft from, where they came from). Reads
    ``model_dir/draft_vocab.json`` when there is one, else the first N ids. ``at_most``: a
    table of fewer ids gives them all (else that is an error)."""
    check_int("draft_vocab_size", n, lo=1, hi=vocab_size, hint=" (the model's vocab_size)")
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return list(range(n)), f"the first {n} token ids (no {DRAFT_VOCAB_FILE} in {model_dir})"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    ids = raw.get("token_ids") if isinstance(raw, dict) else raw
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
    ):
        raise ValueError(f"{path}: token_ids must be a list of token ids in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: token_ids has repeated ids")
    if len(ids) < n and not at_most:
        raise ValueError(f"draft_vocab_size {n} is larger than the {len(ids)} ids of {path}")
    return ids[:n], f"the {n} most frequent tokens of {path}"


def rank_tokens(counts: Counter, vocab_size: int) -> list[int]:
    """Every id of the vocabulary, most frequent first (ties and unseen ids by id)."""
    seen = sorted((t for t in counts if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))
    rest = sorted(set(range(vocab_size)) - set(seen))
    return seen + rest


def count_tokens(token_lists: Iterable[list[int]]) -> Counter:
    counts: Counter = Counter()
    for ids in token_lists:
        counts.update(ids)
    return counts


def write_draft_vocab(path: str | Path, token_ids: list[int], source: str) -> None:
    Path(path).write_text(json.dumps({"source": source, "token_ids": token_ids}))

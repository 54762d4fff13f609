"""Invariants the source documents state, checked on a recorded trace (``TraceRecorder.steps``
or the records of a ``--jsonl`` file).

- **positions**: a request's positions in a step are C..C+T-1 (every row), C being where its
  previous step left it (its cached tokens at an admission): across prompt chunks, decodes and
  verifications. With images, its M-RoPE rows (``mrope``): a text token's three rows are
  equal, and every token after the prompt sits at its index plus the request's rope delta.
- **isolation**: in a step, no KV block or GDN state slot one request writes is read or written
  by another; a request reads only KV blocks it wrote since its admission or took from its
  prefix-cache hit, and never writes a block the hit shares.
- **prefix_hit**: an admitted request's first computed position equals its ``cached_tokens``,
  the ``num_tokens`` of the checkpoint it resumed from.
- **draft_rollback**: after a verification with a accepted drafts, the GDN slot kept is the one
  written after draft a, and the request's next step reads it.

``check_trace(records) -> list[Violation]`` (empty: every invariant holds).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

INVARIANTS = ("positions", "isolation", "prefix_hit", "draft_rollback")


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    step: int
    request: str
    message: str

    def __str__(self) -> str:
        return f"step {self.step}, request {self.request}: {self.invariant}: {self.message}"


def check_trace(records: Iterable[dict]) -> list[Violation]:
    """Every violation of ``INVARIANTS`` in a trace's step records, in step order (a header
    record, as a JSON-lines trace starts with, is skipped)."""
    out: list[Violation] = []
    expect: dict[str, int] = {}  # request -> the position its next step starts at
    owned: dict[str, set[int]] = {}  # request -> blocks it may read (written / shared by a hit)
    shared: dict[str, set[int]] = {}  # request -> blocks its prefix-cache hit shares
    restored: dict[str, int] = {}  # request -> the GDN slot its next step must read
    for rec in records:
        if "seqs" not in rec:
            continue
        step = rec["step"]
        for seq in rec["seqs"]:
            rid = seq["request"]

            def bad(invariant: str, message: str, rid=rid, step=step) -> None:
                out.append(Violation(invariant, step, rid, message))

            cache = seq["cache"]
            if cache["admitted"]:
                expect.pop(rid, None)
                restored.pop(rid, None)
                owned[rid], shared[rid] = set(), set()
                _check_prefix(seq, bad, owned[rid], shared[rid])
            _check_positions(seq, expect.get(rid), bad)
            _check_reads(seq, owned.setdefault(rid, set()), shared.get(rid, set()), bad)
            _check_rollback(seq, restored, bad)
            progress = seq.get("progress")
            if progress is not None:
                expect[rid] = seq["positions"]["start"] + progress["settled"]
            if seq["decoding"].get("finish_reason") is not None:
                expect.pop(rid, None)
                restored.pop(rid, None)
        _check_step_isolation(rec, out)
    return out


def _rows(positions) -> list[list[int]]:
    """One list per position row (three with M-RoPE, one for text)."""
    return positions if positions and isinstance(positions[0], list) else [positions]


def _check_positions(seq: dict, expected: int | None, bad) -> None:
    pos = seq["positions"]
    start = pos["start"]
    if expected is not None and start != expected:
        bad("positions", f"starts at position {start}, but its previous step left it at "
                         f"{expected}")
    n = len(seq["hidden"]["token_ids"])
    for r, row in enumerate(_rows(pos["positions"])):
        want = [start + i for i in range(n)]
        if row != want:
            bad("positions", f"row {r} has positions {_short(row)}, not "
                             f"{want[0] if want else start}..{want[-1] if want else start - 1}")
    mrope = pos.get("mrope")
    if mrope is not None:
        _check_mrope(mrope, start, pos.get("rope_delta", 0), bad)


def _check_mrope(mrope: dict, start: int, delta: int, bad) -> None:
    """The M-RoPE rows of a request with images (``mrope``: ``rows`` [3][T], ``image_tokens``
    (indices in the step), ``prompt_len``)."""
    rows, images = mrope["rows"], set(mrope["image_tokens"])
    for i, (t, h, w) in enumerate(zip(*rows)):
        if i not in images and not t == h == w:
            bad("positions", f"text token at {start + i} has M-RoPE rows {t}, {h}, {w}, not "
                             f"three equal ones")
        if start + i >= mrope["prompt_len"] and t != start + i + delta:
            bad("positions", f"token {start + i} after the prompt is at M-RoPE position {t}, "
                             f"not {start + i} + rope delta {delta}")


def _check_prefix(seq: dict, bad, owned: set[int], shared: set[int]) -> None:
    prefix = seq["cache"].get("prefix") or {}
    cached = prefix.get("cached_tokens", 0)
    first = seq["positions"]["start"]
    if first != cached:
        bad("prefix_hit", f"first computed position {first} != num_cached_tokens {cached}")
    ck = prefix.get("checkpoint")
    if ck is not None:
        if ck["num_tokens"] != cached:
            bad("prefix_hit", f"resumed from a checkpoint after {ck['num_tokens']} tokens but "
                              f"num_cached_tokens is {cached}")
        owned.update(ck["shared_blocks"])
        shared.update(ck["shared_blocks"])
        if ck.get("tail_block") is not None:
            owned.add(ck["tail_block"])


def _check_reads(seq: dict, owned: set[int], shared: set[int], bad) -> None:
    cache = seq["cache"]
    written = set(cache["kv_written"])
    if written & shared:
        bad("isolation", f"writes KV block(s) {sorted(written & shared)} it shares read-only "
                         f"from the prefix cache")
    owned.update(written)
    foreign = [b for b in cache["kv_read"] if b not in owned]
    if foreign:
        bad("isolation", f"reads KV block(s) {foreign} it neither wrote nor took from its "
                         f"prefix-cache hit")


def _check_rollback(seq: dict, restored: dict[str, int], bad) -> None:
    rid = seq["request"]
    gdn = seq["cache"]["gdn"]
    want = restored.pop(rid, None)
    if want is not None and gdn["read"] != want:
        bad("draft_rollback", f"reads GDN slot {gdn['read']}, but its last verification "
                              f"kept slot {want}")
    accepted = seq["decoding"].get("accepted")
    if accepted is None or gdn.get("restored") is None:
        return
    if gdn["restored"] != gdn["written"][accepted]:
        bad("draft_rollback", f"{accepted} draft(s) accepted: the state after them is in slot "
                              f"{gdn['written'][accepted]}, but slot {gdn['restored']} was kept")
    restored[rid] = gdn["restored"]


def _check_step_isolation(rec: dict, out: list[Violation]) -> None:
    seqs = rec["seqs"]
    for a in seqs:
        wa = set(a["cache"]["kv_written"])
        sa = set(a["cache"]["gdn"]["written"])
        for b in seqs:
            if a is b:
                continue
            touched = (wa & set(b["cache"]["kv_read"])) | (wa & set(b["cache"]["kv_written"]))
            if touched:
                out.append(Violation("isolation", rec["step"], b["request"],
                                     f"its queries see KV block(s) {sorted(touched)} that "
                                     f"request {a['request']} writes in the same step"))
            gb = set(b["cache"]["gdn"]["written"]) | {b["cache"]["gdn"]["read"]}
            if sa & gb:
                out.append(Violation("isolation", rec["step"], b["request"],
                                     f"uses GDN state slot(s) {sorted(sa & gb)} that request "
                                     f"{a['request']} writes in the same step"))


def _short(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 8 else f"[{xs[0]}, {xs[1]}, ..., {xs[-1]}] ({len(xs)})"

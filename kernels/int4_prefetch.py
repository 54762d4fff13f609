"""How the one-row 4-bit and 6-bit products prefetch their weight stream (csrc/int4_gemm.c,
``int4_set_one_row_nta``): 2 KiB ahead with the non-temporal hint ("nta"), or 8 KiB ahead into
L2 as the few-row tiles do ("l2"). The results are the same bits either way; the speed is not,
and which is faster depends on the CPU's caches: on one Xeon the hint made a batch-1 decode step
0.88x the time, on another the 6-bit LM head took 2.2x its time with it (docs/performance.md,
"One-row prefetch"). ``"auto"`` (the default) measures it on the model: the first one-row
product over a weight of at least ``CALIBRATE_BYTES`` (the LM head) runs twice each way,
alternated, and the faster stays for every one-row product after it."""

from __future__ import annotations

import time
from collections.abc import Callable

from . import native

MODES = ("auto", "nta", "l2")
CALIBRATE_BYTES = 64 << 20  # a weight this large streams from beyond the L2s
ROUNDS = 2  # timed calls per mode when choosing

_mode = "auto"
_chosen: str | None = None  # the mode in use, once chosen (None: "auto", not measured yet)
times: dict[str, float] = {}  # the seconds each mode took when "auto" chose


def configure(mode: str | None) -> None:
    """Set the mode (None: "auto", which measures again at the next large one-row product)."""
    global _mode, _chosen
    mode = mode or "auto"
    if mode not in MODES:
        raise ValueError(f"int4 one-row prefetch: choose one of {', '.join(MODES)}, got {mode!r}")
    _mode, _chosen = mode, None if mode == "auto" else mode
    times.clear()
    _set("nta" if _chosen is None else _chosen)  # "auto" until measured: the hint


def chosen() -> str | None:
    """The mode the one-row products use ("nta" or "l2"), or None while "auto" has not measured."""
    return _chosen


def before_product(run: Callable[[], object], nbytes: int, rows: int) -> None:
    """Called before a product of ``rows`` rows over a weight of ``nbytes``, which ``run``
    computes: where the choice is open and the product is a large one-row one, time ``run``
    ``ROUNDS`` times in each mode, alternated, and keep the faster."""
    global _chosen
    if _chosen is not None or rows != 1 or nbytes < CALIBRATE_BYTES:
        return
    spent = {"nta": 0.0, "l2": 0.0}
    for _ in range(ROUNDS):
        for mode in spent:
            _set(mode)
            t = time.perf_counter()
            run()
            spent[mode] += time.perf_counter() - t
    _chosen = min(spent, key=spent.get)
    times.update(spent)
    _set(_chosen)


def _set(mode: str) -> None:
    lib = native.load()
    if lib is not None:
        lib.int4_set_one_row_nta(int(mode == "nta"))

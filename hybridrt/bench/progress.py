"""The progress bar of a benchmark that runs longer than a few seconds: a tqdm over its steps
(loading, warm-up and each measured run), on stderr, opened before the first step so that the
first output comes at once; stdout keeps the table and the ``--json`` report is a file. As any
tqdm bar it is drawn whether or not stderr is a terminal (on a pipe as carriage-return
updates), and ``TQDM_DISABLE=1`` hides it."""

from __future__ import annotations

import sys


def bar(desc: str, total: int, unit: str = "step", enabled: bool = True):
    """A bar of ``total`` steps named ``desc`` (the benchmark's command name); ``enabled``
    False: a silent one (a benchmark called with ``verbose=False``)."""
    from tqdm import tqdm

    off = {} if enabled else {"disable": True}  # not passed otherwise: TQDM_DISABLE decides
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=0.5,
                dynamic_ncols=True, **off)


def step(b, label: str) -> None:
    """Name what ``b`` is doing now (shown beside the count)."""
    b.set_postfix_str(label, refresh=True)


def silent():
    """A bar that draws nothing: the default of a function that takes a caller's bar."""
    return bar("", 0, enabled=False)

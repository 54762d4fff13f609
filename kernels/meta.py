"""Where a step's index metadata lives: persistent buffers sized at start-up, or fresh tensors.

The runner's batch (token ids, positions, KV slots, block tables, ...) and the backend's plans
(decode rows, chunk groups, conv rows, state slots, ...) are small integer arrays rebuilt every
step from host lists. ``StepBuffers`` holds them all in two flat host arrays (int64 and bool)
allocated once, when the engine starts, for its ``max_num_seqs`` / ``max_num_batched_tokens`` /
context length: each step starts over at offset 0 (``begin``) and hands out views, so a step
allocates no index tensors. ``FreshArrays`` allocates new arrays instead (one-off batches:
tests, the MTP drafter, a device other than the CPU, whose kernels run asynchronously and would
read a host buffer the next step is already rewriting). Both are ``StepArrays``, the interface
the plans are written against.

Both are filled through numpy views (``longs``, ``bools``, ``put``) and turned into torch
tensors by ``tensor`` (a view of the same memory on the CPU). A step larger than the buffers
(not possible within the engine's limits; ``capacity`` says why) falls back to fresh arrays and
counts it in ``overflows``.
"""

from __future__ import annotations

import numpy as np
import torch


def capacity(max_seqs: int, max_tokens: int, max_blocks: int, conv_kernel: int = 4,
             chunk: int = 64) -> tuple[int, int]:
    """(int64, bool) entries one step can need with at most ``max_seqs`` sequences of
    ``max_tokens`` tokens in all, each with at most ``max_blocks`` KV blocks.

    int64, 7 per token: input ids, positions, KV slots, logits rows, the token's row in its GDN
    part, then either its verify slot (recurrent tokens) or its conv output row and chunk-group
    row (prompt tokens); per sequence: the block table, ``chunk`` - 1 rows of chunk padding,
    K - 1 conv state rows, and 8 more (cu_seqlens twice, sequence length, state slot three
    times, attention rows twice). bool, per token: the logits-row mask; per sequence: three
    initial-state flags (batch, prompt chunks, chunk groups)."""
    longs = 7 * max_tokens + max_seqs * (max_blocks + chunk + conv_kernel + 6) + 16
    bools = max_tokens + 3 * max_seqs + 16
    return longs, bools


class StepArrays:
    """Where a step's index arrays come from: ``longs`` / ``bools`` hand out int64 / bool
    arrays, ``put`` fills one from values, ``tensor`` turns one into a tensor on ``device``."""

    overflows = 0

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def begin(self) -> None:
        """Start a step."""

    def longs(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def bools(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def put(self, values, dtype=np.int64) -> np.ndarray:
        """``values`` (a list, nested lists of equal length, or an array) as an array."""
        a = np.asarray(values, dtype=dtype)
        out = self.bools(a.size) if dtype == np.bool_ else self.longs(a.size)
        out[:] = a.reshape(-1)
        return out.reshape(a.shape)

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else to_device(t, self.device)


class FreshArrays(StepArrays):
    """New numpy arrays for every request; ``tensor`` copies them to ``device``."""

    def longs(self, n: int) -> np.ndarray:
        return np.empty(n, dtype=np.int64)

    def bools(self, n: int) -> np.ndarray:
        return np.empty(n, dtype=np.bool_)


class StepBuffers(StepArrays):
    """Two flat host arrays, allocated once, handed out in slices for one step at a time."""

    def __init__(self, num_longs: int, num_bools: int):
        super().__init__("cpu")
        self._long = np.empty(num_longs, dtype=np.int64)
        self._bool = np.empty(num_bools, dtype=np.bool_)
        self._used = [0, 0]
        self.overflows = 0

    @classmethod
    def for_limits(cls, max_seqs: int, max_tokens: int, max_blocks: int,
                   conv_kernel: int = 4) -> StepBuffers:
        return cls(*capacity(max_seqs, max_tokens, max_blocks, conv_kernel))

    def begin(self) -> None:
        """Start a step: the previous step's views are given out again."""
        self._used = [0, 0]

    def _take(self, which: int, buf: np.ndarray, n: int) -> np.ndarray:
        start = self._used[which]
        if start + n > buf.size:
            self.overflows += 1
            return np.empty(n, dtype=buf.dtype)
        self._used[which] = start + n
        return buf[start:start + n]

    def longs(self, n: int) -> np.ndarray:
        return self._take(0, self._long, n)

    def bools(self, n: int) -> np.ndarray:
        return self._take(1, self._bool, n)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory lies inside these buffers (an empty tensor has none)."""
        if t.numel() == 0:
            return True
        p = t.data_ptr()
        return any(b.ctypes.data <= p < b.ctypes.data + b.nbytes for b in (self._long, self._bool))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: on CUDA through a pinned
    copy and an asynchronous transfer (a plain ``.to`` from pageable memory synchronises with
    the stream, so the host would wait for the work already queued, e.g. a step in flight)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def as_arrays(arrays_or_device) -> StepArrays:
    """``StepArrays`` (a ``FreshArrays``/``StepBuffers``, returned as is), or new arrays for a
    device."""
    if isinstance(arrays_or_device, StepArrays):
        return arrays_or_device
    return FreshArrays(arrays_or_device)

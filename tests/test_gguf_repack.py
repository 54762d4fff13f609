"""The GGUF block re-packing without llama.cpp: random blocks of each type csrc/gguf_repack.c
takes (signs of the scales mixed, rows past the last panel, rows and column groups reordered)
give the same bytes from the compiled pass as from the torch path, and the values ``gguf``'s
numpy dequantization gives, within each mapping's error."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from hybridrt.gguf import loader, names, repack
from hybridrt.kernels import native

LAYOUT = {"Q8_0": (34, 32, {"d": 0}), "Q4_0": (18, 32, {"d": 0}),
          "Q4_1": (20, 32, {"d": 0, "m": 2}), "Q4_K": (144, 256, {"d": 0, "m": 2}),
          "Q6_K": (210, 256, {"d": 208})}  # block bytes, values, fp16 fields' offsets
BOUND = {"Q8_0": 0.0, "Q4_0": 6e-3, "Q4_1": 6e-3, "Q4_K": 6e-3, "Q6_K": 2e-2}


def random_tensor(kind: str, N: int, K: int, seed: int = 0):
    nbytes, block, fields = LAYOUT[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (N, K // block, nbytes), dtype=np.uint8)
    for field, at in fields.items():
        v = rng.uniform(0.02, 0.05, b.shape[:2]) * (rng.choice([-1, 1], b.shape[:2])
                                                   if field == "d" else 1)
        if kind == "Q4_1" and field == "m":
            v = -v  # W = d q + m: a minimum of -m >= 0
        b[..., at:at + 2] = v.astype(np.float16)[..., None].view(np.uint8)
    if kind == "Q8_0":
        q = b[..., 2:]
        q[q == 0x80] = 0x81  # -128, which llama.cpp never writes
    return SimpleNamespace(tensor_type=GGMLQuantizationType[kind], data=b.reshape(N, -1),
                           shape=(K, N))  # GGUF's order: innermost first


def torch_path(t, shape, src):
    real = repack.packed
    repack.packed = lambda *a: None
    try:
        assert tuple(reversed(t.shape)) == shape
        return loader._packed([t], src)
    finally:
        repack.packed = real


@pytest.mark.parametrize("kind", list(LAYOUT))
def test_compiled_and_torch_paths_give_the_same_bytes(kind):
    if native.load() is None:
        pytest.skip("no compiled kernels")
    N, K = 40, 512
    t = random_tensor(kind, N, K)
    g = K // 32
    cols = (torch.randperm(g, generator=torch.Generator().manual_seed(1))[:, None] * 32
            + torch.arange(32)).reshape(-1)
    for src in (names.Source("w"), names.Source("w", rows=torch.randperm(N), cols=cols)):
        fast = repack.packed(t, (N, K), src)
        slow = torch_path(t, (N, K), src)
        assert fast is not None and type(fast) is type(slow)
        for x, y, part in zip(fast.tensors(), slow.tensors(), fast.names):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (kind, part)


@pytest.mark.parametrize("kind", list(LAYOUT))
def test_values_are_ggufs_within_the_mappings_error(kind):
    N, K = 48, 512
    t = random_tensor(kind, N, K, seed=2)
    ref = torch.from_numpy(dequantize(t.data, t.tensor_type)).view(N, K)
    for packed in (repack.packed(t, (N, K), names.Source("w")),
                   torch_path(t, (N, K), names.Source("w"))):
        if packed is None:  # no compiled kernels
            continue
        err = ((packed.dequantize() - ref).norm() / ref.norm()).item()
        assert err <= BOUND[kind], (kind, err)

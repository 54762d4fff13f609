"""int8 weights (``quantization="int8"``): quantized once at load time, multiplied by the compiled
kernels of ``csrc/int8_gemm.c``.

Every weight [N, K] becomes int8 values with one fp16 scale per group of 32 inputs, symmetric,
round to nearest (``W ~= q * scale``, ``scale = amax / 127``): 34 bytes per 32 weights against
64 in bf16. ``QuantWeight`` keeps them in the kernels' layout, panels of 16 output columns by
groups of 32 inputs (see csrc/int8_gemm.c); ``dequantize`` and ``rows`` give the values back.

``linear`` multiplies on the CPU with the kernels: each row of x is quantized to int8 per group
of 32 as well, the group dot products are exact integers and the scales are applied in fp32
(``emulate`` does the same in torch). The kernels have paths for AVX-512 VNNI, AVX2 and plain C;
``select_isa`` picks the best this build has, or the one asked for (``KernelOptions.int8_isa``,
``HYBRIDRT_INT8_ISA``: vnni, avx2, ref). Without the compiled kernels ``linear`` multiplies the
dequantized weight (``reference_linear``, which is also what the reference backend runs).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .memory import release_pages

GROUP = 32  # inputs per scale
PANEL = 16  # output columns per panel
ISAS = {"ref": 1, "avx2": 2, "vnni": 4}  # csrc/int8_gemm.c's ISA_* flags, best last
_CHUNK_ROWS = 8192  # rows quantized at a time (bounds the fp32 temporaries)


class PackedWeight:
    """What the model, the loader and the backends see of a quantized weight [N, K] (int8 here,
    4-bit in kernels/int4.py): ``shape``, its tensors in the kernels' layout (``names``, each
    indexed by panels of 16 output columns first), ``dequantize`` and ``rows``."""

    __slots__ = ()
    kind = ""  # the format's name: "int8", "int4", "int6" (int4's LM head)
    names: tuple[str, ...] = ()  # the tensors' names, as stored (``<param>.<name>``)
    shape: tuple[int, int]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def replace(self, *tensors: torch.Tensor) -> PackedWeight:
        """The same weight held in ``tensors`` (copies of ``tensors()``, e.g. in an arena)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.tensors()[0].device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError


class QuantWeight(PackedWeight):
    """A weight [N, K] in int8: ``qs`` [P, G, 8, 16, 4] with qs[p, g, k4, c, j] the value of
    W[16 p + c, 32 g + 4 k4 + j] and ``scales`` [P, G, 16] fp16 the scale of W[16 p + c]'s
    group g (P = ceil(N / 16), G = ceil(K / 32), zeros past N and K). ``shape`` is W's."""

    __slots__ = ("qs", "scales", "shape")
    kind = "int8"
    names = ("qs", "scales")

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]):
        self.qs, self.scales, self.shape = qs, scales, (int(shape[0]), int(shape[1]))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.qs, self.scales

    def replace(self, *tensors: torch.Tensor) -> QuantWeight:
        return QuantWeight(*tensors, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> W [N, K] as the int8 values times their scales."""
        P, G = self.scales.shape[:2]
        w = self.qs.to(dtype).view(P, G, 8, PANEL, 4) * self.scales.to(dtype)[:, :, None, :, None]
        w = w.permute(0, 3, 1, 2, 4).reshape(P * PANEL, G * GROUP)
        return w[:self.shape[0], :self.shape[1]]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the dequantized W -> [*ids.shape, K], contiguous."""
        flat = ids.reshape(-1)
        p, c = flat // PANEL, flat % PANEL
        q = self.qs[p, :, :, c, :]  # [n, G, 8, 4]
        s = self.scales[p, :, c]  # [n, G]
        w = q.to(dtype).reshape(len(flat), -1, GROUP) * s.to(dtype)[:, :, None]
        # contiguous: the CPU decode loop hands the embedding rows to csrc/norm.c as the residual
        w = w.reshape(len(flat), -1)[:, :self.shape[1]].contiguous()
        return w.view(*ids.shape, self.shape[1])


def packed_shapes(shape: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``qs`` and ``scales`` of a QuantWeight of a weight [N, K]."""
    P, G = -(-shape[0] // PANEL), -(-shape[1] // GROUP)
    return (P, G, GROUP // 4, PANEL, 4), (P, G, PANEL)


def quantize(weight: torch.Tensor) -> QuantWeight:
    """W [N, K] (any float dtype) -> its QuantWeight: per row and group of 32 inputs,
    scale = amax / 127 rounded to fp16, q = round(W * (1 / scale)) clamped to [-127, 127]."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize: expected a float matrix, got {weight.dtype} "
                         f"{list(weight.shape)}")
    N, K = weight.shape
    qs_shape, scales_shape = packed_shapes((N, K))
    P, G = scales_shape[:2]
    qs = torch.empty(qs_shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(scales_shape, dtype=torch.float16, device=weight.device)
    step = max(PANEL, _CHUNK_ROWS // PANEL * PANEL)
    for n0 in range(0, P * PANEL, step):  # chunks of whole panels
        w = weight[n0:n0 + step].to(torch.float32, copy=True)  # changed in place below
        rows = -(-w.shape[0] // PANEL) * PANEL
        if rows != w.shape[0] or G * GROUP != K:
            w = F.pad(w, (0, G * GROUP - K, 0, rows - w.shape[0]))
        w = w.view(-1, G, GROUP)
        s = (_group_amax(w) / 127).half()  # [rows, G]
        sf = s.float()
        inv = torch.where(sf > 0, 1 / sf, 0)
        q = w.mul_(inv[..., None]).round_().clamp_(-127, 127)
        p0 = n0 // PANEL
        qs[p0:p0 + rows // PANEL].copy_(q.view(-1, PANEL, G, 8, 4).permute(0, 2, 3, 1, 4))
        scales[p0:p0 + rows // PANEL] = s.view(-1, PANEL, G).transpose(1, 2)
    return QuantWeight(qs, scales, (N, K))


def _group_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| over the last dimension (a power of two), by halving it: elementwise maxima of
    its two halves until one value is left."""
    m, n = w.abs(), w.shape[-1]
    while n > 1:
        n //= 2
        m = torch.maximum(m[..., :n], m[..., n:2 * n])
    return m[..., 0]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (q [M, K] int8 as float, d [M, K / 32] fp32), per group of
    32: d = amax / 127, q = round(x * (127 / amax)): what the kernels do to each row first."""
    M, K = x.shape
    xg = x.float().view(M, K // GROUP, GROUP)
    amax = xg.abs().amax(-1)
    # 127 divided by amax, as the kernels do (``127.0 / amax`` is amax.reciprocal() * 127 in
    # torch: another rounding, which moves the odd product off or onto a tie)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (xg * inv[..., None]).round().view(M, K), amax / 127


def kernel_quantize_activations(x: torch.Tensor, isa: str
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the compiled path ``isa`` does to fp32 or bf16 rows x [M, K] before the products (the
    tests hold it to ``quantize_activations``) -> (q [M, Kp] int8, d and sums [M, Kp / 32]), Kp
    = K rounded up to a multiple of 32."""
    M, K = x.shape
    Kp = -(-K // GROUP) * GROUP
    x = x.contiguous()
    q = torch.empty(M, Kp, dtype=torch.int8)
    d = torch.empty(M, Kp // GROUP)
    s = torch.empty(M, Kp // GROUP, dtype=torch.int32)
    if x.dtype not in (torch.float32, torch.bfloat16) or _lib().int8_quantize_rows(
            x.data_ptr(), int(x.dtype == torch.bfloat16), q.data_ptr(), d.data_ptr(), s.data_ptr(),
            M, K, Kp, ISAS[isa]):
        raise RuntimeError(f"int8 quantize: path {isa!r} or dtype {x.dtype} unavailable")
    return q, d, s


def emulate(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """The kernels' result in torch: x [M, K] and W quantized per group, each group's dot
    product exact, scaled in fp32 -> [M, N] fp32 (to rounding order)."""
    N, K = qw.shape
    P, G = qw.scales.shape[:2]
    xq, dx = quantize_activations(F.pad(x.float(), (0, G * GROUP - K)))
    wq = qw.qs.double().permute(0, 3, 1, 2, 4).reshape(P * PANEL, G, GROUP)
    dots = torch.einsum("mgk,ngk->mng", xq.double().view(-1, G, GROUP), wq)
    dw = qw.scales.float().transpose(1, 2).reshape(P * PANEL, G)
    y = (dots.float() * (dx[:, None, :] * dw[None])).sum(-1)
    return y[:, :N]


def concat(qws: list[PackedWeight], release: bool = False, alloc=None
           ) -> tuple[PackedWeight, list[PackedWeight]]:
    """The weights [N_i, K] (one kind, each N_i a multiple of ``PANEL``) stacked as one
    [sum N_i, K], so that one product serves them all -> (the stack, each input as a view into
    it). ``release``: give the inputs' pages back to the OS (their owner replaces them by the
    views). ``alloc(shape, dtype)``: where the stack goes (default ``torch.empty`` on the
    inputs' device)."""
    K = qws[0].shape[1]
    if any(type(q) is not type(qws[0]) or q.shape[1] != K or q.shape[0] % PANEL for q in qws):
        raise ValueError("concat: weights need the same kind, the same K and whole panels of "
                         "rows")
    device = qws[0].device
    alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))
    stacked = []
    for i in range(len(qws[0].tensors())):
        parts = [q.tensors()[i] for q in qws]
        t = alloc((sum(x.shape[0] for x in parts), *parts[0].shape[1:]), parts[0].dtype)
        stacked.append(torch.cat(parts, out=t))
    out = type(qws[0])(*stacked, (sum(q.shape[0] for q in qws), K))
    parts, p0 = [], 0
    for q in qws:
        p1 = p0 + q.shape[0] // PANEL
        parts.append(q.replace(*(t[p0:p1] for t in stacked)))
        p0 = p1
    if release:
        for q in qws:
            for t in q.tensors():
                release_pages(t)
    return out, parts


def reference_linear(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """x W^T with the dequantized weight, in x's dtype (activations not quantized)."""
    return F.linear(x, qw.dequantize(x.dtype))


_typed = False


def _lib():
    global _typed
    lib = native.load()
    if lib is not None and not _typed:
        _typed = True
        lib.int8_isas.restype = ctypes.c_int
        lib.int8_isas.argtypes = []
        lib.int8_gemm.restype = ctypes.c_int
        lib.int8_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
        lib.int8_gemm_bf16.restype = ctypes.c_int
        lib.int8_gemm_bf16.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
                                       + [ctypes.c_int] * 2)
        lib.int8_quantize_rows.restype = ctypes.c_int
        lib.int8_quantize_rows.argtypes = ([ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3
                                           + [ctypes.c_int64] * 3 + [ctypes.c_int])
    return lib


def available_isas() -> list[str]:
    """The kernel paths this build has (worst first); [] without the compiled kernels."""
    lib = _lib()
    return [] if lib is None else [n for n, f in ISAS.items() if lib.int8_isas() & f]


def pick_isa(forced: str | None, have: list[str], names, var: str) -> str | None:
    """``forced`` when given (ValueError naming the variable ``var`` if it is not one of
    ``names`` or not in ``have``), else the best of ``have`` (worst first); None if empty. The
    int8 and the 4-bit kernels choose their path this way."""
    if forced:
        if forced not in names:
            raise ValueError(f"{var}={forced!r}: choose one of {', '.join(names)}")
        if forced not in have:
            raise ValueError(f"{var}={forced}: not available here (this CPU's build "
                             f"has: {', '.join(have) or 'no compiled kernels'})")
        return forced
    return have[-1] if have else None


def select_isa(forced: str | None = None, native: bool = True) -> str | None:
    """The path ``linear`` takes: ``forced`` when given (``HYBRIDRT_INT8_ISA``; ValueError if
    this build lacks it), else the best one available; None without the compiled kernels
    (``native`` False: as if they had not built)."""
    return pick_isa(forced, available_isas() if native else [], ISAS, "HYBRIDRT_INT8_ISA")


def int8_gemm(x: torch.Tensor, qw: QuantWeight, isa: str) -> torch.Tensor:
    """x [M, K] (any float dtype) times the quantized W by the compiled kernel path ``isa`` ->
    [M, N] fp32."""
    N, K = qw.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"int8_gemm: x must be [M, {K}], got {list(x.shape)}")
    lib = _lib()
    if lib is None or isa not in ISAS:
        raise RuntimeError(f"int8_gemm: kernel path {isa!r} unavailable")
    Kp = qw.scales.shape[1] * GROUP
    x = x.float()
    if Kp != K:
        x = F.pad(x, (0, Kp - K))
    x = x.contiguous()
    y = torch.empty(x.shape[0], N, dtype=torch.float32)
    if x.shape[0] and N and lib.int8_gemm(x.data_ptr(), qw.qs.data_ptr(), qw.scales.data_ptr(),
                                          y.data_ptr(), x.shape[0], N, Kp, ISAS[isa],
                                          torch.get_num_threads()):
        raise RuntimeError(f"int8_gemm: kernel path {isa!r} failed (not in this build?)")
    return y


def linear(x: torch.Tensor, qw: QuantWeight, isa: str | None) -> torch.Tensor:
    """x [..., K] times the quantized W [N, K] -> [..., N] in x's dtype: the compiled kernel path
    ``isa`` (``select_isa``) on the CPU; ``reference_linear`` when ``isa`` is None."""
    if isa is None or x.device.type != "cpu":
        return reference_linear(x, qw)
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous():
        return _int8_gemm_bf16(x, qw, isa)
    y = int8_gemm(x.reshape(-1, x.shape[-1]), qw, isa)
    return y.view(*x.shape[:-1], qw.shape[0]).to(x.dtype)


def _int8_gemm_bf16(x: torch.Tensor, qw: QuantWeight, isa: str) -> torch.Tensor:
    """``int8_gemm`` for contiguous bf16 x [M, K] -> [M, N] bf16, the sums rounded once, in
    one call (no conversions around it)."""
    N, K = qw.shape
    if x.shape[1] != K:
        raise ValueError(f"int8_gemm: x must be [M, {K}], got {list(x.shape)}")
    y = torch.empty(x.shape[0], N, dtype=torch.bfloat16)
    if x.shape[0] and N and _lib().int8_gemm_bf16(
            x.data_ptr(), qw.qs.data_ptr(), qw.scales.data_ptr(), y.data_ptr(), x.shape[0], N, K,
            qw.scales.shape[1] * GROUP, ISAS[isa], torch.get_num_threads()):
        raise RuntimeError(f"int8_gemm: kernel path {isa!r} failed (not in this build?)")
    return y


class QuantEmbedding(nn.Module):
    """The token embedding of a quantized model: looks up (dequantizes) only the rows it needs;
    ``qweight`` is also the tied LM head's weight."""

    def __init__(self, qweight: QuantWeight, dtype: torch.dtype):
        super().__init__()
        self.qweight = qweight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = qweight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids, self.dtype)


def kernel_weight(module):
    """The weight a product with ``module`` reads: its ``qweight`` (a ``PackedWeight``)
    when it has one, else its ``weight`` tensor [out, in]. The model hands backends these,
    never the modules; merged groups are keyed by their ids."""
    q = getattr(module, "qweight", None)
    return q if q is not None else module.weight


def quantized_names(model: nn.Module) -> set[str]:
    """Parameter names of ``model`` that ``quantization="int8"`` stores in int8: the weights of
    every bias-free nn.Linear (projections, MLP, MTP, an untied LM head) and the token
    embedding (the tied LM head)."""
    names = {f"{n}.weight" for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and m.bias is None}
    names |= {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    return names


def attach(model: nn.Module, quantized: dict[str, PackedWeight], dtype: torch.dtype) -> None:
    """Put the quantized weights (QuantWeight, int4.Int4Weight) in place of their parameters: a
    Linear's ``weight`` becomes None and its ``qweight`` the quantized weight; an Embedding
    becomes a QuantEmbedding."""
    for name, qw in quantized.items():
        path = name.removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, attr)
        if isinstance(module, nn.Embedding):
            setattr(parent, attr, QuantEmbedding(qw, dtype))
        else:
            module.weight = None
            module.qweight = qw


def is_quantized(model: nn.Module) -> bool:
    """Whether some weight of ``model`` is quantized (a PackedWeight)."""
    return quantization_of(model) is not None


def quantization_of(model: nn.Module) -> str | None:
    """"int4" when some weight of ``model`` is 4-bit, else "int8" when some is int8, else
    None."""
    kinds = {m.qweight.kind for m in model.modules()
             if isinstance(getattr(m, "qweight", None), PackedWeight)}
    return "int4" if "int4" in kinds else "int8" if kinds else None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: parameters plus the quantized weights and their scales."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return n + sum(m.qweight.nbytes for m in model.modules()
                   if isinstance(getattr(m, "qweight", None), PackedWeight))

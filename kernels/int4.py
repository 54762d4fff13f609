"""4-bit weights (``quantization="int4"``): quantized once at load time (or stored by ``hybridrt
quantize``), multiplied by the compiled kernels of ``csrc/int4_gemm.c``.

The format. Every weight [N, K] is cut into groups of 32 inputs and superblocks of 8 groups (256
inputs); a weight is ``W ~= dw * q - mw`` with ``q`` in [0, 15] and, per column and group, a
scale ``dw = D * sc`` and a minimum ``mw = M * mc``: ``sc``, ``mc`` 8-bit codes of the group,
``D``, ``M`` bf16 of the column's superblock. 4.625 bits a weight (4 + 16 / 32 + 32 / 256):
llama.cpp's Q4_K is the same idea with 6-bit codes (4.5 bits); asymmetric groups (a minimum,
not a zero in the middle) because the kernels get it for free (the nibbles are unsigned bytes,
and the minimum's share is one more fma a group with the sum of the activations the int8
quantization of x makes anyway) and it cut the demo model's perplexity cost by a third against
Q4_0-style symmetric groups (docs/performance.md). ``Int4Weight`` keeps the three tensors in
the kernels' layout (panels of 16 output columns, see csrc/int4_gemm.c); ``dequantize`` and
``rows`` give the values back.

The tied embedding / LM head (``six_bit``) takes 6 bits instead, by measurement (at 4 bits
it alone doubled the perplexity cost; in int8 it was half the bytes a decoded token reads;
docs/performance.md): ``Int6Weight``, the same format with q in [0, 63], its low 4 bits where
the 4-bit format keeps them and a plane of the high 2 bits beside (6.625 bits a weight, as
llama.cpp's Q4_K_M keeps it at Q6_K's 6.5625).

``linear`` multiplies on the CPU with the kernels: each row of x is quantized to int8 per group
of 32 as for int8 weights (``quant.quantize_activations``), the group dot products are exact
integers, scales and minimums are applied in fp32 in one fixed order (``emulate`` does the same
in torch, bit for bit). Paths: AVX-512 VNNI, 256-bit VNNI (AVX-VNNI, or AVX512-VNNI + VL), AVX2
and plain C; ``select_isa`` picks the best this build has, or the one asked for
(``KernelOptions.int4_isa``, ``HYBRIDRT_INT4_ISA``; unset, it follows ``HYBRIDRT_INT8_ISA``).
Without the compiled kernels ``linear`` multiplies the dequantized weight.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import int4_prefetch, native, quant

GROUP = 32  # inputs per group (one scale code and one minimum code)
SUPER = 8  # groups per superblock (one D and one M)
PANEL = 16  # output columns per panel
CODES = 255  # the codes' largest value
QMAX = {4: 15, 6: 63}  # q's largest value, by bits a weight
ISAS = {"ref": 1, "avx2": 2, "avxvnni": 8, "vnni": 4}  # csrc/int4_gemm.c's ISA_* flags, best last
_CHUNK_ROWS = 1024  # rows quantized at a time (bounds the fp32 temporaries)
# the grids past the min/max one that the quantizer tries per group, minus one (see _fit):
# llama.cpp's Q4_K search tries 21; 5 gave the demo model the same perplexity, 4x faster
_SEARCH_STEPS = 4


class Int4Weight(quant.PackedWeight):
    """A weight [N, K] in 4 bits (P = ceil(N / 16) panels, G = ceil(K / 32) groups, S =
    ceil(G / 8) superblocks; zeros past N and K):

    - ``qs`` [P, G, 4, 64] uint8: byte 4 c + j of qs[p, g, r] holds q(W[16 p + c, 32 g + 4 r +
      j]) in its low nibble and q(W[16 p + c, 32 g + 16 + 4 r + j]) in its high one;
    - ``codes`` [P, G, 2, 16] uint8: sc and mc of column 16 p + c in group g;
    - ``scales`` [P, S, 2, 16] bf16: D and M of column 16 p + c in superblock s.

    ``shape`` is W's."""

    __slots__ = ("qs", "codes", "scales", "shape", "_ptrs")
    kind = "int4"
    names = ("qs", "codes", "scales")
    bits = 4

    def __init__(self, qs: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 shape: tuple[int, int]):
        self.qs, self.codes, self.scales = qs, codes, scales
        self.shape = (int(shape[0]), int(shape[1]))
        self._ptrs = None

    def ptrs(self) -> tuple[int, ...]:
        """The tensors' data pointers (``names``' order) and the packed width 32 G, for the
        kernels."""
        if self._ptrs is None:
            self._ptrs = (*(t.data_ptr() for t in self.tensors()), self.codes.shape[1] * GROUP)
        return self._ptrs

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.qs, self.codes, self.scales

    def replace(self, *tensors: torch.Tensor) -> Int4Weight:
        return Int4Weight(*tensors, self.shape)

    def steps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(dw, mw) [P * 16, G] fp32: every column's scale and minimum per group (exact: bf16
        times an 8-bit code)."""
        P, G = self.codes.shape[:2]
        sup = self.scales.float().repeat_interleave(SUPER, dim=1)[:, :G]  # [P, G, 2, 16]
        both = sup * self.codes.float()
        dw, mw = (both[:, :, i].permute(0, 2, 1).reshape(P * PANEL, G) for i in (0, 1))
        return dw, mw

    def values(self) -> torch.Tensor:
        """q [P * 16, G * 32] uint8 in [0, 15] (6 bits: [0, 63]), unpacked."""
        return unpack(self.qs)

    def _row_values(self, p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """q of columns 16 p + c -> [n, G, 32] uint8."""
        P, G = self.codes.shape[:2]
        b = self.qs.view(P, G, 4, PANEL, 4)[p, :, :, c, :]  # [n, G, 4, 4]
        return torch.stack([b & 15, b >> 4], dim=2).view(len(p), G, GROUP)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> W [N, K] as dw * q - mw (computed in fp32)."""
        dw, mw = self.steps()
        G = dw.shape[1]
        q = self.values().float().view(-1, G, GROUP)
        w = (q * dw[..., None] - mw[..., None]).view(-1, G * GROUP)
        return w[:self.shape[0], :self.shape[1]].to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the dequantized W -> [*ids.shape, K], contiguous: by
        csrc/int4_quant.c's ``int4_rows`` where this process has loaded the kernels (the
        embedding's lookup each step), else in torch; the same values."""
        if (native._lib is not None and dtype in (torch.float32, torch.bfloat16)
                and ids.device.type == self.qs.device.type == "cpu"):
            return self._rows_native(ids, dtype)
        flat = ids.reshape(-1)
        p, c = flat // PANEL, flat % PANEL
        P, G = self.codes.shape[:2]
        q = self._row_values(p, c).float()
        # the rows' superblock scales only (the whole table widened is 63 MB at the 0.8B
        # embedding: 3.6 ms a decode step)
        sup = self.scales[p, :, :, c].float().repeat_interleave(SUPER, dim=1)[:, :G]  # [n, G, 2]
        both = sup * self.codes[p, :, :, c].float()  # [n, G, 2]
        w = q * both[..., 0, None] - both[..., 1, None]
        w = w.view(len(flat), -1)[:, :self.shape[1]].to(dtype).contiguous()
        return w.view(*ids.shape, self.shape[1])

    def _rows_native(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        K = self.shape[1]
        out = torch.empty(len(flat), K, dtype=dtype)
        hs = getattr(self, "hs", None)
        if _lib().int4_rows(self.qs.data_ptr(), None if hs is None else hs.data_ptr(),
                            self.codes.data_ptr(), self.scales.data_ptr(), flat.data_ptr(),
                            len(flat), self.shape[0], self.codes.shape[1], self.scales.shape[1],
                            K, int(dtype == torch.bfloat16), out.data_ptr()):
            raise IndexError(f"rows: ids must be in [0, {self.shape[0]})")
        return out.view(*ids.shape, K)


_HIGH_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)  # r -> bits 2 r, 2 r + 1


class Int6Weight(Int4Weight):
    """A weight [N, K] in 6 bits: an Int4Weight's tensors, q in [0, 63] with its low 4 bits in
    ``qs`` as there, and ``hs`` [P, G, 2, 64] uint8 the high 2: bits 2 r and 2 r + 1 of byte
    4 c + j of hs[p, g, h] are q(W[16 p + c, 32 g + 16 h + 4 r + j]) >> 4 (hs[p, g, 0] goes
    with the low nibbles of qs[p, g, r], hs[p, g, 1] with the high ones: each 64-byte row of
    hs completes the 4 vectors a kernel unpacks from one half of a group's qs)."""

    __slots__ = ("hs",)
    kind = "int6"
    names = ("qs", "hs", "codes", "scales")
    bits = 6

    def __init__(self, qs: torch.Tensor, hs: torch.Tensor, codes: torch.Tensor,
                 scales: torch.Tensor, shape: tuple[int, int]):
        super().__init__(qs, codes, scales, shape)
        self.hs = hs

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.qs, self.hs, self.codes, self.scales

    def replace(self, *tensors: torch.Tensor) -> Int6Weight:
        return Int6Weight(*tensors, self.shape)

    def values(self) -> torch.Tensor:
        return unpack(self.qs) | unpack_high(self.hs) << 4

    def _row_values(self, p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        P, G = self.codes.shape[:2]
        b = self.hs.view(P, G, 2, PANEL, 4)[p, :, :, c, None, :]  # [n, G, 2, 1, 4]
        h = b >> _HIGH_SHIFTS & 3  # [n, G, 2 h, 4 r, 4 j]
        return super()._row_values(p, c) | (h << 4).view(len(p), G, GROUP)


def widened(w: Int4Weight) -> Int6Weight:
    """A 4-bit weight in the 6-bit format, the same values (high bits 0, the same steps and
    minimums): so a projection group mixing the two (a GGUF Q4_K_M file keeps some in Q6_K)
    merges into one weight."""
    P, G = w.codes.shape[:2]
    hs = torch.zeros((P, G, 2, 4 * PANEL), dtype=torch.uint8, device=w.qs.device)
    return Int6Weight(w.qs, hs, w.codes, w.scales, w.shape)


def packed_shapes(shape: tuple[int, int], bits: int = 4) -> tuple[tuple[int, ...], ...]:
    """The shapes of the tensors (``names``) of an Int4Weight (``bits`` 6: an Int6Weight) of a
    weight [N, K]."""
    P, G = -(-shape[0] // PANEL), -(-shape[1] // GROUP)
    S = -(-G // SUPER)
    high = ((P, G, 2, 4 * PANEL),) if bits == 6 else ()
    return (P, G, 4, 4 * PANEL), *high, (P, G, 2, PANEL), (P, S, 2, PANEL)


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [16 P, 32 G] (values in [0, 15]) -> qs [P, G, 4, 64] in the kernels' nibble order."""
    rows, cols = q.shape
    P, G = rows // PANEL, cols // GROUP
    q = q.to(torch.uint8).view(P, PANEL, G, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # p g h r c j
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(P, G, 4, 4 * PANEL)


def unpack(qs: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: qs [P, G, 4, 64] -> q [16 P, 32 G] uint8."""
    P, G = qs.shape[:2]
    b = qs.view(P, G, 4, PANEL, 4)
    q = torch.stack([b & 15, b >> 4], dim=2)  # p g h r c j
    return q.permute(0, 4, 1, 2, 3, 5).reshape(P * PANEL, G * GROUP)


def pack_high(h: torch.Tensor) -> torch.Tensor:
    """The high 2 bits h [16 P, 32 G] (values in [0, 3]) of 6-bit q -> hs [P, G, 2, 64]."""
    rows, cols = h.shape
    P, G = rows // PANEL, cols // GROUP
    h = h.to(torch.uint8).view(P, PANEL, G, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # p g h r c j
    return (h[:, :, :, 0] | h[:, :, :, 1] << 2 | h[:, :, :, 2] << 4 | h[:, :, :, 3] << 6
            ).reshape(P, G, 2, 4 * PANEL)


def unpack_high(hs: torch.Tensor) -> torch.Tensor:
    """``pack_high``'s inverse: hs [P, G, 2, 64] -> h [16 P, 32 G] uint8."""
    P, G = hs.shape[:2]
    b = hs.view(P, G, 2, PANEL, 4)
    h = torch.stack([b >> 2 * r & 3 for r in range(4)], dim=3)  # p g h r c j
    return h.permute(0, 4, 1, 2, 3, 5).reshape(P * PANEL, G * GROUP)


def quantize(weight: torch.Tensor, bits: int = 4) -> Int4Weight:
    """W [N, K] (any float dtype, finite) -> its Int4Weight (``bits`` 6: its Int6Weight). Per
    column and group of 32 a step dw and a minimum mw (``_fit``), then per superblock D = max
    dw / 255 and M = max mw / 255 rounded to bf16, the codes sc = round(dw / D) (at least 1 for
    a group with a range) and mc = round(mw / M), and q = round((w + M mc) / (D sc)) clamped
    to [0, 15] ([0, 63]). By the compiled csrc/int4_quant.c where it runs (the same bytes as
    ``quantize_reference``, some 50x faster), else by ``quantize_reference``."""
    _check_quantizable(weight, bits)
    lib = _lib()
    if lib is None or weight.device.type != "cpu":
        return quantize_reference(weight, bits)
    w = weight.detach()
    if w.dtype not in (torch.float32, torch.bfloat16):
        w = w.float()
    w = w.contiguous()
    if not torch.isfinite(w).all():
        raise ValueError("int4 quantize: the weight holds inf or NaN")
    N, K = w.shape
    shapes = packed_shapes((N, K), bits)
    t = [torch.empty(s, dtype=torch.uint8) for s in shapes[:-1]]
    t.append(torch.empty(shapes[-1], dtype=torch.bfloat16))
    qs, hs, codes, scales = t if bits == 6 else (t[0], None, *t[1:])
    if lib.int4_quantize(w.data_ptr(), int(w.dtype == torch.bfloat16), N, K, qs.data_ptr(),
                         None if hs is None else hs.data_ptr(), codes.data_ptr(),
                         scales.data_ptr(), QMAX[bits], _SEARCH_STEPS, torch.get_num_threads()):
        raise MemoryError("int4 quantize: no memory for the quantizer's scratch")
    return _weight(bits)(*t, (N, K))


def _weight(bits: int) -> type[Int4Weight]:
    return Int6Weight if bits == 6 else Int4Weight


def _check_quantizable(weight: torch.Tensor, bits: int = 4) -> None:
    if bits not in QMAX:
        raise ValueError(f"int4 quantize: bits must be 4 or 6, got {bits}")
    if weight.dim() != 2 or not weight.is_floating_point() or 0 in weight.shape:
        raise ValueError(f"int4 quantize: expected a non-empty float matrix, got {weight.dtype} "
                         f"{list(weight.shape)}")


def quantize_reference(weight: torch.Tensor, bits: int = 4) -> Int4Weight:
    """``quantize`` in torch ops (the definition the compiled quantizer is held to; the path
    without it)."""
    _check_quantizable(weight, bits)
    N, K = weight.shape
    qs_shape, *hs_shape, codes_shape, scales_shape = packed_shapes((N, K), bits)
    P, G = codes_shape[:2]
    S = scales_shape[1]
    qmax = QMAX[bits]
    qs = torch.empty(qs_shape, dtype=torch.uint8, device=weight.device)
    hs = [torch.empty(s, dtype=torch.uint8, device=weight.device) for s in hs_shape]
    codes = torch.empty(codes_shape, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(scales_shape, dtype=torch.bfloat16, device=weight.device)
    step = max(PANEL, _CHUNK_ROWS // PANEL * PANEL)
    for n0 in range(0, P * PANEL, step):  # chunks of whole panels
        w = weight[n0:n0 + step].float()
        if not torch.isfinite(w).all():
            raise ValueError("int4 quantize: the weight holds inf or NaN")
        rows = -(-w.shape[0] // PANEL) * PANEL
        w = F.pad(w, (0, G * GROUP - K, 0, rows - w.shape[0])).view(rows, G, GROUP)
        sc, mc, D, M = _codes(w, S, K, qmax)
        dw = (D.repeat_interleave(SUPER, dim=1)[:, :G] * sc)  # exact: bf16 x 8 bits
        mw = (M.repeat_interleave(SUPER, dim=1)[:, :G] * mc)
        inv = torch.where(dw > 0, 1 / dw, 0)
        q = ((w + mw[..., None]) * inv[..., None]).round_().clamp_(0, qmax)
        q = q.to(torch.uint8).view(rows, G * GROUP)
        p0, p1 = n0 // PANEL, n0 // PANEL + rows // PANEL
        qs[p0:p1] = pack(q & 15)
        if hs:
            hs[0][p0:p1] = pack_high(q >> 4)
        codes[p0:p1] = torch.stack([sc, mc], 1).view(-1, PANEL, 2, G).permute(0, 3, 2, 1)
        scales[p0:p1] = torch.stack([D, M], 1).view(-1, PANEL, 2, S).permute(0, 3, 2, 1)
    return _weight(bits)(qs, *hs, codes, scales, (N, K))


def _codes(w: torch.Tensor, S: int, K: int, qmax: int):
    """w [rows, G, 32] fp32 (zeros past input K) -> (sc, mc [rows, G] as float, D, M [rows,
    S] bf16 values as float)."""
    rows, G = w.shape[:2]
    d, m = _fit(w, K, qmax)
    pad = S * SUPER - G
    D, M = (F.pad(v, (0, pad)).view(rows, S, SUPER).amax(-1) / torch.tensor(float(CODES))
            for v in (d, m))
    D, M = D.bfloat16().float(), M.bfloat16().float()
    Dg, Mg = (v.repeat_interleave(SUPER, dim=1)[:, :G] for v in (D, M))
    sc = torch.where(Dg > 0, d / Dg, 0).round_().clamp_(0, CODES)
    sc = torch.where((d > 0) & (sc == 0), 1, sc)  # a group with a range keeps one
    mc = torch.where(Mg > 0, m / Mg, 0).round_().clamp_(0, CODES)
    return sc, mc, D, M


def _fit(w: torch.Tensor, K: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's step and minimum (w ~= d q - m, q in [0, qmax], d, m >= 0) -> d, m [rows,
    G].

    llama.cpp's Q4_K search (make_qkx2_quants), vectorised: the squared error weighted by
    ``rms(group) + |w|`` (large weights count more), over the min/max grid and 5 grids of qmax
    - 1, qmax - 0.5, ... qmax + 1 steps over the range (14 .. 16 at 4 bits), each refitted by
    weighted least squares (the minimum kept <= 0); the best one. The inputs past K (padding)
    weigh nothing. The same operations as csrc/int4_quant.c (sums in fp64, the rest in
    fp32)."""
    lo, hi = w.amin(-1).clamp_(max=0), w.amax(-1)
    rng = hi - lo
    t = w - lo[..., None]
    wd = w.double()
    wt = (wd * wd).mean(-1, keepdim=True).sqrt_() + wd.abs()
    if K % GROUP:
        wt[:, -1, K % GROUP:] = 0
    sw, swx, swxx = wt.sum(-1), (wt * wd).sum(-1), (wt * wd * wd).sum(-1)
    d0 = rng / torch.full_like(rng, qmax)  # a true division, as the C code (not x * (1 / 15))
    q0 = torch.where(d0[..., None] > 0, t / d0[..., None], 0).round_().clamp_(0, qmax)
    best_err = (wt * (q0.double() * d0.double()[..., None] + lo.double()[..., None] - wd) ** 2
                ).sum(-1)
    best_d, best_mn = d0.double(), lo.double()
    for i in range(_SEARCH_STEPS + 1):
        iscale = torch.where(rng > 0, torch.full_like(rng, qmax - 1 + 2 * i / _SEARCH_STEPS)
                             / rng, 0)
        q = (t * iscale[..., None]).round_().clamp_(0, qmax).double()
        wq = wt * q
        s1, s2, sx = wq.sum(-1), (wq * q).sum(-1), (wq * wd).sum(-1)
        den = sw * s2 - s1 * s1
        ok = den > 0
        d = torch.where(ok, (sw * sx - swx * s1) / den, 0)
        mn = torch.where(ok, (s2 * swx - s1 * sx) / den, 0)  # w ~= d q + mn
        above = mn > 0  # the minimum stays <= 0: refit the step alone
        d = torch.where(above, torch.where(s2 > 0, sx / s2, 0), d)
        mn = torch.where(above, 0, mn)
        err = (d * d * s2 + 2 * d * mn * s1 - 2 * d * sx + mn * mn * sw - 2 * mn * swx
               + swxx)
        better = ok & (err < best_err) & (d > 0)
        best_err = torch.where(better, err, best_err)
        best_d, best_mn = torch.where(better, d, best_d), torch.where(better, mn, best_mn)
    return (best_d + 0.0).float(), (0.0 - best_mn).float()  # no -0.0: the codes' maxima


def emulate(x: torch.Tensor, qw: Int4Weight) -> torch.Tensor:
    """The kernels' result in torch, bit for bit: x [M, K] quantized per group of 32 as the
    kernels do (``quant.quantize_activations``), exact group dot products, then per group in
    order ``acc = fma(dot, dw * d, acc)``, ``acc = fma(mw, -(d * s), acc)`` in fp32 (an fma as
    one rounding of the exact fp64 value, which two roundings can miss in rare ties) -> [M, N]
    fp32."""
    N, K = qw.shape
    dw, mw = qw.steps()
    G = dw.shape[1]
    xq, dx = quant.quantize_activations(F.pad(x.float(), (0, G * GROUP - K)))
    xs = xq.view(len(x), G, GROUP).sum(-1)  # exact
    ndxs = -(dx * xs)  # fp32, as the kernels
    q = qw.values().double().view(-1, G, GROUP)
    dots = torch.einsum("mgk,ngk->mng", xq.double().view(len(x), G, GROUP), q).float()
    acc = torch.zeros(len(x), dw.shape[0])
    for g in range(G):
        t = dw[None, :, g] * dx[:, g, None]  # fp32 product
        acc = _fma(dots[:, :, g], t, acc)
        acc = _fma(mw[None, :, g], ndxs[:, g, None], acc)
    return acc[:, :N]


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double() + c.double()).float()


def reference_linear(x: torch.Tensor, qw: Int4Weight) -> torch.Tensor:
    """x W^T with the dequantized weight, in x's dtype (activations not quantized)."""
    return F.linear(x, qw.dequantize(x.dtype))


_typed = False


def _lib():
    global _typed
    lib = native.load()
    if lib is not None and not _typed:
        _typed = True
        lib.int4_isas.restype = ctypes.c_int
        lib.int4_isas.argtypes = []
        for f, ptrs in ((lib.int4_gemm, 4), (lib.int6_gemm, 5)):  # the weight's, and y
            f.restype = ctypes.c_int
            f.argtypes = ([ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * ptrs
                          + [ctypes.c_int] + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2)
        lib.int4_quantize.restype = ctypes.c_int
        lib.int4_quantize.argtypes = ([ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 2
                                      + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3)
        lib.int4_rows.restype = ctypes.c_int
        lib.int4_rows.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
                                  + [ctypes.c_int, ctypes.c_void_p])
    return lib


def available_isas() -> list[str]:
    """The kernel paths this build has (worst first); [] without the compiled kernels."""
    lib = _lib()
    return [] if lib is None else [n for n, f in ISAS.items() if lib.int4_isas() & f]


def select_isa(forced: str | None = None, native: bool = True) -> str | None:
    """The path ``linear`` takes: ``forced`` when given (``HYBRIDRT_INT4_ISA``; ValueError if
    this build lacks it), else the best one available; None without the compiled kernels
    (``native`` False: as if they had not built)."""
    return quant.pick_isa(forced, available_isas() if native else [], ISAS, "HYBRIDRT_INT4_ISA")


def gemm(x: torch.Tensor, qw: Int4Weight, isa: str,
         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (fp32 or bf16; other float dtypes as fp32) times W by the compiled kernel path
    ``isa`` -> [M, N] in ``out_dtype`` (fp32, or bf16: the fp32 sums rounded once). Up to 8 rows
    the kernels' GEMV, beyond their GEMM: the same result for each row either way."""
    N, K = qw.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"int4 gemm: x must be [M, {K}], got {list(x.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int4 gemm: out_dtype must be float32 or bfloat16, got {out_dtype}")
    lib = _lib()
    if lib is None or isa not in ISAS:
        raise RuntimeError(f"int4 gemm: kernel path {isa!r} unavailable")
    if x.dtype != torch.bfloat16:
        x = x.float()
    x = x.contiguous()
    y = torch.empty(x.shape[0], N, dtype=out_dtype)
    *ptrs, Kp = qw.ptrs()

    def run():
        return x.shape[0] and N and _entry(lib, qw)(
            x.data_ptr(), int(x.dtype == torch.bfloat16), *ptrs, y.data_ptr(),
            int(out_dtype == torch.bfloat16), x.shape[0], N, K, Kp, ISAS[isa],
            torch.get_num_threads())

    int4_prefetch.before_product(run, qw.nbytes, x.shape[0])
    if run():
        raise RuntimeError(f"int4 gemm: kernel path {isa!r} failed (not in this build, or out "
                           f"of memory)")
    return y


def linear(x: torch.Tensor, qw: Int4Weight, isa: str | None) -> torch.Tensor:
    """x [..., K] times the 4-bit W [N, K] -> [..., N] in x's dtype: the compiled kernel path
    ``isa`` (``select_isa``) on the CPU; ``reference_linear`` when ``isa`` is None."""
    if isa is None or x.device.type != "cpu":
        return reference_linear(x, qw)
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and x.shape[0]:
        return _gemm_bf16(x, qw, ISAS[isa])
    x2 = x.reshape(-1, x.shape[-1])
    if x.dtype == torch.bfloat16:
        y = gemm(x2, qw, isa, torch.bfloat16)
    else:
        y = gemm(x2, qw, isa).to(x.dtype)
    return y.view(*x.shape[:-1], qw.shape[0])


def _gemm_bf16(x: torch.Tensor, qw: Int4Weight, flag: int) -> torch.Tensor:
    """``gemm`` for the decode loop's products, bf16 x [M > 0, K] contiguous -> bf16 [M, N],
    with the weight's pointers read once (``Int4Weight.ptrs``): some 4 us a call less."""
    N, K = qw.shape
    if x.shape[1] != K:
        raise ValueError(f"int4 gemm: x must be [M, {K}], got {list(x.shape)}")
    y = torch.empty(x.shape[0], N, dtype=torch.bfloat16)
    *ptrs, Kp = qw.ptrs()

    def run():
        return _entry(_lib(), qw)(x.data_ptr(), 1, *ptrs, y.data_ptr(), 1, x.shape[0], N, K, Kp,
                                  flag, torch.get_num_threads())

    int4_prefetch.before_product(run, qw.nbytes, x.shape[0])
    if run():
        raise RuntimeError("int4 gemm: kernel path failed (not in this build, or out of memory)")
    return y


def _entry(lib, qw: Int4Weight):
    """The kernels' entry point for ``qw``'s format (its ``ptrs`` are the arguments it takes)."""
    return lib.int6_gemm if qw.bits == 6 else lib.int4_gemm


def six_bit(name: str) -> bool:
    """Whether ``quantization="int4"`` stores the parameter ``name`` in 6 bits rather than 4:
    the token embedding (the tied LM head) and an untied LM head."""
    return name in ("model.embed_tokens.weight", "lm_head.weight")

"""A decode step's layers as one compiled call (csrc/step.c): ``StepProgram`` lists the kernels
``CPUBackend.forward``'s decode loop calls, in its order and with its arguments, over buffers of
its own; a run sets the step's few pointers (its hidden states, slots, block tables and RoPE
rows) and makes one ctypes call instead of some 250. The same kernels in the same order give
the same bits as the loop (tests/test_step_program.py); what goes is the Python around each
call, which the weights' stream through the caches makes slow (docs/performance.md).

A program is built per step shape: rows (sequences x tokens each) and tokens per sequence;
whether a step keeps the state after each token (``slots_out``, verification) is one of the
pointers it sets per step. It holds the
products' weights as the loop does: 4-bit and int8 weights for any number of rows, bf16 ones up
to ``native.HALF_GEMV_MAX_ROWS`` (the GEMV; past it the loop's GEMM choice stays in Python).
An MoE layer's MLP is kernels/moe_step.py's: the program is run in parts, the router's choice
made in Python between them (``routes``).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from . import int4, moe_step, native, quant

OP_NORM, OP_INT4, OP_INT8, OP_GEMV_BF16, OP_GEMV_F32X, OP_GDN, OP_ATTN, OP_SILU_MUL, OP_INT6 = (
    range(1, 10))
WORDS = 32  # int64 words an operation takes (csrc/step.c OP_WORDS)
# the word of each product operation (``_product``) that holds its row count
ROWS_WORD = {OP_INT4: 6, OP_INT6: 7, OP_INT8: 5, OP_GEMV_BF16: 4, OP_GEMV_F32X: 4}


def _f(x: float) -> int:
    """A float's bits, as csrc/step.c reads a float argument."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class StepProgram:
    """The operations of one step shape over ``fast`` (the backend's ``_FastLayer``s) and
    ``cache`` (its tensors), or ``ValueError`` from the constructor where a product has no
    operation here (a bf16 weight with more rows than the GEMV takes, an unknown weight).
    ``buffers``: the activation buffers, shared by every program of the backend (one step runs
    at a time): ``buffers(name, numel, dtype)`` -> a flat tensor of at least ``numel``."""

    def __init__(self, backend, fast, final_norm, cache, rows: int, L: int, buffers):
        self.rows, self.L = rows, L
        self.cache = cache  # the pools its operations point into
        bf = torch.bfloat16
        D = final_norm[0].shape[0]
        widths = dict(mixer=max(sum(f.mixer_sizes) for f in fast),
                      mlp=max(sum(f.mlp_sizes) for f in fast),
                      act=max(max(f.mixer_sizes[1] if f.gdn is not None
                                   else f.mixer_layer.num_heads * f.mixer_layer.head_dim,
                                   f.mlp_sizes[0], f.moe.intermediate if f.moe else 0)
                               for f in fast))
        # the activations: X the norms' outputs, R the residual (updated in place), H the
        # mixer's and the MLP's outputs, MIX / MLP the merged projections, Y the mixer's
        # output and the MLP's activation
        self.buffers = {name: buffers(name, rows * n, bf)[:rows * n].view(rows, n)
                        for name, n in dict(X=D, R=D, H=D, MIX=widths["mixer"],
                                            MLP=widths["mlp"], Y=widths["act"]).items()}
        xf = rows * max(D, widths["act"])
        self.xf = buffers("XF", xf, torch.float32)[:xf]  # GEMV_F32X's widened x
        X, R, H = (self.buffers[n] for n in "XRH")
        MIX, MLP, Y = (self.buffers[n] for n in ("MIX", "MLP", "Y"))
        ops: list[list[int]] = []
        self.gdn_ops, self.attn_ops = [], []
        self.routes: list[moe_step.MoeRoute] = []  # the MoE layers' (kernels/moe_step.py)
        self.h_at: list[tuple[int, int]] = []  # (op, word) that take the step's hidden states
        B = rows // L
        for i, f in enumerate(fast):
            if i == 0:  # norm(h): the residual is h itself until the first add
                self.h_at.append((len(ops), 1))
                ops.append([OP_NORM, 0, D, 0, X.data_ptr(), 0, f.in_norm.data_ptr(), _f(f.eps),
                            rows, D])
            else:
                ops.append([OP_NORM, H.data_ptr(), D, R.data_ptr(), X.data_ptr(), R.data_ptr(),
                            f.in_norm.data_ptr(), _f(f.eps), rows, D])
            mixer_w = sum(f.mixer_sizes)
            ops.append(self._product(backend, X, D, f.mixer_in, MIX))
            m = f.mixer_layer
            if f.gdn is not None:
                C, Z, Bn, _ = f.mixer_sizes
                taps, neg_exp_a, dt_bias, norm_w = f.gdn
                e = MIX.element_size()
                base = MIX.data_ptr()
                HV, DV = Bn, norm_w.shape[0]
                self.gdn_ops.append(len(ops))
                ops.append([OP_GDN, base, mixer_w, base + C * e, mixer_w,
                            base + (C + Z + Bn) * e, mixer_w, base + (C + Z) * e, mixer_w,
                            taps.data_ptr(), cache.conv_states[m.state_index].data_ptr(),
                            cache.ssm_states[m.state_index].data_ptr(), 0, 0,
                            neg_exp_a.data_ptr(), dt_bias.data_ptr(), norm_w.data_ptr(),
                            _f(m.eps), Y.data_ptr(), B, L, taps.shape[0], m.num_k_heads, HV,
                            m.head_k_dim, DV, 1, int(backend.fused_simd)])
                y_width = HV * DV
            else:
                Q, K_, _ = f.mixer_sizes
                e = MIX.element_size()
                base = MIX.data_ptr()
                kc, vc = cache.key_caches[m.cache_index], cache.value_caches[m.cache_index]
                self.attn_ops.append(len(ops))
                ops.append([OP_ATTN, base, mixer_w, base + Q * e, mixer_w, base + (Q + K_) * e,
                            mixer_w, m.q_norm_weight.data_ptr(), m.k_norm_weight.data_ptr(),
                            _f(m.eps), 0, 0, 0, kc.data_ptr(), vc.data_ptr(), 0, 0, 0, 0,
                            kc.shape[1], _f(m.scale), Y.data_ptr(), B, L, m.num_heads,
                            m.num_kv_heads, m.head_dim, 1, int(kc.dtype == torch.int8),
                            int(backend.fused_simd)])
                y_width = m.num_heads * m.head_dim
            ops.append(self._product(backend, Y, y_width, f.mixer_out, H))
            if i == 0:
                self.h_at.append((len(ops), 3))
                ops.append([OP_NORM, H.data_ptr(), D, 0, X.data_ptr(), R.data_ptr(),
                            f.post_norm.data_ptr(), _f(f.eps), rows, D])
            else:
                ops.append([OP_NORM, H.data_ptr(), D, R.data_ptr(), X.data_ptr(), R.data_ptr(),
                            f.post_norm.data_ptr(), _f(f.eps), rows, D])
            if f.moe is not None:
                self.routes.append(moe_step.layer_ops(self, backend, f, X, H, ops, buffers))
                continue
            ops.append(self._product(backend, X, D, f.mlp_in, MLP))
            I_ = f.mlp_sizes[0]
            mlp_w = sum(f.mlp_sizes)
            ops.append([OP_SILU_MUL, MLP.data_ptr(), mlp_w, MLP.data_ptr() + I_ * 2, mlp_w,
                        Y.data_ptr(), rows, I_, 1])
            ops.append(self._product(backend, Y, I_, f.mlp_out, H))
        w, eps = final_norm
        self.final = len(ops)  # its output: a new tensor each step (the step's hidden states)
        ops.append([OP_NORM, H.data_ptr(), D, R.data_ptr(), 0, R.data_ptr(), w.data_ptr(),
                    _f(eps), rows, D])
        self.D = D
        self.ops = np.zeros((len(ops), WORDS), dtype=np.int64)
        for i, op in enumerate(ops):
            self.ops[i, :len(op)] = op
        self._gdn = np.array(self.gdn_ops, dtype=np.int64)
        self._attn = np.array(self.attn_ops, dtype=np.int64)

    def _product(self, backend, x: torch.Tensor, K: int, w, y: torch.Tensor) -> list[int]:
        """The operation for x W^T into y: x [rows, K] and y [rows, N] contiguous at the start
        of their buffers."""
        M = self.rows
        x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
        if w.shape[1] != K:
            raise ValueError(f"a product of width {K} for a weight {list(w.shape)}")
        if isinstance(w, int4.Int4Weight) and w.bits == 4:
            qs, codes, scales, Kp = w.ptrs()
            return [OP_INT4, x_ptr, qs, codes, scales, y_ptr, M, w.shape[0], w.shape[1], Kp,
                    int4.ISAS[backend.int4_isa]]
        if isinstance(w, int4.Int4Weight) and w.bits == 6:  # a GGUF file's Q6_K layers
            qs, hs, codes, scales, Kp = w.ptrs()
            return [OP_INT6, x_ptr, qs, hs, codes, scales, y_ptr, M, w.shape[0], w.shape[1],
                    Kp, int4.ISAS[backend.int4_isa]]
        if isinstance(w, quant.QuantWeight):
            return [OP_INT8, x_ptr, w.qs.data_ptr(), w.scales.data_ptr(), y_ptr, M, w.shape[0],
                    w.shape[1], w.scales.shape[1] * quant.GROUP, quant.ISAS[backend.int8_isa]]
        if (isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.is_contiguous()
                and M <= native.HALF_GEMV_MAX_ROWS):
            if backend.half_path == "bf16dot":
                return [OP_GEMV_BF16, x_ptr, w.data_ptr(), y_ptr, M, w.shape[0], K]
            return [OP_GEMV_F32X, x_ptr, w.data_ptr(), y_ptr, M, w.shape[0], K,
                    self.xf.data_ptr()]
        raise ValueError(f"no step operation for a {type(w).__name__} product of {M} rows")

    def run(self, h: torch.Tensor, grp, cos, sin, batch) -> torch.Tensor:
        """The step: ``h`` [rows, D] the embedded tokens, ``grp`` the GDN group of the step
        (its slots), ``cos``/``sin`` the RoPE rows, ``batch`` the ForwardBatch (KV slots, block
        tables, lengths) -> the final norm's output [rows, D], a new tensor."""
        ops = self.ops
        h = h.contiguous()
        for i, word in self.h_at:
            ops[i, word] = h.data_ptr()
        if len(self._gdn):
            ops[self._gdn, 12] = grp.slots.data_ptr()
            ops[self._gdn, 13] = _ptr(grp.slots_out)
        if len(self._attn):
            tables = batch.block_tables.contiguous()
            cos, sin = cos.contiguous(), sin.contiguous()
            ops[self._attn, 10] = cos.data_ptr()
            ops[self._attn, 11] = sin.data_ptr()
            ops[self._attn, 12] = cos.shape[-1]
            ops[self._attn, 15] = batch.slot_mapping.data_ptr()
            ops[self._attn, 16] = tables.data_ptr()
            ops[self._attn, 17] = tables.shape[-1]
            ops[self._attn, 18] = batch.seq_lens.data_ptr()
        out = torch.empty(self.rows, self.D, dtype=torch.bfloat16)
        ops[self.final, 4] = out.data_ptr()
        start, chosen = 0, []
        for route in self.routes:  # up to each MoE layer's routing, which Python does
            self._run(start, route.op)
            chosen.append(route.choose(ops))
            start = route.op
        self._run(start, len(ops))
        return out

    def _run(self, start: int, end: int) -> None:
        """Operations ``start`` to ``end`` in one call."""
        ops = self.ops
        failed = native._lib.run_step(ops.ctypes.data + start * WORDS * ops.itemsize,
                                      end - start, torch.get_num_threads())
        if failed:
            i = start + failed - 1
            raise RuntimeError(f"step program: operation {i} (code {int(ops[i, 0])}) failed "
                               f"(out of memory?)")


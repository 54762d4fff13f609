"""An MoE layer's MLP in a step program (kernels/step.py, csrc/step.c ``OP_MOE``): the same
operations as ``kernels/moe.py: sparse_moe`` on the backend's products, so the same bits.

Per MoE layer the program runs, after the post-attention norm: the router's product (logits
[rows, E] in bf16), the shared expert's gate product and the shared expert (gate|up,
silu_mul, down); then it stops, and ``MoeRoute.choose`` makes the router's choice in Python
with the model's own ``route`` (torch's fp32 softmax, ``torch.topk``, the renormalised
weights: transformers' bits, which a softmax of our own could not promise) and the shared
gate's sigmoid; the next part of the program starts with ``OP_MOE``: the chosen experts'
products over their tokens' rows (a table of product operations, one gate|up and one down row
per expert: only the chosen experts' weights are read), the weighted sum in ascending expert
order and the shared expert's share. One return to Python per MoE layer and step.
"""

from __future__ import annotations

import numpy as np
import torch

from . import moe, quant

OP_MOE = 10  # csrc/step.c
TABLE_WORDS = 16  # csrc/step.c: a table row, the word its row count goes in then the operation


def moe_fits(backend, rec) -> bool:
    """Whether the CPU backend's decode loop runs an MoE layer (``MoeRecord``): the router and
    the shared gate bf16, every expert weight on a compiled product (4-bit or int8 with the
    backend's compiled path, or bf16)."""
    small = (rec.router, rec.shared_gate)
    if any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in small):
        return False
    for pair in rec.experts:
        for w in pair:
            if isinstance(w, quant.PackedWeight):
                if backend._quant_isa(w) is None:
                    return False
            elif not (w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous()):
                return False
    return True


class MoeRoute:
    """One MoE layer's routing point in a program: ``op`` the index of its ``OP_MOE``,
    ``logits`` / ``sg`` the buffers the router's and the shared gate's products write."""

    __slots__ = ("op", "k", "logits", "sg", "table")

    def __init__(self, op: int, k: int, logits, sg, table):
        self.op, self.k, self.logits, self.sg, self.table = op, k, logits, sg, table

    def choose(self, ops: np.ndarray) -> tuple:
        """The router's choice of this step into the ``OP_MOE`` operation's words -> the
        tensors they point to (to be kept until it ran)."""
        weights, ids = moe.route(self.logits, self.k)
        sg = torch.sigmoid(self.sg)
        ops[self.op, 4], ops[self.op, 5], ops[self.op, 7] = (
            ids.data_ptr(), weights.data_ptr(), sg.data_ptr())
        return weights, ids, sg


def layer_ops(program, backend, f, X, H, ops: list, buffers) -> MoeRoute:
    """Appends to ``ops`` the MoE MLP of ``f`` (a ``_FastLayer`` with ``moe``) from the norm's
    output X [rows, D] into H [rows, D] -> its routing point. ``ValueError`` where a product
    has no operation (``program._product``)."""
    from . import step  # it builds on this module

    rec, rows, bf = f.moe, program.rows, torch.bfloat16
    E, D, Ie, Is = len(rec.experts), X.shape[1], rec.intermediate, f.mlp_sizes[0]

    def buf(name, n, dtype=bf):
        return buffers(f"MOE_{name}", rows * n, dtype)[:rows * n].view(rows, n)

    logits, sg, shared = buf("LOGITS", E), buf("SG", 1), buf("SHARED", D)
    xe, gu, act, ye = buf("XE", D), buf("GU", 2 * Ie), buf("ACT", Ie), buf("YE", D)
    order = buf("ORDER", rec.top_k, torch.int64)
    MLP, Y = program.buffers["MLP"], program.buffers["Y"]
    ops.append(program._product(backend, X, D, rec.router, logits))
    ops.append(program._product(backend, X, D, rec.shared_gate, sg))
    ops.append(program._product(backend, X, D, f.mlp_in, MLP))
    mlp_w = sum(f.mlp_sizes)
    ops.append([step.OP_SILU_MUL, MLP.data_ptr(), mlp_w, MLP.data_ptr() + Is * 2, mlp_w,
                Y.data_ptr(), rows, Is, 1])
    ops.append(program._product(backend, Y, Is, f.mlp_out, shared))
    table = np.zeros((2 * E, TABLE_WORDS), dtype=np.int64)
    for e, (gate_up, down) in enumerate(rec.experts):
        for j, op in enumerate((program._product(backend, xe, D, gate_up, gu),
                                program._product(backend, act, Ie, down, ye))):
            table[2 * e + j, 0] = step.ROWS_WORD[op[0]]
            table[2 * e + j, 1:1 + len(op)] = op
    route = MoeRoute(len(ops), rec.top_k, logits, sg, table)
    ops.append([OP_MOE, X.data_ptr(), rows, D, 0, 0, rec.top_k, 0, table.ctypes.data, Ie,
                xe.data_ptr(), gu.data_ptr(), act.data_ptr(), ye.data_ptr(), order.data_ptr(),
                shared.data_ptr(), H.data_ptr(), E])
    return route

"""The sparse MoE block that takes the dense MLP's place in every decoder layer of a Qwen3.5
MoE model (``config.num_experts > 0``), in the checkpoint's naming: ``mlp.gate`` (the
router), ``mlp.experts.{e}.gate_up_proj`` / ``down_proj`` (one expert's SwiGLU, gate rows
first), ``mlp.shared_expert`` (a dense SwiGLU) and ``mlp.shared_expert_gate``.

The experts are Linear modules, so they are quantized at load, saved by ``hybridrt quantize``
and laid out by the backend like every other projection; the router and the shared expert's
gate are not (``Projection``): they stay in the model's dtype. The products run through the
backend (``kernels/moe.py: sparse_moe``, over the block's ``record``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrt.config import ModelConfig
from hybridrt.kernels.backend.layers import MoeRecord
from hybridrt.kernels.moe import sparse_moe
from hybridrt.kernels.quant import kernel_weight
from hybridrt.model import _REFERENCE, MLP, Linear, _weights


class Projection(nn.Module):
    """A bias-free projection kept in the model's dtype (never quantized): the router's
    [E, H], the shared expert's gate [1, H]."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.backend = _REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight)


class Expert(nn.Module):
    """One routed expert: gate|up [2I, H] (the gate's I rows first) and down [H, I]."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)


class Experts(nn.ModuleList):
    """The routed experts, in id order; ``spec`` the weights their products read."""

    def __init__(self, config: ModelConfig):
        super().__init__(Expert(config.hidden_size, config.moe_intermediate_size)
                         for _ in range(config.num_experts))
        self._spec = None

    @property
    def spec(self) -> list[tuple[object, object]]:
        """Per expert (gate|up weight, down weight) as the backend takes them (built at the
        first use after the weights were laid out; dropped with the layers' records)."""
        if self._spec is None:
            self._spec = [(kernel_weight(e.gate_up_proj), kernel_weight(e.down_proj))
                          for e in self]
        return self._spec


class SparseMoeBlock(nn.Module):
    """Router softmax top-k over ``num_experts`` experts, their weighted sum, plus the shared
    expert scaled by sigmoid(shared_expert_gate(x)); x [T, H] -> [T, H]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        H = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.gate = Projection(H, config.num_experts)
        self.experts = Experts(config)
        self.shared_expert = MLP(H, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Projection(H, 1)
        self.backend = _REFERENCE

    def record(self) -> MoeRecord:
        """What a backend reads of the block: its weights as they lie now."""
        se = self.shared_expert
        return MoeRecord(self.gate.weight, self.shared_expert_gate.weight, self.top_k,
                         self.experts.spec, _weights((se.gate_proj, se.up_proj)),
                         kernel_weight(se.down_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_moe(x, self.record(), self.backend)

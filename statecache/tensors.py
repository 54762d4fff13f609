"""The cache tensors the model reads and writes: paged KV and GDN state slots."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from hybridrt.config import ModelConfig
from hybridrt.kernels import kvquant
from hybridrt.kernels.memory import advise_huge_pages


def _zeros(*shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor whose memory is taken as it is used: on the CPU, anonymous memory the OS
    maps as zero pages until a page is first written (a cache pool touches what its requests and
    checkpoints use, not its whole budget up front), advised for huge pages; elsewhere
    ``torch.zeros``."""
    if len(shape) == 1 and isinstance(shape[0], tuple):
        shape = shape[0]
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(buf)
    # the tensor keeps the mapping alive (torch.frombuffer holds the buffer)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


@dataclass(slots=True)
class CacheTensors:
    """| tensor | shape | dtype |
    | --- | --- | --- |
    | key_caches[i], value_caches[i] | [num_blocks, block_size, HKV, D] | model |
    | conv_states | [L_gdn, num_slots, K-1, conv_dim] | model |
    | ssm_states | [L_gdn, num_slots, HV, DK, DV] | float32 |
    | key_tails[i], value_tails[i] | [num_slots, block_size, HKV, D] | model |

    With ``kv_dtype=torch.int8`` the KV tensors (caches and tails) are int8 rows of
    ``kvquant.packed_width(D)``: each (token, head) row's codes with its scales beside them, so
    whatever copies a block or a tail copies its scales too.

    ``key_caches[i]`` and ``value_caches[i]`` belong to attention layer i, the i-th
    ``full_attention`` entry of ``layer_types`` (the MTP layers follow the target's); GDN layer
    j is the j-th ``linear_attention`` entry. A slot that holds a prefix-cache checkpoint
    also holds, in ``key_tails`` / ``value_tails``, the KV of the positions after the last full
    block before it (a hit copies them into a block of its own).
    """

    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    conv_states: torch.Tensor
    ssm_states: torch.Tensor
    block_size: int
    key_tails: list[torch.Tensor]
    value_tails: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        num_slots: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        num_extra_attention_layers: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> CacheTensors:
        """``kv_dtype``: the KV tensors' (None: ``dtype``; torch.int8: ``kvquant``'s rows)."""
        if num_blocks <= 0 or num_slots <= 0 or block_size <= 0:
            raise ValueError("num_blocks, num_slots and block_size must be positive")
        n_attn = len(config.full_attention_layers) + num_extra_attention_layers
        n_gdn = len(config.linear_attention_layers)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        width = _kv_width(config, kv_dtype)
        kv_shape = (num_blocks, block_size, config.num_key_value_heads, width)
        tail_shape = (num_slots, block_size, config.num_key_value_heads, width)
        return cls(
            key_caches=[_zeros(kv_shape, dtype=kv_dtype, device=device) for _ in range(n_attn)],
            value_caches=[_zeros(kv_shape, dtype=kv_dtype, device=device)
                          for _ in range(n_attn)],
            conv_states=_zeros(
                n_gdn, num_slots, config.linear_conv_kernel_dim - 1, config.conv_dim,
                dtype=dtype, device=device,
            ),
            ssm_states=_zeros(
                n_gdn, num_slots, config.linear_num_value_heads, config.linear_key_head_dim,
                config.linear_value_head_dim, dtype=torch.float32, device=device,
            ),
            block_size=block_size,
            key_tails=[_zeros(tail_shape, dtype=kv_dtype, device=device)
                       for _ in range(n_attn)],
            value_tails=[_zeros(tail_shape, dtype=kv_dtype, device=device)
                         for _ in range(n_attn)],
        )

    @property
    def num_blocks(self) -> int:
        return self.key_caches[0].shape[0] if self.key_caches else 0

    @property
    def num_slots(self) -> int:
        return self.ssm_states.shape[1]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                        num_extra_attention_layers: int = 0) -> int:
        """A KV block's bytes in every attention layer, ``dtype`` the KV tensors' (int8:
        codes and scales)."""
        n_attn = len(config.full_attention_layers) + num_extra_attention_layers
        elem = torch.empty((), dtype=dtype).element_size()
        return (2 * n_attn * block_size * config.num_key_value_heads
                * _kv_width(config, dtype) * elem)

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype, block_size: int = 16,
                       num_extra_attention_layers: int = 0,
                       kv_dtype: torch.dtype | None = None) -> int:
        """A slot's GDN state and its KV tail (``bytes_per_block`` of one block)."""
        n_gdn = len(config.linear_attention_layers)
        elem = torch.empty((), dtype=dtype).element_size()
        conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * elem
        ssm = (config.linear_num_value_heads * config.linear_key_head_dim
               * config.linear_value_head_dim * 4)
        return n_gdn * (conv + ssm) + CacheTensors.bytes_per_block(
            config, block_size, dtype if kv_dtype is None else kv_dtype,
            num_extra_attention_layers)


def _kv_width(config: ModelConfig, kv_dtype: torch.dtype) -> int:
    """The KV tensors' last dimension: head_dim, or an int8 row's codes and scales."""
    if kv_dtype == torch.int8:
        return kvquant.packed_width(config.head_dim)
    return config.head_dim

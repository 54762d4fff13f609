"""How much context fits in a cache budget: tokens each request can hold when ``concurrency``
requests share it, for a KV dtype (bf16 or int8 rows), from the same per-block and per-slot
bytes the sizing (``plan_cache``) uses."""

from __future__ import annotations

import torch

from hybridrt.config import ModelConfig

from .tensors import CacheTensors


def context_capacity(config: ModelConfig, memory_bytes: int, kv_dtype: torch.dtype,
                     concurrency: int = 1, dtype: torch.dtype = torch.bfloat16,
                     block_size: int = 16, num_extra_attention_layers: int = 0,
                     slots_per_request: int = 1) -> int:
    """Tokens of context each of ``concurrency`` requests holds at once in ``memory_bytes``:
    their state slots (and the null slot) first, then the KV blocks shared evenly, whole
    blocks only; 0 where the slots alone do not fit (a model without attention layers holds
    no KV: ``max_position_embeddings`` where they fit)."""
    if concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    per_block = CacheTensors.bytes_per_block(config, block_size, kv_dtype,
                                             num_extra_attention_layers)
    per_slot = CacheTensors.bytes_per_slot(config, dtype, block_size, num_extra_attention_layers,
                                           kv_dtype)
    room = memory_bytes - (1 + concurrency * slots_per_request) * per_slot
    if not per_block:  # no attention layer: no KV to hold, only the slots must fit
        return 0 if room < 0 else config.max_position_embeddings
    return max(0, room // per_block // concurrency * block_size)


def capacity_lines(config: ModelConfig, memory_bytes: int, concurrencies=(1, 4),
                   **kw) -> list[str]:
    """One line per KV dtype: the tokens per request at each concurrency, and a token's KV
    bytes."""
    lines = []
    for name, dt in (("bf16", torch.bfloat16), ("int8", torch.int8)):
        per_token = CacheTensors.bytes_per_block(
            config, 1, dt, kw.get("num_extra_attention_layers", 0))
        fits = ", ".join(f"{n} request(s): {context_capacity(config, memory_bytes, dt, n, **kw)}"
                         for n in concurrencies)
        lines.append(f"{name} KV ({per_token} bytes/token) in {memory_bytes / 2**30:.2f} GiB: "
                     f"tokens per request at {fits}")
    return lines

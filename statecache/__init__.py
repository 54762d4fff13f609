"""Cache stores for hybrid models: paged KV blocks for attention layers and fixed-size state
slots (conv + recurrent) for GDN layers, owned by one manager with one memory budget."""

from .manager import (
    Admitted,
    CacheCapacityError,
    CacheSizing,
    CacheUsage,
    HybridCacheManager,
    available_memory,
    plan_cache,
)
from .pools import BlockPool, SlotPool
from .tensors import CacheTensors

__all__ = [
    "Admitted",
    "BlockPool",
    "CacheCapacityError",
    "CacheSizing",
    "CacheUsage",
    "CacheTensors",
    "HybridCacheManager",
    "SlotPool",
    "available_memory",
    "plan_cache",
]

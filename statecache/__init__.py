"""Cache stores for hybrid models: paged KV blocks for attention layers and fixed-size state
slots (conv + recurrent) for GDN layers."""

from .tensors import CacheTensors

__all__ = ["CacheTensors"]

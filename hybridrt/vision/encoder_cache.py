"""Recent images' encoder outputs, bounded in bytes, least recently used out first.

Keyed by an image's content digest (``ImageItem.digest``: a sha256 of the preprocessed pixels
and the grid), so the same image in a prompt whose text before it differs (which the prefix
cache cannot serve) skips the encoder, and another image of the same size never hits. vLLM
keeps such a cache too (``mm_processor_cache_gb``). ``LLM(encoder_cache_memory=...)`` sizes it;
0 keeps nothing.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import TYPE_CHECKING

from hybridrt.options import parse_memory

if TYPE_CHECKING:
    import torch


class EncoderCache:
    """digest -> merged embeddings [image tokens, hidden], at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int = 0):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: bytes) -> torch.Tensor | None:
        """The image's embeddings (now the most recently used), or None."""
        embeds = self._items.get(digest)
        if embeds is not None:
            self._items.move_to_end(digest)
        return embeds

    def put(self, digest: bytes, embeds: torch.Tensor) -> None:
        """Keep ``embeds`` (a tensor of its own storage), the least recently used out until it
        fits; one larger than the whole cache is not kept."""
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes or digest in self._items:
            return
        while self.num_bytes + size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
        self._items[digest] = embeds
        self.num_bytes += size


def parse_cache_bytes(value) -> int:
    """``encoder_cache_memory``: 0 (none), bytes, or a size such as '256MiB' -> bytes."""
    size = None
    if not isinstance(value, (bool, float)):
        if value == 0 or str(value).strip() == "0":
            return 0
        with contextlib.suppress(ValueError):
            size = parse_memory(value)[0]
    if size is None:
        raise ValueError(f"encoder_cache_memory must be 0, bytes or a size such as '256MiB', "
                         f"got {value!r}")
    return size

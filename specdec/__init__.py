"""Speculative decoding: the MTP proposer, draft verification and acceptance statistics."""

from .stats import SpecStats

__all__ = ["SpecStats"]

"""The speculative methods (``speculative_method``): where drafts come from; light, so that
options are checked before torch loads."""

from __future__ import annotations

METHODS = ("mtp", "ngram", "mtp+ngram")


def check_method(method: str) -> str:
    """``method`` if it is one of ``METHODS``; else ValueError naming them."""
    if method not in METHODS:
        raise ValueError(f"speculative_method must be one of {', '.join(METHODS)}, "
                         f"got {method!r}")
    return method


def uses_mtp(method: str) -> bool:
    """Whether ``method``'s drafts need the checkpoint's MTP layer."""
    return "mtp" in method.split("+")

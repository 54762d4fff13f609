"""Incremental detokenization: a request's text grows by each new token's piece.

Decoding the whole output again for every new token costs time linear in the output, quadratic
over a request. Instead each token decodes a short window, as vLLM and transformers'
``TextStreamer`` do: the tokens not yet turned into text (from ``read_offset``), after the tokens
of the last piece (from ``prefix_offset``) as context, so that tokenizers whose decoding of a
token depends on its neighbours (leading spaces, cleanup) produce what a one-shot decode would.
The new text is what the window decodes to beyond its context.

A token that ends inside a multi-byte character (byte-level BPE splits them) decodes to U+FFFD
at the end of the window: its text is held back until the character is complete, or until the
request ends, when whatever is held back is emitted as it decodes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """The text of one token stream, built piece by piece.

    ``tokenizer``: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # decoded text of token_ids[:read_offset]
        self.prefix_offset = 0  # start of the context tokens of the next window
        self.read_offset = 0  # tokens before this are in ``text``

    def add(self, token_id: int, final: bool = False) -> str:
        """Append a token -> the text it adds ("" while a character is incomplete).
        ``final``: the stream ends with this token (nothing is held back)."""
        self.token_ids.append(token_id)
        return self._advance(final)

    def flush(self) -> str:
        """End the stream without another token -> the text held back, as it decodes."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        context = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset:])
        if not final and (len(window) <= len(context) or window.endswith("\ufffd")):
            return ""
        piece = window[len(context):]
        self.text += piece
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return piece

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

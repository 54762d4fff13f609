"""The tokenizer and chat template of a GGUF file, from ``tokenizer.ggml.*`` and
``tokenizer.chat_template`` alone: a byte-level BPE (``tokenizer.ggml.model`` "gpt2") built by
the ``tokenizers`` library from the file's vocabulary and merges, with the pre-tokenizer that
``tokenizer.ggml.pre`` names (Qwen's regexes, as llama.cpp's llama-vocab.cpp keeps them), and
the token types' control / user-defined tokens as special / added tokens. The result is a
``hybridrt.tokenizer.Tokenizer``: the same methods and the same ids as the original
tokenizer.json (tests/test_gguf.py compares them)."""

from __future__ import annotations

import os
from pathlib import Path

from hybridrt.gguf.reader import GGUFError, GGUFFile
from hybridrt.tokenizer import Tokenizer

# tokenizer.ggml.pre -> the split regex of the original tokenizer.json
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}"
           r"\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"qwen2": _QWEN2, "qwen35": _QWEN35}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def build_backend(f: GGUFFile):
    """The ``tokenizers.Tokenizer`` of ``f``'s vocabulary."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{f.path}: tokenizer.ggml.model {kind!r} is not one hybridrt rebuilds "
                        f"(it rebuilds 'gpt2', byte-level BPE)")
    pre = f.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{f.path}: tokenizer.ggml.pre {pre!r} is not one hybridrt rebuilds "
                        f"(it rebuilds {', '.join(PRE_TOKENIZERS)})")
    tokens = list(f.get("tokenizer.ggml.tokens") or [])
    types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                 fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k == _CONTROL]
    added = [AddedToken(t, special=False, normalized=False)
             for t, k in zip(tokens, types) if k == _USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(added)
    return backend


class GGUFTokenizer(Tokenizer):
    """``Tokenizer`` of a GGUF file: the backend from ``build_backend``, the chat template
    (``tokenizer.chat_template``, named ones from ``tokenizer.chat_template.<name>``) and
    the special tokens from their ids."""

    def __init__(self, f: GGUFFile):
        self.path = f.path
        self._backend = build_backend(f)
        tokens = f.get("tokenizer.ggml.tokens") or []
        named = {k.removeprefix("tokenizer.chat_template."): v for k, v in f.metadata.items()
                 if k.startswith("tokenizer.chat_template.")}
        default = f.get("tokenizer.chat_template")
        self.chat_template = ({"default": default, **named} if named and default else
                              named or default)
        self.clean_up_tokenization_spaces = False
        self._bpe_keeps_spaces = True
        self.special_tokens_map = {}
        for field, key in (("eos_token", "eos_token_id"), ("pad_token", "padding_token_id"),
                           ("bos_token", "bos_token_id"), ("unk_token", "unknown_token_id")):
            tid = f.get(f"tokenizer.ggml.{key}")
            if tid is not None and 0 <= int(tid) < len(tokens):
                self.special_tokens_map[field] = tokens[int(tid)]
        self._add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False)) and \
            "bos_token" in self.special_tokens_map
        self._hf = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def hf(self):
        """transformers' ``PreTrainedTokenizerFast`` over the same backend."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast(tokenizer_object=self._backend,
                                               **self.special_tokens_map)
            if self.chat_template is not None:
                self._hf.chat_template = self.chat_template
        return self._hf


def load_gguf_tokenizer(path: str | os.PathLike) -> GGUFTokenizer:
    return GGUFTokenizer(GGUFFile(Path(path)))

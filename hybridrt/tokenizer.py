"""A checkpoint's tokenizer without transformers: ``tokenizer.json`` through the ``tokenizers``
library and the chat template through jinja2, computing what transformers'
``PreTrainedTokenizerFast`` and its ``apply_chat_template`` compute (tests/test_tokenizer.py holds
the two side by side).

Importing transformers costs about a second and a half of start-up (its import-structure scan),
more than the rest of loading a small model; the tokenizer itself is a ``tokenizer.json`` that the
``tokenizers`` library reads in milliseconds. transformers is still imported where a library needs
its tokenizer object (the grammar engine's ``TokenizerInfo.from_huggingface``): ``hf()``, once.

Checkpoints without a ``tokenizer.json`` (only a slow tokenizer's vocabulary files) load through
transformers' ``AutoTokenizer`` (``load_tokenizer``).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "apply_chat_template", "load_tokenizer"]

# tokenizer_config.json's special-token fields, passed to the chat template by name (as
# transformers' ``special_tokens_map`` is)
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")
# the names a message's reasoning is passed under; templates read the first
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def load_tokenizer(model_path: str | os.PathLike):
    """The checkpoint directory's tokenizer: a ``Tokenizer`` where it has a ``tokenizer.json``,
    else transformers' ``AutoTokenizer``; None if it has no tokenizer files. A GGUF file: the
    tokenizer its metadata holds (``hybridrt.gguf.tokenizer``)."""
    path = Path(model_path)
    if path.is_file():
        from hybridrt.gguf.tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if (path / "tokenizer.json").is_file():
        return Tokenizer(path)
    if not any((path / f).is_file() for f in ("tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    # hybridrt checks prompt lengths against max_model_len itself: transformers' "Token indices
    # sequence length is longer than the specified maximum" would only add a confusing line
    warned = getattr(tok, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tok


def apply_chat_template(tokenizer, conversation: list[dict], chat_template_kwargs=None,
                        add_generation_prompt: bool = True) -> str:
    """The conversation as text through ``tokenizer``'s chat template (any tokenizer with
    transformers' ``apply_chat_template``)."""
    return tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
        **(chat_template_kwargs or {}),
    )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(path: Path, config: dict) -> str | dict | None:
    """The chat template: ``chat_template.jinja``, ``chat_template.json`` or the config's field
    (transformers' order of precedence)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    js = path / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text(encoding="utf-8")).get("chat_template")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in template}
    return template


class Tokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` of a checkpoint directory.

    The methods hybridrt uses of a Hugging Face tokenizer, with the same results: ``encode``,
    ``decode``, ``convert_tokens_to_ids``, ``apply_chat_template``, the special tokens and their
    ids, ``len()``.
    """

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as _Backend

        self.path = Path(path)
        self._backend = _Backend.from_file(str(self.path / "tokenizer.json"))
        cfg_file = self.path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        self.chat_template = _read_chat_template(self.path, config)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces",
                                                            False))
        self._bpe_keeps_spaces = type(self._backend.model).__name__ == "BPE" and not config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        self.special_tokens_map = {k: t for k in _SPECIAL
                                   if (t := _token_text(config.get(k))) is not None}
        self._hf = None

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` itself (transformers' name for it): its
        ``encode_batch`` releases the GIL, which the server's encoding relies on."""
        return self._backend

    # Special tokens ------------------------------------------------------------------------
    def __getattr__(self, name: str):
        # eos_token, pad_token, ... and their ids (None where the checkpoint has none)
        if name in _SPECIAL:
            return self.special_tokens_map.get(name)
        if name.endswith("_id") and name[:-3] in _SPECIAL:
            token = self.special_tokens_map.get(name[:-3])
            return None if token is None else self._backend.token_to_id(token)
        raise AttributeError(name)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without added tokens (transformers' ``vocab_size``)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of one token string; the unknown token's id (None without one) if it has
        none."""
        tid = self._backend.token_to_id(token)
        return self.unk_token_id if tid is None else tid

    # Text <-> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """The text of ``token_ids`` (``clean_up_tokenization_spaces``: None takes the
        tokenizer's own setting, as transformers does)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        # transformers skips the clean-up (made for WordPiece) on BPE models unless forced
        if clean_up_tokenization_spaces and not self._bpe_keeps_spaces:
            text = _clean_up_tokenization(text)
        return text

    # Chat ----------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None,
                            chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs) -> str | list[int]:
        """The conversation rendered by the checkpoint's chat template (jinja2, sandboxed, with
        the globals and filters transformers gives templates) -> the text, or its ids with
        ``tokenize=True``."""
        template = self._template(chat_template, tools)
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at "
                             "least one message.")
        messages = []
        for message in conversation:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, got {message!r}.")
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS
                              if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            messages.append(message)
        text = _compile(template).render(
            messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, chat_template: str | None, tools) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            if chat_template in template:
                return template[chat_template]
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            template = template.get(name)
        elif chat_template is not None:
            return chat_template
        if not template:
            raise ValueError(f"the tokenizer at {self.path} has no chat template: pass a prompt "
                             f"instead of messages")
        return template

    # transformers, where a library needs its object ----------------------------------------
    def hf(self):
        """transformers' ``PreTrainedTokenizerFast`` of the same files (imported and loaded on
        first use)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast.from_pretrained(str(self.path))
        return self._hf


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: spaces before punctuation and contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                 (" 're", "'re")):
        text = text.replace(a, b)
    return text


@lru_cache(maxsize=16)
def _compile(template: str):
    """A chat template compiled as transformers compiles it: a sandboxed environment with
    ``trim_blocks``, ``lstrip_blocks``, loop controls, a ``tojson`` that does not escape HTML,
    ``raise_exception`` and ``strftime_now``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)

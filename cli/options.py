"""The model / engine option group: MODEL and the flags that say how the engine loads and runs
it, declared once here (flag, help text, default) as the fields of ``ModelOptions``.

``@model_options()`` gives a command every flag of the group for its ``options: ModelOptions``
parameter and hands it the one object built from them; ``options.llm_kwargs()``
is the ``LLM(...)`` keyword arguments they stand for. chat, generate and serve take the whole
group; the bench commands take the single aliases below for the flags their benchmark honours.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Annotated

import typer

from hybridrt.cli.common import check_draft_vocab, check_model_options

# Every option's help states its default: typer prints "[default: ...]" where the default is a
# value, and options whose default is decided later (None) say it in their help text.
ModelArg = Annotated[str | None, typer.Argument(
    metavar="MODEL", show_default=False,
    help="Local checkpoint directory or Hugging Face id (default: the embedded demo model).")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", help="auto (the checkpoint's dtype: bfloat16 for Qwen3.5 and the demo model), "
    "bfloat16, float16 or float32.")]
MaxModelLenOpt = Annotated[int | None, typer.Option(
    "--max-model-len", help="Context length (prompt + answer) (default: min(the model's, "
    "4096)).", show_default=False)]
MaxNumSeqsOpt = Annotated[int, typer.Option(
    "--max-num-seqs", min=1, help="Requests running at once.")]
MaxNumBatchedTokensOpt = Annotated[int | None, typer.Option(
    "--max-num-batched-tokens", min=1, help="Tokens per engine step (default: the "
    "engine's).", show_default=False)]
CacheMemoryOpt = Annotated[str | None, typer.Option(
    "--cache-memory", help="KV + state cache budget: bytes, a fraction of free memory or a "
    "size such as 2GiB (default: 0.3).", show_default=False)]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", min=1, help="CPU threads for torch (default: up to the number of physical "
    "cores, fewer while other processes keep cores busy).", show_default=False)]
QuantizationOpt = Annotated[str | None, typer.Option(
    "--quantization", help="int8: weights quantized to int8 at load time, one scale per 32 "
    "inputs (CPU; about half the memory of bfloat16, faster decoding); int4: 4-bit weights "
    "(the embedding / LM head in 6 bits; about a third) (default: none).",
    show_default=False)]
SpecOpt = Annotated[int, typer.Option(
    "--speculative-tokens", "-k", help="MTP draft tokens per step (0 = off).", min=0)]
DraftVocabOpt = Annotated[int | None, typer.Option(
    "--draft-vocab", help="With -k: the MTP drafts from the N most frequent tokens only (the "
    "model's draft_vocab.json, else the first N ids); outputs are unchanged (default: the "
    "whole vocabulary).", show_default=False)]
PrefixCachingOpt = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching", help="Reuse the longest cached prefix of every "
    "prompt (KV blocks and GDN state checkpoints; the output is the one a cold run gives).")]
BatchInvariantOpt = Annotated[bool, typer.Option(
    "--batch-invariant", help="Each request's tokens and logprobs bit for bit the same "
    "whatever runs beside it, however its prompt is chunked, and with greedy -k on or off "
    "(slower prefill, docs/batch_invariance.md) (default: off).")]


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """MODEL and the engine options, as given on the command line. The fields but ``model``
    are named as ``LLM``'s keyword arguments; each field's annotation is its flag."""

    model: ModelArg = None
    dtype: DtypeOpt = "auto"
    max_model_len: MaxModelLenOpt = None
    max_num_seqs: MaxNumSeqsOpt = 32
    max_num_batched_tokens: MaxNumBatchedTokensOpt = None
    cache_memory: CacheMemoryOpt = None
    device: DeviceOpt = "cpu"
    threads: ThreadsOpt = None
    quantization: QuantizationOpt = None
    speculative_tokens: SpecOpt = 0
    draft_vocab_size: DraftVocabOpt = None
    enable_prefix_caching: PrefixCachingOpt = True
    batch_invariant: BatchInvariantOpt = False

    def checked(self) -> ModelOptions:
        """Option mistakes -> CliError (exit 2), before anything imports torch; -> these
        options with the dtype spelled as LLM takes it."""
        dtype = check_model_options(dtype=self.dtype, max_model_len=self.max_model_len,
                                    cache_memory=self.cache_memory, device=self.device,
                                    quantization=self.quantization,
                                    batch_invariant=self.batch_invariant)
        check_draft_vocab(self.draft_vocab_size, self.speculative_tokens)
        return dataclasses.replace(self, dtype=dtype)

    def llm_kwargs(self) -> dict[str, typing.Any]:
        """The ``LLM(model, **kwargs)`` keyword arguments these options stand for."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "model"}


def _group_parameters(defaults: dict[str, typing.Any]) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(ModelOptions, include_extras=True)
    unknown = set(defaults) - set(hints)
    if unknown:
        raise TypeError(f"not options of the group: {', '.join(sorted(unknown))}")
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                              default=defaults.get(f.name, f.default))
            for f in dataclasses.fields(ModelOptions)]


def model_options(**defaults: typing.Any):
    """Decorator: the command's ``options: ModelOptions`` parameter becomes the group's flags
    (listed in --help after the command's own options), and the command is called with the
    ModelOptions built from them. ``defaults``: this command's own default for a field (e.g.
    chat's max_num_seqs)."""
    group = _group_parameters(defaults)
    names = [p.name for p in group]

    def add(command):
        own = inspect.signature(command).parameters
        if "options" not in own:
            raise TypeError(f"{command.__name__} has no 'options' parameter")
        hints = typing.get_type_hints(command, localns={"ModelOptions": ModelOptions},
                                      include_extras=True)
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name])
                  for p in own.values() if p.name != "options"] + group

        @functools.wraps(command)
        def run(**kwargs):
            options = ModelOptions(**{name: kwargs.pop(name) for name in names})
            return command(options=options, **kwargs)

        run.__signature__ = inspect.Signature(params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return add

"""The model / engine option group: MODEL and the flags that say how the engine loads and runs
it, declared once here (flag, help text, default) as the fields of ``ModelOptions``.

``@model_options()`` gives a command every flag of the group for its ``options: ModelOptions``
parameter and hands it the one object built from them; ``options.llm_kwargs()``
is the ``LLM(...)`` keyword arguments they stand for. chat, generate and serve take the whole
group, and so does every ``hybridrt bench`` command that loads a model: a flag its benchmark
must set itself is refused there (``refuse=``), with one error line, when given.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from typing import Annotated

import typer

from hybridrt.cli.common import CliError, check_draft_vocab, check_model_options
from hybridrt.engine_args import check_mmproj, check_speculation, check_vision_quantization
from hybridrt.options import KV_CACHE_DTYPES
from hybridrt.vision.encoder_cache import parse_cache_bytes
from hybridrt.vision.inputs import parse_mm_limits

BACKENDS = ("reference", "cpu", "cuda", "triton")  # kernels/backend/select.py's names

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
SpecMethodOpt = Annotated[str, typer.Option(
    "--speculative-method", help="With -k: where drafts come from: mtp (the checkpoint's MTP "
    "layer), ngram (prompt lookup in the request's own tokens; no MTP layer needed) or "
    "mtp+ngram (a lookup match extended by the MTP).")]
SpecAdaptiveOpt = Annotated[bool, typer.Option(
    "--speculative-adaptive/--no-speculative-adaptive", help="With -k: k is the maximum; each "
    "step a request drafts what its measured acceptance and the step's cost make pay (0 when "
    "nothing does).")]
PromptLookupMinOpt = Annotated[int, typer.Option(
    "--prompt-lookup-min", min=1, help="ngram drafts: the shortest context suffix matched.")]
PromptLookupMaxOpt = Annotated[int, typer.Option(
    "--prompt-lookup-max", min=1, help="ngram drafts: the longest context suffix matched.")]
PrefixCachingOpt = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching", help="Reuse the longest cached prefix of every "
    "prompt (KV blocks and GDN state checkpoints; the output is the one a cold run gives).")]
BatchInvariantOpt = Annotated[bool, typer.Option(
    "--batch-invariant", help="Each request's tokens and logprobs bit for bit the same "
    "whatever runs beside it, however its prompt is chunked, and with greedy -k on or off "
    "(slower prefill, docs/batch_invariance.md) (default: off).")]
BlockSizeOpt = Annotated[int, typer.Option(
    "--block-size", min=1, help="Tokens per KV cache block (the prefix cache's unit).")]
BackendOpt = Annotated[str | None, typer.Option(
    "--backend", help=f"Kernels: {', '.join(BACKENDS)} (triton: the CUDA kernels without CUDA "
    "graphs) (default: the device's, cpu or cuda).", show_default=False)]
AsyncSchedulingOpt = Annotated[bool | None, typer.Option(
    "--async-scheduling/--no-async-scheduling", help="Launch a decode step before the "
    "previous step's tokens reach the host (the same tokens) (default: on for CUDA, off on "
    "CPU).", show_default=False)]
CheckpointIntervalOpt = Annotated[int, typer.Option(
    "--checkpoint-interval", min=0, help="With prefix caching: save the GDN state every N "
    "prompt tokens too (0: only at message starts, a prompt's last token and a request's "
    "end).")]
CheckpointShareOpt = Annotated[float, typer.Option(
    "--checkpoint-share", min=0.0, max=0.999, help="The share of --cache-memory for GDN "
    "state checkpoints beyond the requests' own slots, in [0, 1).")]
PrefixCacheDirOpt = Annotated[str | None, typer.Option(
    "--prefix-cache-dir", help="The prefix cache's disk tier: evicted checkpoints and KV "
    "blocks and the end of every request kept in this directory and restored from it, also "
    "after a restart (default: none).", show_default=False)]
PrefixCacheDirSizeOpt = Annotated[str, typer.Option(
    "--prefix-cache-dir-size", help="The most the --prefix-cache-dir files take (least "
    "recently used go first).")]
MaxNumSessionsOpt = Annotated[int, typer.Option(
    "--max-num-sessions", min=0, help="Sessions open at once (each pins the prefix cache's "
    "hold on its conversation).")]
LanguageModelOnlyOpt = Annotated[bool, typer.Option(
    "--language-model-only", help="Do not load the checkpoint's vision tower (its memory "
    "saved; images refused) (default: loaded where the checkpoint has one).")]
HfOverridesOpt = Annotated[str | None, typer.Option(
    "--hf-overrides", help="config.json entries replaced, a JSON object as vLLM's (YaRN: "
    "docs/long_context.md) (default: none).", show_default=False)]
KvCacheDtypeOpt = Annotated[str, typer.Option(
    "--kv-cache-dtype", help="auto (the model's dtype), bf16 or int8 (one scale per 32 values, "
    "about 1.8x the tokens of bf16 in the same memory; CPU).")]
MmprojOpt = Annotated[str | None, typer.Option(
    "--mmproj", help="A GGUF model's vision projector file (llama.cpp's mmproj) (default: a "
    "*mmproj*.gguf file beside the model, as llama-server picks one; docs/gguf.md).",
    show_default=False)]
VisionQuantizationOpt = Annotated[str | None, typer.Option(
    "--vision-quantization", help="int8: the vision tower's linear weights quantized to int8 "
    "at load time (CPU; docs/vision.md) (default: none, the tower in --dtype).",
    show_default=False)]
LimitMmOpt = Annotated[str | None, typer.Option(
    "--limit-mm-per-prompt", help="The most images and videos one prompt may hold, vLLM's JSON, "
    "e.g. '{\"image\": 4, \"video\": 1}'; a prompt with more fails (default: no limit).",
    show_default=False)]
VideoFpsOpt = Annotated[float, typer.Option(
    "--video-fps", help="Frames a second sampled from a video file (at least 4 a video, as the "
    "Qwen3-VL processor samples; docs/vision.md).")]
VideoMaxFramesOpt = Annotated[int, typer.Option(
    "--video-max-frames", min=1, help="The most frames of one video: a file's sampling stops "
    "there, a video given as more frames fails.")]
EncoderCacheMemoryOpt = Annotated[str, typer.Option(
    "--encoder-cache-memory", help="The most memory for recent images' and videos' encoder "
    "outputs, kept by their content so that the same image or video in another prompt skips "
    "the encoder (bytes or a size such as 256MiB; 0: none).")]
EngineSeedOpt = Annotated[int, typer.Option(
    "--engine-seed", help="Seed of the engine's generator, which samples every request "
    "without a --seed of its own.")]


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """MODEL and the engine options, as given on the command line. The fields but ``model``
    are ``LLM``'s keyword arguments (named as those, but for ``LLM_NAMES``); each field's
    annotation is its flag."""

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
    speculative_method: SpecMethodOpt = "mtp"
    speculative_adaptive: SpecAdaptiveOpt = False
    prompt_lookup_min: PromptLookupMinOpt = 2
    prompt_lookup_max: PromptLookupMaxOpt = 4
    enable_prefix_caching: PrefixCachingOpt = True
    batch_invariant: BatchInvariantOpt = False
    block_size: BlockSizeOpt = 16
    backend: BackendOpt = None
    async_scheduling: AsyncSchedulingOpt = None
    checkpoint_interval: CheckpointIntervalOpt = 2048
    checkpoint_share: CheckpointShareOpt = 0.25
    prefix_cache_dir: PrefixCacheDirOpt = None
    prefix_cache_dir_size: PrefixCacheDirSizeOpt = "16GiB"
    max_num_sessions: MaxNumSessionsOpt = 64
    language_model_only: LanguageModelOnlyOpt = False
    hf_overrides: HfOverridesOpt = None
    engine_seed: EngineSeedOpt = 0
    kv_cache_dtype: KvCacheDtypeOpt = "auto"
    mmproj: MmprojOpt = None
    vision_quantization: VisionQuantizationOpt = None
    limit_mm_per_prompt: LimitMmOpt = None
    video_fps: VideoFpsOpt = 2.0
    video_max_frames: VideoMaxFramesOpt = 32
    encoder_cache_memory: EncoderCacheMemoryOpt = "256MiB"

    # a field named otherwise than LLM's keyword argument: engine_seed, since chat's and
    # generate's --seed is the per-request one (SamplingParams.seed)
    LLM_NAMES: typing.ClassVar[dict[str, str]] = {"engine_seed": "seed"}

    def checked(self) -> ModelOptions:
        """Option mistakes -> CliError (exit 2), before anything imports torch; -> these
        options with the dtype spelled as LLM takes it."""
        dtype = check_model_options(dtype=self.dtype, max_model_len=self.max_model_len,
                                    cache_memory=self.cache_memory, device=self.device,
                                    quantization=self.quantization,
                                    batch_invariant=self.batch_invariant)
        check_draft_vocab(self.draft_vocab_size, self.speculative_tokens)
        try:
            check_speculation(self)
            check_mmproj(self.model, self.mmproj)
            parse_mm_limits(self.limit_mm_per_prompt)
            parse_cache_bytes(self.encoder_cache_memory)
        except ValueError as e:
            raise CliError(f"{e}", 2) from None
        try:
            if check_vision_quantization(self.vision_quantization) and self.device != "cpu":
                raise ValueError(f"it runs on the CPU only, not --device {self.device}")
        except ValueError as e:
            raise CliError(f"--vision-quantization: {e}", 2) from None
        if not self.video_fps > 0:
            raise CliError(f"--video-fps must be positive, got {self.video_fps}", 2)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise CliError(f"--kv-cache-dtype: unknown dtype {self.kv_cache_dtype!r}; choose "
                           f"one of {', '.join(KV_CACHE_DTYPES)}", 2)
        if self.backend is not None and self.backend not in BACKENDS:
            raise CliError(f"--backend: unknown backend {self.backend!r}; choose one of "
                           f"{', '.join(BACKENDS)}", 2)
        return dataclasses.replace(self, dtype=dtype)

    def llm_kwargs(self, *without: str) -> dict[str, typing.Any]:
        """The ``LLM(model, **kwargs)`` keyword arguments these options stand for, but the
        fields ``without`` (those a benchmark sets itself)."""
        return {self.LLM_NAMES.get(f.name, f.name): getattr(self, f.name)
                for f in dataclasses.fields(self) if f.name != "model" and f.name not in without}

    def flags(self, *without: str) -> list[str]:
        """These options as another command's arguments (``hybridrt serve`` / ``generate``
        run by a benchmark): the flags of the fields that differ from the group's default,
        but the fields ``without``."""
        hints = typing.get_type_hints(ModelOptions, include_extras=True)
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "model" or f.name in without or value == f.default:
                continue
            on, _, off = typing.get_args(hints[f.name])[1].default.partition("/")
            out += ([on if value else off] if isinstance(value, bool) else [on, str(value)])
        return out


_CTX = "model_options_context"  # the click context, which says where each value came from
REFUSED = "Not taken by this command: {reason} (default: the command's own)."


def _refused(annotation, reason: str):
    """The field's flag, its help saying why this command refuses it."""
    base, info = typing.get_args(annotation)
    info = copy.copy(info)
    info.help, info.show_default = REFUSED.format(reason=reason), False
    return Annotated[base, info]


def without_default_text(text: str) -> str:
    """A help text less its closing "(default: ...)", which a command's own default
    replaces."""
    cut = text.rfind(" (default:")
    return text[:cut] + "." if cut >= 0 and text.endswith(").") else text


def _own_help(annotation, help_text: str | None = None, default: typing.Any = None):
    """The field's flag with this command's help (``help_text``) or its own default shown."""
    base, info = typing.get_args(annotation)
    info = copy.copy(info)
    if help_text is not None:
        info.help = help_text
    else:
        info.help, info.show_default = without_default_text(info.help), True
    return Annotated[base, info]


def _group_parameters(defaults: dict[str, typing.Any], refuse: dict[str, str],
                      model_help: str | None) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(ModelOptions, include_extras=True)
    unknown = (set(defaults) | set(refuse)) - {f.name for f in dataclasses.fields(ModelOptions)}
    if unknown:
        raise TypeError(f"not options of the group: {', '.join(sorted(unknown))}")
    params = []
    for f in dataclasses.fields(ModelOptions):
        annotation = hints[f.name]
        if f.name in refuse:
            annotation = _refused(annotation, refuse[f.name])
        elif f.name == "model" and model_help is not None:
            annotation = _own_help(annotation, model_help)
        elif defaults.get(f.name, f.default) != f.default:
            annotation = _own_help(annotation)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                        default=defaults.get(f.name, f.default),
                                        annotation=annotation))
    return params


def _declaration(field: str) -> str:
    """The group field's flag as declared, e.g. '--prefix-caching/--no-prefix-caching'."""
    return typing.get_args(typing.get_type_hints(ModelOptions, include_extras=True)[field])[
        1].default


def _check_refused(ctx: typer.Context, refuse: dict[str, str]) -> None:
    """A refused flag given on the command line -> CliError (exit 2)."""
    for field, reason in refuse.items():
        source = ctx.get_parameter_source(field)
        if source is not None and source.name != "DEFAULT":
            raise CliError(f"{_declaration(field)} is not taken by "
                           f"{ctx.command_path.split(' ', 1)[-1]}: {reason}", 2)


def model_options(*, refuse: dict[str, str] | None = None, model_help: str | None = None,
                  **defaults: typing.Any):
    """Decorator: the command's ``options: ModelOptions`` parameter becomes the group's flags
    (listed in --help after the command's own options), and the command is called with the
    ModelOptions built from them. ``defaults``: this command's own default for a field (e.g.
    chat's max_num_seqs). ``refuse``: field -> why this command cannot take it (it sets that
    itself); the flag still exists, and giving it is one error line (exit 2). ``model_help``:
    MODEL's help where this command's default model is another."""
    refuse = dict(refuse or {})
    group = _group_parameters(defaults, refuse, model_help)
    names = [p.name for p in group]

    def add(command):
        own = inspect.signature(command).parameters
        if "options" not in own:
            raise TypeError(f"{command.__name__} has no 'options' parameter")
        hints = typing.get_type_hints(command, localns={"ModelOptions": ModelOptions},
                                      include_extras=True)
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name])
                  for p in own.values() if p.name != "options"] + group + [
            inspect.Parameter(_CTX, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]

        @functools.wraps(command)
        def run(**kwargs):
            _check_refused(kwargs.pop(_CTX), refuse)
            options = ModelOptions(**{name: kwargs.pop(name) for name in names})
            return command(options=options, **kwargs)

        run.__signature__ = inspect.Signature(params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return add

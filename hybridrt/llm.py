"""The public Python API: ``LLM(model).generate(prompts, params)``, ``chat``, ``stream``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hybridrt import env
from hybridrt.engine import LLMEngine
from hybridrt.engine_args import (  # noqa: F401
    EngineArgs,
    check_call_speculative_tokens,
    check_cpu_backend,
    check_device,
)
from hybridrt.kernels import native, quant
from hybridrt.kernels.memory import keep_freed_memory
from hybridrt.loader import load_model, parse_dtype
from hybridrt.model_path import DEMO_MODEL_DIR, default_model, generation_defaults  # noqa: F401
from hybridrt.output_pipeline import ChoiceStream, Shape, finish_message, holdback
from hybridrt.outputs import RequestOutput, error_output
from hybridrt.parallel_sampling import ParentRequest
from hybridrt.prompt_inputs import PromptEncoder, PromptType, as_prompt_list, prompt_text
from hybridrt.reasoning import opens_thinking
from hybridrt.sampling_params import SamplingParams
from hybridrt.session import Session
from hybridrt.specdec.draft_vocab import draft_vocabs
from hybridrt.statecache import HybridCacheManager
from hybridrt.threads import ThreadGovernor, adaptive_threads_enabled
from hybridrt.tokenizer import apply_chat_template, load_tokenizer
from hybridrt.tool_calls import check_tool_choice, check_tools, tool_constraint
from hybridrt.vision.load import load_for_engine


class LLM:
    """Offline batch generation over the hybridrt engine.

    model: a local checkpoint directory or a Hugging Face id (default: the embedded demo model).
    dtype: "auto" (default: the checkpoint's dtype, bfloat16 for Qwen3.5 and the demo model;
    a float32 checkpoint loads as bfloat16 on CUDA), "bfloat16", "float16" or "float32".
    On CPU bfloat16 weights are read as they are by the C GEMM/GEMV kernels, which is as fast
    as float32 or faster at half the memory; float32 only when asked for.
    threads: CPU threads for torch, like ``--threads`` (``torch.set_num_threads``, which is
    process-wide). Default: up to torch's choice (the number of physical cores), fewer while
    other processes keep cores busy, re-decided every half second (``hybridrt/threads.py``).
    cache_memory: the KV + state budget: bytes, a fraction of free memory, or '2GiB'
    (default 0.3 of free memory, capped at what max_num_seqs x max_model_len needs).
    max_num_batched_tokens: the token budget of one engine step (longer prompts are prefilled
    in chunks). Default: 8192 on CUDA, 512 on CPU, at most max_model_len.
    max_num_sessions: sessions that can be open at once (``open_session``; they pin what the
    prefix cache holds of their conversation, and take no memory of their own).
    enable_prefix_caching: every request resumes from the longest cached prefix of its prompt
    (KV blocks shared by the hash of their tokens, GDN state checkpoints; the output is the one
    a cold run gives). checkpoint_interval: save the GDN state every N prompt tokens too (0:
    never). checkpoint_share: the share of ``cache_memory`` for checkpoints beyond the
    requests' own state slots. prefix_cache_dir: the cache's disk tier, at most
    prefix_cache_dir_size, kept across restarts (docs/prefix_cache.md: policy, costs, tiers).
    draft_vocab_size: with speculative_tokens, the MTP drafts from the N most frequent tokens
    only (the model directory's ``draft_vocab.json``, else the first N ids; see
    ``hybridrt.specdec.draft_vocab``, and ``draft_vocab_source`` for which); verification
    uses the whole vocabulary, so outputs are unchanged.
    quantization: None (default) or "int8": every linear weight, the tied embedding / LM head
    and the MTP weights quantized at load time to int8 with one scale per 32 inputs (about half
    the memory of bfloat16, faster decoding on CPU; activations stay in ``dtype``); "int4":
    4-bit weights (``hybridrt.kernels.int4``), the embedding / LM head in 6 bits. CPU only.
    async_scheduling: launch a decode step before the previous step's tokens reach the host,
    so that the host prepares it while the device runs (the same tokens; a request that stops
    has one extra token computed and dropped). Default: on for CUDA, off on CPU (where the
    host and the kernels share the cores, it gains nothing).
    batch_invariant: every request's tokens and logprobs bit for bit the same whatever runs
    beside it, however its prompt is chunked, after preemption, and with greedy speculation
    on or off (docs/batch_invariance.md). CPU and CUDA backends (CUDA: checked under the
    Triton interpreter only so far); costs some prefill speed.
    language_model_only: do not load the checkpoint's vision tower (``model.visual.*``; vLLM's
    ``--language-model-only``): its memory saved, images refused. A checkpoint with a tower
    takes images in ``generate`` (``multi_modal_data``) and ``chat`` (image parts): see
    docs/vision.md. mmproj: a GGUF model's vision projector file (docs/gguf.md).
    vision_quantization: None (default: the tower in ``dtype``) or "int8": the vision tower's
    linear weights quantized to int8 at load time (CPU; independent of ``quantization``; its
    error and speed in docs/vision.md; int4 is refused, by its measured error).
    limit_mm_per_prompt: vLLM's {"image": N, "video": M}: a prompt with more fails (default:
    none). video_fps, video_max_frames: a video's frame sampling and limit (docs/vision.md).
    encoder_cache_memory: images' and videos' encoder outputs kept, by content (bytes,
    '256MiB'; 0: none).
    speculative_method ("mtp", "ngram": prompt lookup, "mtp+ngram"), speculative_adaptive (k up
    to speculative_tokens, chosen per request), prompt_lookup_min / _max: docs/speculation.md.
    hf_overrides: config.json entries replaced before the model is built (a dict or its JSON
    text, vLLM's ``--hf-overrides``; YaRN: docs/long_context.md).
    trace: record every step's five variables in ``llm.trace`` (docs/five-variables.md).
    kv_cache_dtype: "auto" (the model's dtype), "bf16" or "int8" (one fp32 scale per 32 values,
    ``hybridrt.kernels.kvquant``: ~1.8x the tokens of bf16 in the same memory; CPU only).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        cache_memory: int | float | str | None = None,
        seed: int | None = 0,
        tokenizer: Any = "auto",
        device: str | torch.device = "cpu",
        speculative_tokens: int = 0,
        backend: str | None = None,
        max_num_sessions: int = 64,
        threads: int | None = None,
        draft_vocab_size: int | None = None,
        quantization: str | None = None,
        async_scheduling: bool | None = None,
        enable_prefix_caching: bool = True,
        checkpoint_interval: int = 2048,
        checkpoint_share: float = 0.25,
        batch_invariant: bool = False, language_model_only: bool = False,
        speculative_method: str = "mtp", speculative_adaptive: bool = False,
        prompt_lookup_min: int = 2, prompt_lookup_max: int = 4,
        trace: bool = False, limit_mm_per_prompt: dict | str | None = None,
        hf_overrides: dict | str | None = None,
        prefix_cache_dir: str | None = None, prefix_cache_dir_size: int | str = "16GiB",
        kv_cache_dtype: str = "auto", mmproj: str | os.PathLike | None = None,
        vision_quantization: str | None = None, video_fps: float = 2.0,
        video_max_frames: int = 32, encoder_cache_memory: int | str = "256MiB"):
        # every keyword above, checked once (before anything loads)
        args = EngineArgs(**{k: v for k, v in locals().items() if k != "self"})
        if threads is not None:
            torch.set_num_threads(threads)
        self.device = check_device(device)
        self.batch_invariant = batch_invariant
        self.quantization = args.quantization
        if self.quantization:
            check_cpu_backend(f"quantization={self.quantization!r}", self.device, backend)
        if args.vision_quantization:
            check_cpu_backend(f"vision_quantization={args.vision_quantization!r}", self.device,
                              backend)
        if self.device.type == "cpu":
            keep_freed_memory()
            opts = env.kernel_options()
            if opts.native:  # the build the backend will ask for, before quantizing uses one
                native.load(opts.cache_dir, opts.march)
        self.model, self.config, self.model_path = load_model(
            default_model() if model is None else model,
            dtype if isinstance(dtype, str) and dtype.lower() == "auto" else parse_dtype(dtype),
            with_mtp=args.mtp_drafts, device=self.device, quantization=self.quantization,
            overrides=args.hf_overrides)
        stored = quant.quantization_of(self.model)
        if stored is not None and self.quantization not in (None, stored):
            raise ValueError(
                f"quantization={self.quantization!r}: the checkpoint at {self.model_path} is "
                f"stored in {stored} and is not quantized again: leave quantization unset (or "
                f"{stored!r}), or quantize the original checkpoint")
        if stored is not None and stored != self.quantization:
            self.quantization = stored  # a checkpoint stored quantized (hybridrt quantize)
            check_cpu_backend(f"the {stored} checkpoint {self.model_path}", self.device, backend)
        self.dtype = self.model.dtype
        args.check_mtp_weights(self.model.mtp is not None, self.model_path)
        self.args = args.resolved(self.config.max_position_embeddings, self.device)
        cache = HybridCacheManager.for_engine(
            self.args, self.config, self.dtype,
            self.model.num_attention_caches - len(self.config.full_attention_layers),
            salt=f"{self.dtype}|{self.quantization}|{block_size}|{self.model_path}"
            + (f"|vision {args.vision_quantization}" if args.vision_quantization else ""))
        draft_vocab, self.draft_vocab_source, probe_vocab = draft_vocabs(
            self.model_path, self.config.vocab_size, draft_vocab_size, self.args)
        self.tokenizer = self._load_tokenizer(tokenizer)
        # the vision tower (None: text only) and why images are refused without it
        self.vision, self.vision_refusal = load_for_engine(self.model_path, self.config,
                                                           self.dtype, self.device, args)
        self.inputs = PromptEncoder(self.tokenizer, self.vision, self.vision_refusal)
        governor = None
        if self.device.type == "cpu" and threads is None and adaptive_threads_enabled():
            governor = ThreadGovernor(torch.get_num_threads())
        self._parent_ids = itertools.count()  # n > 1: the parents' ids
        self.engine = LLMEngine(self.model, self.config, cache, self.args, self.tokenizer,
                                draft_vocab=draft_vocab, probe_vocab=probe_vocab,
                                thread_governor=governor)
        if self.vision is not None:  # the tower's products on the text model's kernels
            self.vision.encoder.set_backend(self.engine.runner.backend)
        self.trace = None
        if trace:
            from hybridrt.trace import TraceRecorder

            self.trace = TraceRecorder.attach(self.engine)

    # Set-up ------------------------------------------------------------------------------
    def _load_tokenizer(self, tokenizer: Any):
        return load_tokenizer(self.model_path) if tokenizer == "auto" else tokenizer

    @property
    def cache_sizing(self):
        return self.engine.cache_sizing

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params uses: the checkpoint's generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens)
        over SamplingParams' own defaults, as vLLM does."""
        try:
            return SamplingParams(**generation_defaults(self.model_path))
        except ValueError as e:
            raise ValueError(f"{Path(self.model_path) / 'generation_config.json'}: {e}") from None

    # Inputs ------------------------------------------------------------------------------
    def _params(self, params, n: int) -> list:
        if params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(params, (SamplingParams, dict)):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _add(self, prompt: PromptType, params, speculative_tokens: int | None = None,
             session: Session | None = None, snapshot_at: int | None = None) -> str:
        if isinstance(params, dict):
            params = SamplingParams(**params)
        if params.n != 1:
            raise ValueError(f"n={params.n}: stream() runs one choice; use generate() or chat()")
        text, ids, vision = self.inputs.encode(prompt)
        if vision is not None and snapshot_at is not None:  # a chat's images lie before it
            snapshot_at += vision.num_added
        return self.engine.add_request(ids, params, prompt=text,
                                       speculative_tokens=speculative_tokens, session=session,
                                       snapshot_at=snapshot_at, vision=vision)

    def _add_choices(self, prompt: PromptType, params, speculative_tokens: int | None
                     ) -> list[tuple[str, ParentRequest | None, int]]:
        """Queue a prompt's request, or its n children when ``params.n > 1``
        (hybridrt.parallel_sampling) -> (engine request id, parent or None, choice index)."""
        if isinstance(params, dict):
            params = SamplingParams(**params)
        if params.n == 1:
            return [(self._add(prompt, params, speculative_tokens), None, 0)]
        text, ids, vision = self.inputs.encode(prompt)
        parent = ParentRequest(f"n{next(self._parent_ids)}", params)
        added = []
        try:
            for j, (rid, child) in enumerate(parent.children()):
                self.engine.add_request(ids, child, prompt=text, request_id=rid,
                                        speculative_tokens=speculative_tokens,
                                        parent_id=parent.request_id, vision=vision)
                added.append((rid, parent, j))
        except ValueError:
            for rid, _, _ in added:
                self.engine.abort_request(rid)
                self.engine.pop_request(rid)
            raise
        return added

    # Sessions ----------------------------------------------------------------------------
    def open_session(self) -> Session:
        """A conversation whose KV blocks and GDN state stay cached between requests: a
        request on it prefills only the tokens its prompt adds (``stream(..., session=)``)."""
        return self.engine.open_session()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix no session pins -> whether nothing is left (the next
        requests run cold; vLLM's ``reset_prefix_cache``)."""
        return self.engine.reset_prefix_cache()

    def close_session(self, session: Session) -> None:
        self.engine.close_session(session)

    def reset_session(self, session: Session) -> None:
        self.engine.reset_session(session)

    # Generation --------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True,
                 speculative_tokens: int | None = None) -> list[RequestOutput]:
        """prompts: a str / token-id list / {'prompt_token_ids': [...]} or a list of them.
        sampling_params: one SamplingParams (or dict of its fields) for all, or one per prompt;
        None (the default): the checkpoint's generation_config.json, as vLLM does
        (``get_default_sampling_params``).
        Returns one RequestOutput per prompt, in input order. A prompt whose input is invalid
        gets an output with ``error`` (a ValueError) and finish_reason 'error'; the others run.
        speculative_tokens: MTP drafts per step for this call (default: the LLM's; 0 = off).
        With thinking on (the prompt leaves a <think> block open, or the output starts with
        one), a CompletionOutput's ``reasoning_text`` is the think block and ``text`` the
        answer after it (hybridrt.reasoning); otherwise reasoning_text is None.
        """
        outs: list[RequestOutput | None] = []
        for i, out in self.generate_iter(prompts, sampling_params, use_tqdm, speculative_tokens):
            outs.extend([None] * (i + 1 - len(outs)))
            outs[i] = out
        return outs

    def generate_iter(self, prompts, sampling_params=None, use_tqdm: bool = True,
                      speculative_tokens: int | None = None
                      ) -> Iterator[tuple[int, RequestOutput]]:
        """``generate``, but yields ``(index in prompts, RequestOutput)`` as each request
        finishes (rejected prompts first), so a caller can keep what is done if the run stops.
        Closing the iterator early aborts the requests still running."""
        self._check_speculative_tokens(speculative_tokens)
        prompts = as_prompt_list(prompts)
        params = self._params(sampling_params, len(prompts))
        return self._generate_iter(prompts, params, use_tqdm, speculative_tokens)

    def _generate_iter(self, prompts: list, params: list, use_tqdm: bool,
                       speculative_tokens: int | None, tools: list[dict] | None = None,
                       parallel: bool = True) -> Iterator[tuple[int, RequestOutput]]:
        pending: dict[str, tuple[int, ParentRequest | None, int]] = {}
        rejected: list[tuple[int, RequestOutput]] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                try:
                    for rid, parent, j in self._add_choices(p, sp, speculative_tokens):
                        pending[rid] = (i, parent, j)
                except (ValueError, TypeError) as e:
                    err = e if isinstance(e, ValueError) else ValueError(str(e))
                    rejected.append((i, error_output(f"error-{i}", p, err)))
            yield from rejected
            bar = None
            if use_tqdm and pending:
                from tqdm.auto import tqdm

                total = len({i for i, _, _ in pending.values()})
                bar = tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
            try:
                while pending:
                    for req in self.engine.step():
                        if req.is_finished and req.request_id in pending:
                            done = self._pop_output(req.request_id, pending, tools, parallel)
                            if done is not None:
                                if bar is not None:
                                    bar.update(1)
                                yield done
                    if not self.engine.has_unfinished_requests():
                        break
                for rid in list(pending):  # finished without a step reporting it
                    done = self._pop_output(rid, pending, tools, parallel)
                    if done is not None:
                        yield done
            finally:
                if bar is not None:
                    bar.close()
        finally:
            for rid in pending:  # an error, Ctrl-C or an early close
                self.engine.abort_request(rid)
                self.engine.pop_request(rid)

    def _check_speculative_tokens(self, k: int | None) -> None:
        check_call_speculative_tokens(k, self.engine.speculative_tokens)

    def _pop_output(self, rid: str, pending: dict, tools: list[dict] | None = None,
                    parallel: bool = True) -> tuple[int, RequestOutput] | None:
        """The output of finished request ``rid`` as (prompt index, output); None while it is
        a choice whose siblings still run."""
        i, parent, j = pending.pop(rid)
        out = self._output(self.engine.pop_request(rid), tools, parallel)
        if parent is None:
            return i, out
        joined = parent.add(j, out)
        return None if joined is None else (i, joined)

    def _output(self, req, tools: list[dict] | None = None,
                parallel: bool = True) -> RequestOutput:
        """The request's RequestOutput shaped by hybridrt.output_pipeline: its think block
        apart from the answer; with ``tools``, the answer's tool calls parsed out of its text
        (``tool_calls``; the first only unless ``parallel``), and a call begun inside the think
        block ends it (vLLM #39056)."""
        out = self.engine.make_output(req)
        if self.tokenizer is not None:
            c = out.outputs[0]
            m = finish_message(c.text, Shape(self._prompt_thinks(req), tools, parallel))
            c.reasoning_text, c.text = m.reasoning, m.content or ""
            if tools is not None:
                c.tool_calls = m.tool_calls
        return out

    def _prompt_thinks(self, req) -> bool:
        """Does the request's prompt leave a <think> block open (see hybridrt.reasoning)?"""
        text = req.prompt
        if not isinstance(text, str):
            text = self.tokenizer.decode(req.prompt_token_ids[-32:], skip_special_tokens=False)
        return opens_thinking(text)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True,
             speculative_tokens: int | None = None, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None,
             parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """messages: one conversation (list of {'role', 'content'}) or a list of them.
        sampling_params as in ``generate`` (None: the checkpoint's generation_config.json).
        tools: OpenAI's function tools, rendered by the chat template; the calls in an answer
        come back parsed in ``CompletionOutput.tool_calls`` (``text`` is then the text outside
        them). tool_choice: "auto" (default with tools), "none" (no parsing), "required" or
        {"type": "function", "function": {"name": ...}}: the output is constrained to calls
        (hybridrt.tool_calls). Messages may carry ``tool_calls`` (arguments as a dict or its
        JSON text) and role "tool" results."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if tools is not None:
            tools = check_tools(tools)
        choice = check_tool_choice(tool_choice, tools)
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        prompts = [self.inputs.chat_prompt(c, kwargs, add_generation_prompt) for c in convs]
        params = self._params(sampling_params, len(prompts))
        if choice not in ("none", "auto"):
            params = [self._with_tool_constraint(p, tools, choice,
                                                 opens_thinking(prompt_text(text)),
                                                 parallel_tool_calls)
                      for p, text in zip(params, prompts)]
        self._check_speculative_tokens(speculative_tokens)
        outs: list[RequestOutput | None] = [None] * len(prompts)
        for i, out in self._generate_iter(prompts, params, use_tqdm, speculative_tokens,
                                          tools if choice != "none" else None,
                                          parallel_tool_calls):
            outs[i] = out
        return outs

    def _with_tool_constraint(self, params, tools, choice, thinking: bool, parallel: bool):
        if isinstance(params, dict):
            params = SamplingParams(**params)
        if params.structured_outputs is not None:
            raise ValueError(f"tool_choice {choice!r} constrains the output to tool calls: "
                             f"it cannot be combined with structured_outputs")
        return params.clone(structured_outputs=tool_constraint(tools, choice, thinking,
                                                               parallel))

    def apply_chat_template(self, conversation: list[dict], chat_template_kwargs=None,
                            add_generation_prompt: bool = True) -> str:
        return apply_chat_template(self.tokenizer, conversation, chat_template_kwargs,
                                   add_generation_prompt)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
               session: Session | None = None, speculative_tokens: int | None = None,
               snapshot_at: int | None = None) -> Iterator[str]:
        """Yield text deltas of one request as its tokens arrive. Closing the iterator early
        aborts the request. The finished request's output is then in ``last_stream_output``.
        With thinking on, the deltas of the think block are ``hybridrt.reasoning.
        ReasoningDelta`` (a str subclass, without the tags) and the answer's plain str: they
        join to the output's ``reasoning_text`` and ``text``.
        sampling_params None: the checkpoint's generation_config.json, as in ``generate``.
        Bad arguments of the call raise here; a prompt the engine refuses raises its
        ValueError when iteration starts, and so does a request that can never be scheduled.
        Text that a stop string may still cut off is held back until it cannot be."""
        if self.tokenizer is None:
            raise ValueError("stream() needs a tokenizer; use stream_tokens() for token ids")
        self._check_speculative_tokens(speculative_tokens)
        return self._stream_text(self._stream(prompt, sampling_params, session,
                                              speculative_tokens, snapshot_at))

    def _stream_text(self, reqs) -> Iterator[str]:
        """The request's text deltas as hybridrt.output_pipeline streams them: held back
        while a stop string may still cut them off, the think block apart."""
        stream = None
        for req in reqs:
            if stream is None:
                stream = ChoiceStream(Shape(self._prompt_thinks(req)), holdback(req.params))
            yield from stream.split(stream.feed(req.text, req.is_finished), done=False)
        if stream is not None:
            yield from stream.split("", done=True)

    def stream_tokens(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                      session: Session | None = None, speculative_tokens: int | None = None,
                      snapshot_at: int | None = None) -> Iterator[int]:
        """Like ``stream`` but yields token ids."""
        self._check_speculative_tokens(speculative_tokens)
        return self._stream_ids(self._stream(prompt, sampling_params, session,
                                             speculative_tokens, snapshot_at))

    @staticmethod
    def _stream_ids(reqs) -> Iterator[int]:
        sent = 0
        for req in reqs:
            ids = req.output_token_ids
            yield from ids[sent:]
            sent = len(ids)

    def _stream(self, prompt, sampling_params, session=None, speculative_tokens=None,
                snapshot_at=None):
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        rid = self._add(prompt, sampling_params, speculative_tokens, session,
                        snapshot_at)
        req = self.engine.get_request(rid)
        try:
            while not req.is_finished:
                self.engine.step()
                yield req
        finally:
            if not req.is_finished:
                self.engine.abort_request(rid)
            self.engine.pop_request(rid)
            self.last_stream_output = self._output(req)
        if req.error is not None:
            raise req.error

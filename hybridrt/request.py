"""A request's life: tokens, progress through the cache, sampling state and metrics."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridrt.detokenizer import IncrementalDetokenizer
from hybridrt.sampler import SamplingRow
from hybridrt.sampling_params import SamplingParams
from hybridrt.session import Session
from hybridrt.specdec.stats import SpecStats
from hybridrt.statecache.prefix import BlockHashes


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its structured-outputs grammar compiles
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_computed_prompt_tokens: int = 0  # prompt tokens actually prefilled (recompute counts)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (last admission)
    num_preemptions: int = 0
    session_cache_evicted: bool = False  # the session lost pinned cache since its last turn

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Generated tokens after the first, over the time after the first."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        dt = self.finished_time - self.first_token_time
        n = self.num_generated_tokens - 1
        return n / dt if n > 0 and dt > 0 else None

    def as_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "time_to_first_token": self.time_to_first_token,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "num_preemptions": self.num_preemptions,
            "num_prefilled_tokens": self.num_computed_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "session_cache_evicted": self.session_cache_evicted,
        }


@dataclass(slots=True, eq=False)
class Request:
    """| field | meaning |
    | --- | --- |
    | token_ids | prompt followed by every generated token |
    | num_computed_tokens | tokens whose KV / GDN state are in the cache (<= len(token_ids)) |
    | text | detokenised output so far (stop strings already cut) |

    Its progress has two writers: the scheduler (admission, preemption, finish) and the
    update step (``OutputProcessor.update`` / ``apply_drafts``); speculation and sessions
    return what they settled instead of writing here.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: Exception | None = None  # why it finished with finish_reason "error"
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # builds ``text``, when there is a tokenizer
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    # Speculative decoding: k drafts per step; drafts wait here until verified. The request
    # owns 1 + k state slots and its current GDN state is in slot number ``slot_cursor``.
    spec_k: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] the drafts were sampled from
    slot_cursor: int = 0
    spec_stats: SpecStats | None = None
    # Prefix cache: the hash chain of its full blocks (None: caching off), the positions after
    # which its GDN state is saved as a checkpoint (statecache/prefix.py ``checkpoint_positions``),
    # the target's hidden state at the position before a cache hit (the MTP layer's input there,
    # consumed by the first draft pass) and after its last computed token (kept with its state
    # when it is released); ``cache_dirty``: a step failed midway, its cache is not kept.
    block_hashes: BlockHashes | None = None
    checkpoint_at: list[int] = field(default_factory=list)
    mtp_carry: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    cache_dirty: bool = False
    # The MTP layer's input rows not run yet (``specdec.mtp``'s lazy rows): (first position,
    # the target's hidden rows from there, a tensor per step); None when its MTP KV covers
    # every computed token.
    mtp_pending: tuple[int, list[torch.Tensor]] | None = None
    # Sessions: the conversation this request continues (hybridrt.session) and the prompt length
    # the caller asked to keep a checkpoint at (where a chat's generation prompt starts).
    session: Session | None = None
    requested_snapshot_at: int | None = None
    # Structured outputs: the matcher of the request's grammar (hybridrt.structured_outputs),
    # which has accepted exactly the output tokens; None without a constraint. n > 1: the
    # parent request (hybridrt.parallel_sampling) this one is a choice of.
    grammar: object | None = None
    parent_id: str | None = None
    # Images: the prompt's image inputs (hybridrt.vision.tower.VisionInputs), None without
    vision: object | None = None

    def __post_init__(self) -> None:
        if self.spec_k > 0 and self.spec_stats is None:
            self.spec_stats = SpecStats(self.spec_k)
        self.token_ids = list(self.prompt_token_ids)
        self.metrics.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sampling_row(self, drafts: list[int] = ()) -> SamplingRow:
        """The sampler's view of this request, as if ``drafts`` had already been emitted."""
        return SamplingRow(params=self.params, prompt_token_ids=self.prompt_token_ids,
                           output_token_ids=self.output_token_ids + list(drafts),
                           generator=self.generator, eos_token_ids=self.eos_token_ids,
                           grammar=self.grammar)

    def reset_speculation(self) -> None:
        """Drop pending drafts and go back to the first slot (preemption, abort)."""
        self.draft_token_ids = []
        self.draft_probs = None
        self.slot_cursor = 0
        self.last_hidden = None
        self.mtp_pending = None

    @property
    def mtp_written(self) -> int:
        """The positions before which its MTP KV is written (when it has MTP KV): every
        computed one unless rows wait (``mtp_pending``)."""
        return self.num_computed_tokens if self.mtp_pending is None else self.mtp_pending[0]


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int,
                    max_model_len: int) -> list[int]:
    """The prompt as a list of ids; ValueError if it is empty, not ints, outside the
    vocabulary, or leaves no room for a generated token."""
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt is empty: it must contain at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of ints")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens but max_model_len is {max_model_len}: it must be "
            f"shorter than max_model_len to leave room for at least one generated token"
        )
    return ids


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens that end a request: the model's eos ids (unless ``ignore_eos``), then
    ``params.stop_token_ids``."""
    ids = [] if params.ignore_eos else list(eos_token_ids)
    for t in params.stop_token_ids or []:
        if t not in ids:
            ids.append(t)
    return ids


def find_stop(text: str, stop: list[str], start: int) -> int | None:
    """Index in ``text`` where the earliest stop string begins, or None.

    ``start`` is where the newly decoded text begins; a match that is new must end after it,
    so only ``text[max(0, start - longest + 1):]`` is searched. The update step cuts the output at
    the returned index (or after the stop string with include_stop_str_in_output):
    ``OutputProcessor.append_token``.
    """
    if not stop:
        return None
    begin = max(0, min(start, len(text)) - max(len(s) for s in stop) + 1)
    found = [i for i in (text.find(s, begin) for s in stop) if i >= 0]
    return min(found) if found else None

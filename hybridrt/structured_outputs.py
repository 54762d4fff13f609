"""Structured outputs: a request's constraint compiled to a grammar, and its token mask.

The grammar engine is llguidance, or xgrammar (``HYBRIDRT_GRAMMAR_ENGINE``; auto: llguidance
when installed; ``hybridrt.grammar_engine`` holds both, docs/structured_outputs.md says why),
imported on the first constrained request. ``StructuredOutputs`` (one per engine) compiles a
request's ``StructuredOutputsParams`` in a worker thread (both engines release the GIL), with a
time limit, and caches what it compiled; a request waits outside the scheduler until its
grammar is ready, and a constraint that fails to compile, or takes longer than the limit,
fails that request alone. A JSON constraint's unbounded integers and numbers are bounded
first (``bounded``, hybridrt.json_bounds). Each request then owns a ``RequestGrammar``: the
engine's matcher that has accepted exactly the request's output tokens.

The mask: ``RequestGrammar.fill_mask`` writes the tokens allowed after the output (plus
drafts, for a speculative row: they are accepted, the mask is filled and they are rolled
back at once, so the matcher never holds an unverified token) into one row of an int32
bitmask, bit ``t % 32`` of word ``t // 32`` for token t; the sampler applies it
(``sampler.apply_token_bitmask``, torch ops that run on CPU and CUDA alike). The update step
accepts each emitted token (``accept``); the request stops when its grammar has ended.

| object | owner | lives |
| --- | --- | --- |
| StructuredOutputs | the engine | the grammar engine (tokenizer prepared), cache, compile pool |
| RequestGrammar | ``Request.grammar`` | the request's life; preemption keeps it (outputs stay) |
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hybridrt.grammar_engine import choice_grammar, engine_name, make_engine
from hybridrt.json_bounds import ANY_JSON_OBJECT, bound_numbers
from hybridrt.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputs", "RequestGrammar", "PendingGrammar", "bitmask_width",
           "choice_grammar"]

DEFAULT_COMPILE_TIMEOUT = 10.0  # seconds a constraint may take to compile
MAX_CONSTRAINT_CHARS = 1 << 20  # the text of one constraint (schema, regex, grammar)


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return (vocab_size + 31) // 32


class RequestGrammar:
    """One request's matcher. ``num_accepted``: output tokens accepted so far (the matcher's
    state is the grammar after them)."""

    __slots__ = ("matcher", "num_accepted", "kind")

    def __init__(self, matcher: Any, kind: str):
        self.matcher = matcher
        self.kind = kind
        self.num_accepted = 0

    def accept(self, token: int) -> bool:
        """Advance by one emitted token -> False when the grammar does not allow it."""
        ok = self.matcher.accept_token(int(token))
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token)."""
        return self.matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int, output_token_ids: Sequence[int]) -> None:
        """Row ``row`` of ``bitmask`` (int32 [N, words], CPU) := the tokens allowed after
        ``output_token_ids`` (the accepted outputs, then drafts). The drafts are accepted for
        the fill and rolled back after it. A row past a draft the grammar refuses, or past
        its end, allows every token: verification rejects at that draft first, so the row
        is never sampled from."""
        drafts = output_token_ids[self.num_accepted:]
        m = self.matcher
        taken = 0
        for t in drafts:
            if m.is_terminated() or not m.accept_token(int(t)):
                break
            taken += 1
        if taken == len(drafts) and not m.is_terminated():
            m.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = -1
        if taken:
            m.rollback(taken)


class StructuredOutputs:
    """Compiles constraints for one engine: ``submit(params)`` -> a Future of the compiled
    grammar (cached by the constraint's text), ``matcher(compiled, stop_ids)`` -> a
    RequestGrammar. ``compile_timeout``: seconds after which a request stops waiting for its
    grammar and fails (the compile itself cannot be interrupted: it finishes in its worker
    thread, and its result is cached). ``engine``: "llguidance" or "xgrammar"; None takes
    ``HYBRIDRT_GRAMMAR_ENGINE``'s (``grammar_engine.engine_name``) at the first compile."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT, workers: int = 1,
                 engine: str | None = None):
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (the grammar is on text)")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_timeout = compile_timeout
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="hybridrt-grammar")
        self.engine_name = engine
        self._engine = None
        self._lock = threading.Lock()  # the engine is prepared once, by the first compile
        self._futures: dict[tuple, Future] = {}  # in flight or done
        self.stats = {"compiled": 0, "cache_hits": 0, "errors": 0, "compile_s": 0.0}

    # Compiling ----------------------------------------------------------------------------
    def _get_engine(self):
        with self._lock:
            if self._engine is None:
                self.engine_name = self.engine_name or engine_name()
                self._engine = make_engine(self.engine_name, self.tokenizer, self.vocab_size,
                                           self.stop_token_ids)
            return self._engine

    def submit(self, so: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``so``, as a Future (done at once when cached)."""
        key = _key(so)
        fut = self._futures.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self.stats["cache_hits"] += 1
            return fut
        fut = self._pool.submit(self._compile, so)
        self._futures[key] = fut
        if len(self._futures) > 4096:  # forget the oldest compiled grammars
            self._futures.pop(next(iter(self._futures)))
        return fut

    def pending(self, so: StructuredOutputsParams) -> PendingGrammar:
        """A request's grammar, its compile submitted (``PendingGrammar``)."""
        return PendingGrammar(self, self.submit(so), so)

    def compile(self, so: StructuredOutputsParams, timeout: float | None = None):
        """Compile now (waiting at most ``timeout`` s, default ``compile_timeout``) -> the
        compiled grammar; ValueError if it does not compile in time."""
        fut = self.submit(so)
        return self.result(fut, so, self.compile_timeout if timeout is None else timeout)

    def result(self, fut: Future, so: StructuredOutputsParams, timeout: float = 0.0):
        """The compiled grammar of a done ``fut``; ValueError for a compile error, or when
        ``fut`` is not done within ``timeout``."""
        from concurrent.futures import TimeoutError as FutureTimeout

        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            raise ValueError(
                f"structured_outputs.{so.kind}: the constraint did not compile within "
                f"{self.compile_timeout:g} s (simplify it: large enums and deep nesting "
                f"compile slowly)") from None

    def _compile(self, so: StructuredOutputsParams):
        t0 = time.perf_counter()
        engine = self._get_engine()
        kind = so.kind
        try:
            value = getattr(so, kind)
            if isinstance(value, str) and len(value) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"it has {len(value)} characters, over the limit of "
                                 f"{MAX_CONSTRAINT_CHARS}")
            compiled = engine.compile(bounded(so))
        except ValueError as e:  # the engine's reason, one line
            self.stats["errors"] += 1
            raise ValueError(f"structured_outputs.{kind}: the constraint cannot be compiled: "
                             f"{e}") from None
        self.stats["compiled"] += 1
        self.stats["compile_s"] += time.perf_counter() - t0
        return compiled

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int], kind: str) -> RequestGrammar:
        """A fresh matcher of ``compiled`` that ends on any of ``stop_token_ids`` (the
        request's; the model's eos ids when it has none)."""
        stops = list(stop_token_ids) or self.stop_token_ids
        return RequestGrammar(self._get_engine().matcher(compiled, stops), kind)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PendingGrammar:
    """A request's grammar while it compiles (the request waits in the scheduler with status
    ``WAITING_FOR_GRAMMAR``): the compile's Future and what the matcher is built from."""

    __slots__ = ("compiler", "future", "params")

    def __init__(self, compiler: StructuredOutputs, future: Future,
                 params: StructuredOutputsParams):
        self.compiler, self.future, self.params = compiler, future, params

    def matcher(self, stop_token_ids: Sequence[int], waited: float) -> RequestGrammar | None:
        """The request's matcher once compiled; None while it compiles and has waited less than
        ``compile_timeout`` seconds; ValueError when it failed or timed out."""
        if not self.future.done() and waited < self.compiler.compile_timeout:
            return None
        compiled = self.compiler.result(self.future, self.params)
        return self.compiler.matcher(compiled, stop_token_ids, self.params.kind)


def bounded(so: StructuredOutputsParams) -> StructuredOutputsParams:
    """A JSON constraint with its unbounded integers and numbers bounded
    (hybridrt.json_bounds); json_object as the schema of any object so bounded; other
    constraints as they are."""
    from dataclasses import replace

    if so.kind == "json_object":
        return StructuredOutputsParams(json=ANY_JSON_OBJECT,
                                       disable_any_whitespace=so.disable_any_whitespace)
    if so.kind != "json":
        return so
    schema = so.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return so  # the engine names what is wrong with it
    return replace(so, json=bound_numbers(schema))


def _key(so: StructuredOutputsParams) -> tuple:
    value = getattr(so, so.kind)
    if isinstance(value, (dict, list)):
        value = json.dumps(value, sort_keys=True)
    return so.kind, value, so.disable_any_whitespace

"""Kernel backends: the CPU backend against the reference backend, and no host round trips
inside a model step (the metadata is built once per step from the runner's host lists)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import assert_rel_close, build_model

from hybridrt.kernels import native
from hybridrt.kernels.backend import CPUBackend, ReferenceBackend, select_backend
from hybridrt.llm import LLM
from hybridrt.runner import build_batch
from hybridrt.sampling_params import SamplingParams
from hybridrt.statecache import CacheTensors
from hybridrt.testing import tiny_text_config, write_random_checkpoint

CONVERSIONS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__")


class ConversionCounter:
    """Counts tensor -> Python conversions while active (``with counter: ...``)."""

    def __init__(self, monkeypatch):
        self.counts: Counter[str] = Counter()
        self.active = False
        for name in CONVERSIONS:
            orig = getattr(torch.Tensor, name)

            def wrapper(t, *args, _orig=orig, _name=name, **kw):
                if self.active:
                    self.counts[_name] += 1
                return _orig(t, *args, **kw)

            monkeypatch.setattr(torch.Tensor, name, wrapper)

    def __enter__(self):
        self.counts.clear()
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _engine(tmp_path, num_layers: int, k: int = 0):
    cfg = tiny_text_config(num_hidden_layers=num_layers)
    d = write_random_checkpoint(tmp_path / f"l{num_layers}", cfg, seed=2)
    llm = LLM(d, dtype="bfloat16", max_model_len=96, max_num_seqs=4, cache_memory=16 << 20,
              tokenizer=None, speculative_tokens=k, max_num_batched_tokens=24)
    return llm.engine


def _step_counts(engine, monkeypatch) -> dict[str, int]:
    """Conversions in the model part of one decode step and of one mixed step (a prompt chunk
    beside decodes), and in the whole engine step around each."""
    counter = ConversionCounter(monkeypatch)
    runner = engine.runner
    forward = runner.forward

    def counted_forward(batch):
        before = counter.total
        out = forward(batch)
        counted_forward.last = counter.total - before
        return out

    runner.forward = counted_forward
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for n in (5, 9):
        engine.add_request(list(range(3, 3 + n)), params)
    engine.step()
    engine.step()  # both prompts done: the next step is all decodes
    out = {}
    with counter:
        engine.step()
    engine_decode = counter.total
    out["decode"], out["engine_decode"] = counted_forward.last, engine_decode
    engine.add_request(list(range(3, 40)), params)  # 37 tokens: chunked beside the decodes
    with counter:
        engine.step()
    out["mixed"], out["engine_mixed"] = counted_forward.last, counter.total
    runner.forward = forward
    return out


def test_no_host_round_trips_inside_a_model_step(tmp_path, monkeypatch):
    """The model's forward (metadata + every layer) converts no tensor to Python, for a batch
    of decodes and for a mixed batch; the whole engine step converts a small number that does
    not grow with the number of layers (the sampled tokens, once)."""
    small = _step_counts(_engine(tmp_path, 4), monkeypatch)
    large = _step_counts(_engine(tmp_path, 12), monkeypatch)
    assert small["decode"] == 0 and small["mixed"] == 0, small
    assert large["decode"] == 0 and large["mixed"] == 0, large
    assert small["engine_decode"] == large["engine_decode"] <= 4, (small, large)
    assert small["engine_mixed"] == large["engine_mixed"] <= 4, (small, large)


def _mixed_batches(config):
    """Step 1: two prompts (one whole, one chunk); step 2: a decode, a continued chunk and a
    verification of 3 drafts (per-token verify slots)."""
    first = build_batch([list(range(3, 8)), list(range(10, 21)), list(range(4, 9))], [0, 0, 0],
                        [[0], [1, 2, 4], [3, 5]], 8, [1, 2, 3], ["all", "all", "all"])
    second = build_batch([[7], list(range(30, 36)), [9, 10, 11, 12]], [5, 11, 5],
                         [[0], [1, 2, 4], [3, 5]], 8, [1, 2, 3], ["all", "all", "all"],
                         verify_slots=[None, None, [4, 5, 6, 3]])
    return first, second


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4), (4, 4)], ids=["grouped", "equal"])
def test_cpu_backend_matches_reference(dtype, heads):
    """Whole mixed steps (prompts, chunk continuation, decode, draft verification) on the CPU
    backend against the reference backend: hidden states, conv and recurrent states of every
    slot, KV caches."""
    cfg = tiny_text_config(linear_num_key_heads=heads[0], linear_num_value_heads=heads[1])
    results = []
    for backend in (ReferenceBackend, CPUBackend):
        net, config, _ = build_model(cfg, seed=4, dtype=dtype)
        net.set_backend(backend(config))
        cache = CacheTensors.allocate(config, 6, 8, 8, dtype)
        hidden = []
        with torch.inference_mode():
            for batch in _mixed_batches(config):
                hidden.append(net(batch, cache))
        results.append((hidden, cache))
    (h_ref, c_ref), (h_cpu, c_cpu) = results
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (a, b) in enumerate(zip(h_cpu, h_ref)):
        assert_rel_close(a, b, tol, f"step {i} hidden")
    assert_rel_close(c_cpu.ssm_states, c_ref.ssm_states, tol, "recurrent states")
    assert_rel_close(c_cpu.conv_states, c_ref.conv_states, tol, "conv states")
    for i, (a, b) in enumerate(zip(c_cpu.key_caches, c_ref.key_caches)):
        assert_rel_close(a, b, tol, f"key cache {i}")


def test_select_backend():
    cfg = build_model(tiny_text_config())[1]
    assert isinstance(select_backend(cfg, "cpu"), CPUBackend)
    assert type(select_backend(cfg, "cpu", "reference")) is ReferenceBackend
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend(cfg, "cpu", "tpu")
    assert select_backend(cfg, "cpu").native == (native.load() is not None)


def _index_tensors(batch) -> dict[str, torch.Tensor]:
    """The step's index tensors made from host lists: the batch's and the backend plans'."""
    out = {f: getattr(batch, f) for f in (
        "input_ids", "positions", "cu_seqlens", "seq_lens", "slot_mapping", "block_tables",
        "state_slots", "has_initial_state", "logits_indices")}
    meta = batch.meta
    if meta.attention.decode_rows is not None:
        out["attention.decode_rows"] = meta.attention.decode_rows
    for i, g in enumerate(meta.gdn.groups):
        for f in ("rows", "slots", "slots_out"):
            if getattr(g, f) is not None:
                out[f"group{i}.{f}"] = getattr(g, f)
    c = meta.gdn.chunked
    if c is not None:
        for f in ("rows", "cu_seqlens", "slots", "has_initial_state", "cu_seqlens_cpu"):
            if getattr(c, f) is not None:
                out[f"chunked.{f}"] = getattr(c, f)
        out["conv.out_rows"], out["conv.state_rows"] = c.conv.out_rows, c.conv.state_rows
        for i, grp in enumerate(c.delta):
            for f in ("rows", "slots", "has_initial_state"):
                out[f"delta{i}.{f}"] = getattr(grp, f)
    return out


def test_step_metadata_lives_in_buffers_sized_at_start_up(tmp_path):
    """Every engine step (prompt chunks, decodes, draft verification, all mixed) puts its index
    tensors into the runner's ``StepBuffers``, allocated once when the engine starts: none is
    allocated per step, and none overflows."""
    engine = _engine(tmp_path, 4, k=2)
    runner = engine.runner
    bufs = runner.arrays
    forward = runner.forward
    seen: list[tuple[set, dict]] = []

    def checked_forward(batch):
        out = forward(batch)
        kinds = {(n, v is not None) for n, v in zip(batch.query_lens, batch.verify_slots
                                                    or [None] * batch.num_seqs)}
        seen.append((kinds, {k: bufs.holds(t) for k, t in _index_tensors(batch).items()}))
        return out

    runner.forward = checked_forward
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for n in (5, 30, 9, 17):  # 30 and 17 tokens: chunked beside decodes and verifications
        engine.add_request(list(range(3, 3 + n)), params)
    while engine.has_unfinished_requests():
        engine.step()
    runner.forward = forward
    outside = [(i, k) for i, (_, held) in enumerate(seen) for k, ok in held.items() if not ok]
    assert not outside, outside
    kinds = set().union(*(k for k, _ in seen))
    assert any(v for _, v in kinds) and (1, False) in kinds  # verifications, decodes
    assert any(n > 1 and not v for n, v in kinds)  # prompt chunks
    assert bufs.overflows == 0


@pytest.mark.parametrize("seed", range(4))
def test_step_buffers_hold_the_largest_steps(seed):
    """Steps at the engine's limits (max_num_seqs sequences, max_num_batched_tokens tokens in
    all, prompt chunks padded to their chunk size, verifications, the longest block tables) fit
    the capacity computed at start-up."""
    import random

    from hybridrt.kernels.meta import StepBuffers

    rng = random.Random(seed)
    cfg = tiny_text_config()
    net, config, _ = build_model(cfg, seed=0, dtype=torch.float32)
    backend = CPUBackend(config)
    S, T, max_len, bs = 6, 200, 512, 8
    bufs = StepBuffers.for_limits(S, T, max_len // bs, config.linear_conv_kernel_dim)
    for i in range(20):
        n_seqs = rng.randint(1, S)
        cuts = sorted(rng.sample(range(1, T), n_seqs - 1))
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, T])]
        starts = [rng.choice([0, rng.randint(1, max_len - n - 1)]) for n in lens]
        if i == 0:  # the most per token: a decode beside prompts padded to 2 chunks of 64
            lens, starts = [1, 65, 65, 65, 2, 2], [9, 0, 0, 0, 0, 0]
            n_seqs = S
        verify = [list(range(n)) if s and n <= 4 and rng.random() < 0.5 else None
                  for s, n in zip(starts, lens)]
        tables = [list(range(max_len // bs))] * n_seqs
        bufs.begin()
        batch = build_batch([[3] * n for n in lens], starts, tables, bs, list(range(n_seqs)),
                            ["all"] * n_seqs if i == 0 else
                            [rng.choice(["all", "last", "none"]) for _ in lens],
                            verify if any(verify) else None, arrays=bufs)
        batch.meta = backend.prepare(batch)
        assert bufs.overflows == 0, (lens, starts, verify)
        assert [k for k, t in _index_tensors(batch).items() if not bufs.holds(t)] == []
    assert bufs.overflows == 0


def test_cpu_backend_merges_projections_into_views():
    """Projections that read the same input become views into one weight per group (no copy
    kept), and the backend runs each group as one product (the outputs are checked against the
    reference backend in test_cpu_backend_matches_reference)."""
    from hybridrt.model import MLP, GatedAttention, GatedDeltaNet

    net, config, _ = build_model(tiny_text_config(), seed=4, dtype=torch.bfloat16)
    before = {n: p.clone() for n, p in net.named_parameters()}
    backend = CPUBackend(config)
    net.set_backend(backend)
    n_groups = sum(isinstance(m, (MLP, GatedAttention, GatedDeltaNet)) for m in net.modules())
    if not backend.half_simd:  # no compiled half kernels: per-module fp32 copies, no merging
        assert backend.groups == {}
        return
    assert len(backend.groups) == n_groups > 0
    for w, sizes in backend.groups.values():
        assert w.is_contiguous() and w.shape[0] == sum(sizes)
    mlp = next(m for m in net.modules() if isinstance(m, MLP))
    assert mlp.gate_proj.weight.data_ptr() == backend.groups[
        (id(mlp.gate_proj), id(mlp.up_proj))][0].data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_proj.weight.data_ptr()
    for n, p in net.named_parameters():  # same values
        assert torch.equal(p, before[n]), n


def test_release_pages_gives_memory_back():
    from hybridrt.cpu_alloc import release_pages

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    try:
        rss()
    except OSError:
        pytest.skip("no /proc here")
    t = torch.ones(16 << 20)  # 64 MiB, touched
    before = rss()
    freed = release_pages(t)
    assert freed >= (64 << 20) - 2 * 4096
    assert before - rss() >= 48 << 20
    assert release_pages(torch.ones(10)) == 0  # no whole page inside
    whole = torch.ones(16 << 20)
    assert release_pages(whole[: 8 << 20]) == 0  # a part of its storage: the rest is not ours
    assert whole[-1] == 1 and whole[0] == 1


def test_loaded_models_own_their_weights_built_ones_do_not():
    """Only a model the loader built (no other references to its tensors) lets the CPU backend
    free the weights that merging replaced; a model built from a caller's state dict keeps them
    (the caller may still read it)."""
    llm = LLM(dtype="bfloat16", tokenizer=None, max_model_len=64, cache_memory=32 << 20)
    assert llm.model.owns_weights is True
    net, config, sd = build_model(tiny_text_config(), seed=4, dtype=torch.bfloat16)
    keep = {n: t.clone() for n, t in sd.items()}
    net.set_backend(CPUBackend(config))
    assert all(torch.equal(sd[n], keep[n]) for n in sd)

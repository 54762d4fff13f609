"""Kernel backends: the CPU backend against the reference backend, and no host round trips
inside a model step (the metadata is built once per step from the runner's host lists)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import assert_rel_close, build_model, run_mixed_steps
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.env import kernel_options
from hybridrt.kernels import native
from hybridrt.kernels.backend import CPUBackend, ReferenceBackend, select_backend
from hybridrt.kernels.options import KernelOptions
from hybridrt.llm import LLM
from hybridrt.runner import build_batch
from hybridrt.sampling_params import SamplingParams

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


def test_attention_runs_sdpa_fused_kernel():
    """Every attention SDPA call of the mixed steps (fresh prompts, a continued chunk, a
    verification, decodes) takes the fused flash kernel: with only that kernel allowed, none
    fails for want of one (3-D inputs, for one, fall back to the math path, which builds the
    whole [H, n, ctx] score matrix), and the results are the unrestricted ones."""
    cfg = tiny_text_config()
    free, _, _ = run_mixed_steps(ReferenceBackend, cfg, torch.float32)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fused, _, _ = run_mixed_steps(ReferenceBackend, cfg, torch.float32)
    for i, (a, b) in enumerate(zip(fused, free)):
        assert_rel_close(a, b, 1e-6, f"step {i} hidden")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4), (4, 4)], ids=["grouped", "equal"])
def test_cpu_backend_matches_reference(dtype, heads):
    """Whole mixed steps (prompts, chunk continuation, decode, draft verification, then
    decodes alone, then verifications alone) on the CPU backend against the reference
    backend: hidden states, conv and recurrent states of every slot, KV caches."""
    cfg = tiny_text_config(linear_num_key_heads=heads[0], linear_num_value_heads=heads[1])
    h_ref, c_ref, _ = run_mixed_steps(ReferenceBackend, cfg, dtype)
    h_cpu, c_cpu, looped = run_mixed_steps(CPUBackend, cfg, dtype)
    # bf16 with the compiled kernels: the decodes-only and verifications-only steps ran the
    # CPU backend's loop
    fast = dtype == torch.bfloat16 and native.half_gemm_available()
    assert looped == [False, False, fast, fast]
    # fp32: prompt chunks run the recurrence itself here (csrc/gdn_fused.c), the chunked form
    # in the reference: up to 1.1e-5 apart after the 4 layers
    tol = 2e-5 if dtype == torch.float32 else 3e-2
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
        batch.meta = backend.plan_step(batch)
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
        (id(mlp.gate_proj.weight), id(mlp.up_proj.weight))][0].data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_proj.weight.data_ptr()
    for n, p in net.named_parameters():  # same values
        assert torch.equal(p, before[n]), n


def test_release_pages_gives_memory_back():
    from hybridrt.kernels.memory import release_pages

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


def test_arena_move_copies_and_releases_as_it_goes(monkeypatch):
    """HugeArena.move: the same values in the arena, the source's pages given back piece by
    piece (the resident set never holds both copies of a large weight: it grows by at most one
    piece while moving), a tensor that is part of another's storage copied and left as it
    was."""
    from hybridrt.kernels.memory import HugeArena

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    try:
        rss()
    except OSError:
        pytest.skip("no /proc here")
    src = torch.arange(12 << 20, dtype=torch.float32).view(3 << 10, 4 << 10)  # 48 MiB
    want = src[::997].clone()
    arena = HugeArena(HugeArena.size_for([src]) + (8 << 20))
    peak = []
    chunk = 4 << 20
    monkeypatch.setattr(HugeArena, "MOVE_CHUNK", chunk)
    copy = torch.Tensor.copy_

    def watched(dst, s, *a, **k):
        peak.append(rss())
        return copy(dst, s, *a, **k)

    monkeypatch.setattr(torch.Tensor, "copy_", watched)
    before = rss()
    out = arena.move(src)
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    assert len(peak) == 12 and max(peak) - before <= 2 * chunk
    assert torch.equal(out[::997], want)
    assert src.data_ptr() != out.data_ptr()
    part = torch.ones(4 << 20)[: 1 << 20]  # a quarter of its storage: copied, not released
    assert torch.equal(arena.move(part), torch.ones(1 << 20)) and part[0] == 1


def _smaps(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``addr``: its fields by name (the
    backing file's path as "path"; {} where no mapping holds it)."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                if entry is not None:
                    return entry
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    entry = {"path": parts[5] if len(parts) >= 6 else ""}
            elif entry is not None:
                entry[parts[0].rstrip(":")] = line.split(":", 1)[1].strip()
    return entry or {}


def _anon_huge_bytes(addr: int) -> int:
    """AnonHugePages of the mapping holding ``addr``."""
    return int(_smaps(addr).get("AnonHugePages", "0 kB").split()[0]) << 10


def test_arena_settles_into_huge_pages_in_the_background(monkeypatch):
    """Where the kernel has MADV_COLLAPSE: the arena fills in ordinary pages and ``settle``
    moves them into huge pages in a thread, the contents unchanged; with ``settle_at_load``
    (the benchmarks) it is advised before the first touch and ``settle`` does nothing."""
    from hybridrt.kernels import memory

    if not (memory.huge_pages_available() and memory.collapse_supported()):
        pytest.skip("no transparent huge pages or no MADV_COLLAPSE here")
    monkeypatch.setattr(memory, "settle_at_load", False)
    n = 16 << 20
    arena = memory.HugeArena(n)
    assert arena.later
    w = arena.empty((n // 4,), torch.float32)
    w.copy_(torch.arange(n // 4, dtype=torch.float32))
    assert _anon_huge_bytes(w.data_ptr()) == 0  # filled in ordinary pages
    assert arena.settle() is not None and arena.settle() is None  # once
    assert memory.wait_for_huge_pages(timeout=60)
    assert _anon_huge_bytes(w.data_ptr()) >= n - (2 << 20)
    assert torch.equal(w, torch.arange(n // 4, dtype=torch.float32))
    monkeypatch.setattr(memory, "settle_at_load", True)
    assert memory.HugeArena(n).settle() is None


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


# ------------------------------------------------------------------------------------------
# The compiled decode layers (csrc/gdn_fused.c, attn_decode.c, norm.c) against the reference
# backend's ops, each call counted so that a fallback to the torch ops cannot pass for them
# ------------------------------------------------------------------------------------------


def _count_calls(monkeypatch, name: str) -> list[int]:
    _require_native()
    calls = [0]
    orig = getattr(native, name)

    def counted(*args, **kw):
        calls[0] += 1
        return orig(*args, **kw)

    monkeypatch.setattr(native, name, counted)
    return calls


def _require_native() -> None:
    if native.load() is None:
        pytest.skip("native kernels unavailable here")


def _fused_tol(dtype) -> float:
    # fp32: sums in another order; bf16: the same roundings, so at most an ulp where an exp or
    # a sum lands on a rounding boundary (2^-8 of max |ref|)
    return 1e-5 if dtype == torch.float32 else 2 ** -8


def _layer(cls, dtype, **cfg):
    net, config, _ = build_model(tiny_text_config(**cfg), seed=6, dtype=dtype)
    return next(m for m in net.modules() if isinstance(m, cls)), config, net


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(2, 4, 6), (3, 3, 6), (1, 2, 128)],
                         ids=["grouped", "equal", "dv128"])
@pytest.mark.parametrize("L,verify", [(1, False), (3, True), (2, False)],
                         ids=["decode", "verify3", "two-in-place"])
@pytest.mark.parametrize("simd", [2, 1, 0], ids=["avx512", "avx2", "plain"])
def test_fused_gdn_layer_matches_reference(dtype, heads, L, verify, simd, monkeypatch):
    """One GDN layer's recurrent group in one compiled call: the gated-normed output, the conv
    and recurrent states of every slot (sources kept when verifying into per-token slots,
    unnamed slots untouched) as the reference ops leave them. Conv kernel 3, K < 4 taps;
    value heads of 128 (Qwen3.5's) take the register-resident read of the state; the vector
    loops (AVX-512: 16 channels, 16 values of a head; AVX2: 8; the "equal" case's 78 channels
    leave a tail of each width) where the build has them, and the plain C ones."""
    from hybridrt.kernels.backend import RecurrentGroup
    from hybridrt.kernels.delta_rule import slot_runs
    from hybridrt.model import GatedDeltaNet

    layer, config, _ = _layer(GatedDeltaNet, dtype, linear_num_key_heads=heads[0],
                              linear_num_value_heads=heads[1], linear_value_head_dim=heads[2],
                              linear_conv_kernel_dim=3)
    gen = torch.Generator().manual_seed(L * 10 + heads[0])
    B, S = 3, 14
    N = B * L
    # one projection output [N, C + V + 2 HV] split into views, as the merged product gives
    widths = [config.conv_dim, layer.value_dim, layer.num_v_heads, layer.num_v_heads]
    proj = torch.randn(N, sum(widths), generator=gen).to(dtype)
    mixed, z, a, b = proj.split(widths, dim=-1)
    conv0 = torch.randn(S, layer.kernel_size - 1, config.conv_dim, generator=gen).to(dtype)
    ssm0 = torch.randn(S, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
                       generator=gen) * 0.3
    slots = [4, 1, 6]
    slots_out = torch.tensor([[0, 2, 3], [5, 7, 8], [9, 10, 11]])[:, :L] if verify else None
    grp = RecurrentGroup(None, B, L, torch.tensor(slots), slots_out, slot_runs(slots))
    calls = _count_calls(monkeypatch, "gdn_fused")
    results = []
    cpu = CPUBackend(config, options=KernelOptions(fused_simd=simd))
    for be in (ReferenceBackend(config), cpu):
        conv, ssm = conv0.clone(), ssm0.clone()
        out = be.gdn_group(layer.spec, grp, mixed, z, a, b, conv, ssm)
        results.append((out, conv, ssm))
    assert calls[0] == 1
    (o_ref, c_ref, s_ref), (o, c, s) = results
    tol = _fused_tol(dtype)
    assert o.dtype == dtype and o.shape == (N, layer.value_dim)
    assert_rel_close(o.float(), o_ref.float(), tol, "output")
    assert torch.equal(c, c_ref), "conv states"
    assert_rel_close(s, s_ref, 1e-5, "recurrent states")
    if verify:  # the sources are left as they were
        assert torch.equal(s[slots], ssm0[slots]) and torch.equal(c[slots], conv0[slots])
    named = set(slots) | (set(slots_out.flatten().tolist()) if verify else set())
    free = [i for i in range(S) if i not in named]
    assert torch.equal(s[free], ssm0[free]) and torch.equal(c[free], conv0[free])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(2, 4, 6), (1, 2, 128)], ids=["grouped", "dv128"])
@pytest.mark.parametrize("lens,init", [([70], [False]), ([1, 40, 9], [False, True, False])],
                         ids=["one-prompt", "three-chunks"])
@pytest.mark.parametrize("simd", [2, 1, 0], ids=["avx512", "avx2", "plain"])
@pytest.mark.parametrize("max_rows", [1024, 16], ids=["whole", "pieces16"])
def test_fused_gdn_prompt_chunks_match_reference(dtype, heads, lens, init, simd, max_rows,
                                                 monkeypatch):
    """Prompt chunks of a GDN layer through the compiled call, token after token, a call per
    sequence (or per piece of ``fused_max_rows`` tokens of it, bit for bit the same): the
    gated-normed output and every named slot's conv and recurrent states as the reference's
    chunked form leaves them; a sequence without an initial state starts from zeros whatever
    its slot holds (NaN here), one with it from its slot; unnamed slots untouched."""
    from hybridrt.kernels.backend import ChunkedSeqs
    from hybridrt.kernels.conv import conv_plan
    from hybridrt.kernels.delta_rule import chunk_plan
    from hybridrt.model import GatedDeltaNet

    layer, config, _ = _layer(GatedDeltaNet, dtype, linear_num_key_heads=heads[0],
                              linear_num_value_heads=heads[1], linear_value_head_dim=heads[2])
    gen = torch.Generator().manual_seed(len(lens) + heads[0])
    S, T = 8, sum(lens)
    widths = [config.conv_dim, layer.value_dim, layer.num_v_heads, layer.num_v_heads]
    mixed, z, a, b = torch.randn(T, sum(widths), generator=gen).to(dtype).split(widths, dim=-1)
    conv0 = torch.randn(S, layer.kernel_size - 1, config.conv_dim, generator=gen).to(dtype)
    ssm0 = torch.randn(S, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
                       generator=gen) * 0.3
    slots = [5, 2, 6][:len(lens)]
    for slot, has in zip(slots, init):
        if not has:
            conv0[slot], ssm0[slot] = float("nan"), float("nan")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    c = ChunkedSeqs(None, cu, lens, torch.tensor(slots), torch.tensor(init), cu,
                    conv_plan(lens, layer.kernel_size, "cpu"), chunk_plan(lens, slots, init, "cpu"))
    calls = _count_calls(monkeypatch, "gdn_fused")
    results = []
    opts = KernelOptions(fused_simd=simd)
    for be, rows in ((ReferenceBackend(config), None), (CPUBackend(config, options=opts), max_rows),
                     (CPUBackend(config, options=opts), 1024)):
        be.fused_max_rows = rows or 1024
        conv, ssm = conv0.clone(), ssm0.clone()
        out = be.gdn_prompts(layer.spec, c, mixed, z, a, b, conv, ssm)
        results.append((out, conv, ssm))
    assert calls[0] == sum(-(-n // max_rows) for n in lens) + len(lens)
    (o_ref, c_ref, s_ref), (o, cv, sm), whole = results
    assert all(torch.equal(x, y) for x, y in zip((o, cv, sm), whole)), "pieces != one call"
    assert o.dtype == dtype and o.shape == (T, layer.value_dim)
    # the recurrence against the chunked form: the same roundings, sums in another order
    assert_rel_close(o.float(), o_ref.float(), _fused_tol(dtype), "output")
    assert torch.equal(cv[slots], c_ref[slots]), "conv states"
    assert_rel_close(sm[slots], s_ref[slots], 1e-5, "recurrent states")
    free = [i for i in range(S) if i not in slots]
    assert torch.equal(sm[free], ssm0[free]) and torch.equal(cv[free], conv0[free])


def _attention_inputs(layer, N, NB, bs, dtype, seed):
    """Random q/gate, k, v projections of N rows and K/V caches of NB blocks of bs slots."""
    gen = torch.Generator().manual_seed(seed)
    H, HKV, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    proj = torch.randn(N, H * 2 * D + 2 * HKV * D, generator=gen).to(dtype)
    qg, k, v = proj.split([H * 2 * D, HKV * D, HKV * D], dim=-1)
    kc0 = torch.randn(NB, bs, HKV, D, generator=gen).to(dtype)
    vc0 = torch.randn(NB, bs, HKV, D, generator=gen).to(dtype)
    return qg, k, v, kc0, vc0


def _attention_by_both(config, cpu, batch, layer, qg, k, v, kc0, vc0, cos, sin):
    """(out, key cache, value cache) of the reference backend's gated attention, then of
    ``cpu``'s, each on its own copy of the caches."""
    results = []
    for be in (ReferenceBackend(config), cpu):
        kc, vc = kc0.clone(), vc0.clone()
        out = be.gated_attention(be.plan_step(batch), batch, layer.spec, qg, k, v, kc, vc, cos,
                                 sin)
        results.append((out, kc, vc))
    return results


def _decode_batch(computed, tables, block_size, L=1):
    return build_batch([[1 + i] * L for i in range(len(computed))], computed, tables, block_size,
                       list(range(len(computed))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("D,simd", [(12, 2), (24, 2), (32, 2), (32, 1), (32, 0)],
                         ids=["d12", "d24-avx2", "d32-avx512", "d32-avx2", "d32-plain"])
def test_fused_decode_attention_matches_reference(dtype, gqa, L, D, simd, monkeypatch):
    """A step of L new tokens per sequence (decode, verification) of a gated attention layer
    in one compiled call: 3 sequences with 4, 44 and 0 tokens before (more than one
    32-position block of the online softmax; a fresh prompt when L > 1) over scattered blocks;
    q/k norms, partial RoPE, the KV writes, causal attention and the gate as the reference ops
    compute them; other cache slots untouched. Heads of 32 take the AVX-512 loops (16 dims a
    step), the AVX2 ones (8) or the plain C ones as asked where built; heads of 24 the AVX2
    ones, of 12 the plain ones."""
    from hybridrt.model import GatedAttention

    layer, config, net = _layer(GatedAttention, dtype, num_attention_heads=2 * gqa,
                                num_key_value_heads=2, head_dim=D)
    bs, NB = 4, 24
    batch = _decode_batch([4, 44, 0], [[3, 0], list(range(5, 17)), [4]], bs, L)
    H, D = layer.num_heads, layer.head_dim
    N = 3 * L
    qg, k, v, kc0, vc0 = _attention_inputs(layer, N, NB, bs, dtype, seed=gqa)
    cos, sin = net.rope(batch.positions, dtype)
    calls = _count_calls(monkeypatch, "attn_decode")
    cpu = CPUBackend(config, options=KernelOptions(fused_simd=simd))
    results = _attention_by_both(config, cpu, batch, layer, qg, k, v, kc0, vc0, cos, sin)
    assert calls[0] == 1
    (o_ref, k_ref, v_ref), (o, kc, vc) = results
    assert o.dtype == dtype and o.shape == (N, H * D)
    assert_rel_close(o.float(), o_ref.float(), _fused_tol(dtype), "output")
    assert_rel_close(kc.float(), k_ref.float(), _fused_tol(dtype), "key cache")
    assert torch.equal(vc, v_ref), "value cache"
    written = batch.slot_mapping.tolist()
    keep = [i for i in range(NB * bs) if i not in written]
    assert torch.equal(kc.view(NB * bs, -1)[keep], kc0.view(NB * bs, -1)[keep])


def test_fused_decode_attention_checks_the_cache_indices(monkeypatch):
    """A block table entry past the cache (or a KV slot) is an IndexError naming it, not a
    read outside the cache."""
    from hybridrt.model import GatedAttention

    layer, config, net = _layer(GatedAttention, torch.bfloat16)
    H, HKV, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    caches = [torch.zeros(4, 4, HKV, D, dtype=torch.bfloat16) for _ in range(2)]
    be = CPUBackend(config)
    # the second sequence's new token (position 5) lands in its second block
    for tables, what in (([[1], [7, 2]], "block table"), ([[1], [2, 9]], "KV slots")):
        batch = _decode_batch([2, 5], tables, 4)
        qg = torch.randn(2, H * 2 * D).bfloat16()
        kv = torch.randn(2, HKV * D).bfloat16()
        cos, sin = net.rope(batch.positions, torch.bfloat16)
        with pytest.raises(IndexError, match=what):
            be.gated_attention(be.plan_step(batch), batch, layer.spec, qg, kv, kv, *caches, cos,
                               sin)


def test_fused_simd_switch():
    """HYBRIDRT_FUSED_SIMD -> the CPU backend's vector level for the fused layers (one
    environment read, by hybridrt/env.py; no module global)."""
    for raw, level in (("avx2", 1), ("0", 0), ("AVX512", 2), ("", 2)):
        be = CPUBackend(None, options=kernel_options({"HYBRIDRT_FUSED_SIMD": raw}))
        assert level == be.fused_simd, raw
    with pytest.raises(ValueError, match="HYBRIDRT_FUSED_SIMD='sse9': choose avx512"):
        CPUBackend(None, options=kernel_options({"HYBRIDRT_FUSED_SIMD": "sse9"}))
    assert CPUBackend(None).fused_simd == 2


def test_fused_gdn_layer_checks_the_slots():
    from hybridrt.kernels.backend import RecurrentGroup
    from hybridrt.model import GatedDeltaNet

    layer, config, _ = _layer(GatedDeltaNet, torch.bfloat16)
    _require_native()
    x = torch.randn(2, config.conv_dim + layer.value_dim + 2 * layer.num_v_heads).bfloat16()
    mixed, z, a, b = x.split([config.conv_dim, layer.value_dim, layer.num_v_heads,
                              layer.num_v_heads], dim=-1)
    conv = torch.zeros(4, layer.kernel_size - 1, config.conv_dim, dtype=torch.bfloat16)
    ssm = torch.zeros(4, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    for slots, out in (([0, 4], None), ([0, 1], [[2], [5]])):
        grp = RecurrentGroup(None, 2, 1, torch.tensor(slots),
                             None if out is None else torch.tensor(out), [])
        with pytest.raises(IndexError, match="state slots out of range"):
            CPUBackend(config).gdn_group(layer.spec, grp, mixed, z, a, b, conv, ssm)


@pytest.mark.parametrize("shape,residual,strided", [
    ((5, 64), True, False), ((2, 3, 40), True, False), ((4, 64), False, True),
    ((1, 1024), True, False)])
def test_fused_rms_norm_matches_reference(shape, residual, strided, monkeypatch):
    """bf16 rows (2-D, 3-D, a column slice of a wider tensor) with and without the residual
    add: the reference ops' values exactly (the bf16 roundings hide the sums' order here);
    fp32 keeps the torch ops."""
    calls = _count_calls(monkeypatch, "rms_norm")
    gen = torch.Generator().manual_seed(shape[-1])
    D = shape[-1]
    x = torch.randn(*shape[:-1], D + 16 if strided else D, generator=gen).bfloat16()[..., :D]
    r = torch.randn(shape, generator=gen).bfloat16() if residual else None
    w = (torch.randn(D, generator=gen) * 0.2).bfloat16()
    ref, cpu = ReferenceBackend(), CPUBackend()
    want, got = ref.rms_norm(x, w, 1e-6, r), cpu.rms_norm(x, w, 1e-6, r)
    if residual:
        assert torch.equal(got[1], want[1]), "residual sum"
        want, got = want[0], got[0]
    assert torch.equal(got, want)
    cpu.rms_norm(x.float(), w.float(), 1e-6)
    assert calls[0] == 1


def _vm_flags(addr: int) -> str:
    """The VmFlags of the mapping holding ``addr``."""
    return _smaps(addr).get("VmFlags", "")


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_loaded_weights_live_in_huge_pages(tmp_path, monkeypatch, quantization):
    """A loaded bf16 (or int8, int4) model on the CPU backend holds every weight matrix (the
    merged groups and the rest, the tied LM head too; quantized values, codes and scales) in
    mappings advised for transparent huge pages (smaps VmFlags "hg"); with
    ``HYBRIDRT_HUGE_PAGES=0`` none is, and the tokens are the same."""
    from hybridrt.kernels import memory

    if not memory.huge_pages_available():
        pytest.skip("transparent huge pages are off here (or not Linux)")
    # MLP widths of whole 16-row panels: int8 gate/up merge too
    d = write_random_checkpoint(tmp_path / "m", tiny_text_config(intermediate_size=64), seed=3)
    outs = []
    for env in ("0", "1"):
        monkeypatch.setenv("HYBRIDRT_HUGE_PAGES", env)
        llm = LLM(d, dtype="bfloat16", tokenizer=None, max_model_len=64, max_num_seqs=2,
                  cache_memory=8 << 20, quantization=quantization)
        model = llm.engine.runner.model
        assert model.backend.groups  # merged groups: made in the arena
        if quantization:
            mats = [t for m in model.modules() if getattr(m, "qweight", None) is not None
                    for t in m.qweight.tensors()]
        else:
            mats = [m.weight for m in model.modules()
                    if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
        assert len(mats) > 10
        huge = ["hg" in _vm_flags(w.data_ptr()).split() for w in mats]
        assert all(huge) if env == "1" else not any(huge), huge
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs.append([o.outputs[0].token_ids for o in llm.generate(
            [[3, 4, 5], list(range(7, 30))], params, use_tqdm=False)])
    assert outs[0] == outs[1]


def _mapping(addr: int) -> tuple[str, int]:
    """(path, resident kB) of the mapping holding ``addr``."""
    e = _smaps(addr)
    return e.get("path", ""), int(e.get("Rss", "0 kB").split()[0])


def test_populate_maps_a_file_mappings_pages_in_without_copying(tmp_path, monkeypatch):
    """``memory.populate`` over tensors in a file mapping: every page resident in the process
    afterwards (smaps Rss of the mapping), the tensors' addresses and bytes unchanged."""
    import mmap
    import warnings

    from hybridrt.kernels import memory

    if not memory.huge_pages_available():  # Linux with /proc
        pytest.skip("not Linux")
    f = tmp_path / "w.bin"
    f.write_bytes(bytes(range(256)) * (4 << 12))  # 4 MiB
    with open(f, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only buffer: only read here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(buf, dtype=torch.uint8)
    path, before = _mapping(t.data_ptr())
    assert path == str(f) and before < 4096
    ptr = t.data_ptr()
    monkeypatch.setattr(memory, "settle_at_load", False)
    memory.populate([t[: 2 << 20], t[2 << 20:]])
    assert memory.wait_for_huge_pages(30)
    assert _mapping(ptr)[1] == 4096 and t.data_ptr() == ptr and int(t[1000]) == 1000 % 256


def test_moe_experts_stay_in_the_checkpoint_mapping(tmp_path, monkeypatch):
    """A stored 4-bit MoE checkpoint loaded with huge pages on: the dense weights move into
    the huge-page arena, the routed experts (and the embedding, untied from the head) stay in
    the safetensors file's mapping (no copy at load), the experts handed to ``populate``; the
    tokens equal a load with huge pages off."""
    from hybridrt import weights
    from hybridrt.bench.moe_fixtures import tiny_moe_config
    from hybridrt.bench.moe_shape import write_shape_checkpoint
    from hybridrt.kernels import memory

    if not memory.huge_pages_available():
        pytest.skip("transparent huge pages are off here (or not Linux)")
    info = write_shape_checkpoint(tmp_path / "m", layers=4, quantization="int4",
                                  text_config=tiny_moe_config(tie_word_embeddings=False))
    asked = []
    monkeypatch.setattr(weights, "populate", lambda ts: asked.extend(ts))
    outs = []
    for env in ("1", "0"):
        monkeypatch.setenv("HYBRIDRT_HUGE_PAGES", env)
        llm = LLM(info["path"], tokenizer=None, max_model_len=64, cache_memory=8 << 20)
        model = llm.engine.runner.model
        experts = weights.expert_tensors(model)
        dense = [t for n, m in model.named_modules() if not weights.is_expert(n)
                 and not n.endswith("embed_tokens")
                 and getattr(m, "qweight", None) is not None for t in m.qweight.tensors()]
        assert len(experts) > 10 and dense
        embed = model.model.embed_tokens
        embed = (embed.qweight.tensors() if getattr(embed, "qweight", None) is not None
                 else [embed.weight])
        if env == "1":
            assert all(_mapping(t.data_ptr())[0].endswith(".safetensors")
                       for t in [*experts, *embed])  # the untied embedding: a row a step
            assert all("hg" in _vm_flags(t.data_ptr()).split() for t in dense)
            assert {t.data_ptr() for t in asked} == {t.data_ptr() for t in experts}
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs.append([o.outputs[0].token_ids for o in llm.generate(
            [[3, 4, 5], list(range(7, 30))], params, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_merged_projections_stay_on_the_weights_device():
    """``merge_projections`` builds each group where its weights are (the meta device here,
    standing in for a GPU: a host-side default would move the CUDA backend's weights off it)."""
    from hybridrt.config import ModelConfig
    from hybridrt.model import Qwen35ForCausalLM
    from hybridrt.weights import merge_projections

    with torch.device("meta"):
        net = Qwen35ForCausalLM(ModelConfig.from_dict(tiny_text_config()))
    groups = merge_projections(net)
    assert groups and all(w.device.type == "meta" for w, _ in groups.values())


def test_layer_records_follow_the_parameters():
    """The records a layer hands the backend (``spec``: tensors and sizes, no module) hold the
    layer's own parameters, and are built again after a ``load_state_dict(assign=True)``
    replaces them."""
    from hybridrt.model import GatedAttention, GatedDeltaNet

    net, config, sd = build_model(tiny_text_config(), seed=4)
    gdn = next(m for m in net.modules() if isinstance(m, GatedDeltaNet))
    attn = next(m for m in net.modules() if isinstance(m, GatedAttention))
    assert gdn.spec is gdn.spec and gdn.spec.A_log is gdn.A_log
    assert gdn.spec.conv_weight.shape == (config.conv_dim, gdn.kernel_size)
    assert (gdn.spec.key_dim, gdn.spec.value_dim) == (gdn.key_dim, gdn.value_dim)
    assert attn.spec.q_norm_weight is attn.q_norm.weight and attn.spec.scale == attn.scale
    net.load_state_dict({n: t.clone() for n, t in sd.items()}, assign=True)
    assert gdn.spec.A_log is gdn.A_log and attn.spec.k_norm_weight is attn.k_norm.weight


@pytest.mark.parametrize("buffers", [False, True])
def test_decode_batch_fields(buffers):
    """build_batch's decode path (one token a sequence, every logits row): each field as the
    general path defines it, KV slots across block boundaries included."""
    from hybridrt.kernels.meta import StepBuffers

    arr = StepBuffers.for_limits(4, 64, 8) if buffers else None
    if arr is not None:
        arr.begin()
    tables = [[4, 9, 2], [7], [3, 5]]
    starts, bs = [16, 3, 15], 8  # 16: the first slot of the third block; 15: the last of the 2nd
    b = build_batch([[11], [12], [13]], starts, tables, bs, [2, 0, 1], None, None, "cpu", arr)
    assert b.input_ids.tolist() == [11, 12, 13] and b.positions.tolist() == starts
    assert b.slot_mapping.tolist() == [2 * bs + 0, 7 * bs + 3, 5 * bs + 7]
    assert b.seq_lens.tolist() == [17, 4, 16] and b.cu_seqlens.tolist() == [0, 1, 2, 3]
    assert b.block_tables.tolist() == [[4, 9, 2], [7, 0, 0], [3, 5, 0]]
    assert b.state_slots.tolist() == [2, 0, 1] and b.logits_indices.tolist() == [0, 1, 2]
    assert b.has_initial_state.tolist() == [True, True, True]
    assert b.query_lens == [1, 1, 1] and b.context_lens == [17, 4, 16]
    assert b.query_starts == [0, 1, 2] and b.num_tokens == 3
    # the same sequences with one wanting no logits take the general path: the same fields
    g = build_batch([[11], [12], [13]], starts, tables, bs, [2, 0, 1], ["last", "none", "last"])
    for name in ("input_ids", "positions", "cu_seqlens", "seq_lens", "slot_mapping",
                 "block_tables", "state_slots", "has_initial_state"):
        assert torch.equal(getattr(b, name), getattr(g, name)), name
    assert g.logits_indices.tolist() == [0, 2]
    first = build_batch([[5]], [0], [[6]], bs)  # a first token: no initial state
    assert first.has_initial_state.tolist() == [False] and first.slot_mapping.tolist() == [48]


def test_backends_follow_the_protocol_and_compose():
    """Every CPU-side backend offers what ``Backend`` names; the CPU backend holds a reference
    backend for the steps it has no kernel for instead of deriving from it (no base class
    calling back into its subclass), and its GDN fallback runs its own decode step."""
    from hybridrt.kernels.backend import Backend

    for backend in (ReferenceBackend(), CPUBackend()):
        assert isinstance(backend, Backend), type(backend).__name__
    cpu = CPUBackend()
    assert not isinstance(cpu, ReferenceBackend) and isinstance(cpu.ref, ReferenceBackend)
    assert cpu.ref.gdn_step is (native.gdn_decode_step if cpu.native else None)


def test_model_record_holds_the_laid_out_weights():
    """``bind`` gets the decoder as a record built after the weights were laid out: per layer
    the mixer's own record, the norms' parameters and the weights each product reads (the
    merged groups' views), in the model's order."""
    from hybridrt.kernels.backend import AttentionLayer, GDNLayer, ModelRecord
    from hybridrt.kernels.quant import kernel_weight

    net, config, _ = build_model(tiny_text_config(), seed=4, dtype=torch.bfloat16)
    bound = []

    class Recording(CPUBackend):
        def bind(self, record, groups):
            bound.append(record)
            super().bind(record, groups)

    backend = Recording(config)
    net.set_backend(backend)
    (record,) = bound
    assert isinstance(record, ModelRecord) and record.dtype == torch.bfloat16
    assert record.norm_weight is net.model.norm.weight and record.norm_eps == net.model.norm.eps
    assert len(record.decoder) == len(net.model.layers)
    for r, layer in zip(record.decoder, net.model.layers):
        m = layer.mixer
        assert r.mixer_layer is m.spec
        assert isinstance(r.mixer_layer, GDNLayer if layer.layer_type == "linear_attention"
                          else AttentionLayer)
        assert r.input_norm_weight is layer.input_layernorm.weight
        assert r.post_norm_weight is layer.post_attention_layernorm.weight
        assert [id(w) for w in r.mixer_in] == [id(kernel_weight(p)) for p in m.in_projections]
        assert r.mixer_out is kernel_weight(m.out_projection)
        assert r.mlp_out is kernel_weight(layer.mlp.down_proj)
        if backend.half_simd:  # merged: the record's weights key the groups
            assert tuple(id(w) for w in r.mixer_in) in backend.groups
            assert tuple(id(w) for w in r.mlp_in) in backend.groups
    if backend.fast is not None:
        assert [f.mixer_layer for f in backend.fast] == [r.mixer_layer for r in record.decoder]


def test_cache_tensors_are_private_memory_that_takes_huge_pages():
    """The KV blocks (``CacheTensors.allocate`` on the CPU; the GDN state slots likewise) are
    private anonymous mappings advised for huge pages (smaps VmFlags "hg"), which the kernel can
    back with them ("THPeligible: 1"): a shared anonymous mapping (Python's ``mmap.mmap(-1, n)``
    default) is shmem, which takes no transparent huge pages where shmem's are off, as they
    are by default, and the advice did nothing."""
    from hybridrt.config import ModelConfig
    from hybridrt.kernels import memory
    from hybridrt.statecache.tensors import CacheTensors

    if not memory.huge_pages_available():
        pytest.skip("transparent huge pages are off here (or not Linux)")
    config = ModelConfig.from_dict(tiny_text_config())
    blocks = (8 << 20) // CacheTensors.bytes_per_block(config, 16, torch.bfloat16)
    t = CacheTensors.allocate(config, num_blocks=blocks, num_slots=2)
    for x in (t.key_caches[0], t.value_caches[-1]):  # (smaller tensors are not advised)
        x.fill_(1)
        e = _smaps(x.data_ptr())
        assert "hg" in e["VmFlags"].split() and "sh" not in e["VmFlags"].split(), e["VmFlags"]
        assert e.get("THPeligible", "1") == "1", e  # (the field: Linux 5.0 on)
        assert int(e["Anonymous"].split()[0]) > 0, e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_attention_of_unequal_few_tokens_runs_one_call_per_count(dtype, monkeypatch):
    """A step whose sequences have 1 to 8 new tokens, not all as many (a verification beside
    decodes, as adaptive k makes), runs compiled: one call per count, each row the bits it gets
    in a call of its own sequence alone, the reference's values (not the reference's gathered
    attention over the whole context, which at 16k cached tokens took a batch of 32 from 52 to
    5 tokens a second)."""
    from hybridrt.model import GatedAttention

    layer, config, net = _layer(GatedAttention, dtype, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32)
    bs, NB = 4, 24
    computed, tables = [4, 44, 9], [[3, 0], list(range(5, 17)), [4, 17, 18, 19]]
    lens = [2, 1, 3]
    batch = build_batch([[1 + i] * n for i, n in enumerate(lens)], computed, tables, bs,
                        [0, 1, 2])
    qg, k, v, kc0, vc0 = _attention_inputs(layer, sum(lens), NB, bs, dtype, seed=5)
    cos, sin = net.rope(batch.positions, dtype)
    calls = _count_calls(monkeypatch, "attn_decode")
    cpu = CPUBackend(config)
    results = _attention_by_both(config, cpu, batch, layer, qg, k, v, kc0, vc0, cos, sin)
    assert calls[0] == 3
    (o_ref, k_ref, v_ref), (o, kc, vc) = results
    assert_rel_close(o.float(), o_ref.float(), _fused_tol(dtype), "output")
    assert torch.equal(vc, v_ref), "value cache"
    start = 0
    for i, n in enumerate(lens):  # each sequence alone: the same bits
        one = build_batch([[1 + i] * n], [computed[i]], [tables[i]], bs, [i])
        rows = slice(start, start + n)
        c1, s1 = net.rope(one.positions, dtype)
        alone = cpu.gated_attention(cpu.plan_step(one), one, layer.spec, qg[rows], k[rows],
                                    v[rows], kc0.clone(), vc0.clone(), c1, s1)
        assert torch.equal(alone, o[rows]), f"sequence {i}"
        start += n

import math

import pytest
import torch

from hybridrt.request import find_stop
from hybridrt.sampler import (
    RowLogprobs,
    Sampler,
    SamplingRow,
    _inverse_cdf,
    make_generator,
)
from hybridrt.sampling_params import SamplingParams

# A crafted distribution: token i has probability PROBS[i]; tokens 5..7 have none.
PROBS = [0.5, 0.3, 0.1, 0.06, 0.04]
VOCAB = 8


def crafted_logits(num_rows: int) -> torch.Tensor:
    row = torch.full((VOCAB,), float("-inf"))
    row[: len(PROBS)] = torch.tensor(PROBS).log()
    return row.expand(num_rows, VOCAB).clone()


def rows_of(params: SamplingParams, n: int) -> list[SamplingRow]:
    return [SamplingRow(params) for _ in range(n)]


# SamplingParams validation ------------------------------------------------------------------
BAD_PARAMS = [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.5), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", math.nan),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.inf),
    ("frequency_penalty", 3), ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5),
    ("min_tokens", -1), ("min_tokens", 0.5),
    ("seed", 1.5), ("seed", "7"),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", 3),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.5),
    ("ignore_eos", 1),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS,
                         ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("stop", [5, ["a", 2], [None], {"a"}, b"stop"])
def test_unknown_stop_type(stop):
    with pytest.raises(ValueError, match="unknown stop type") as info:
        SamplingParams(stop=stop)
    assert "stop" in str(info.value).split(":")[0]


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert isinstance(SamplingParams(temperature=0).temperature, float)
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(logprobs=20).logprobs == 20


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy
    assert not SamplingParams(temperature=0.1, top_k=2).greedy


def test_clone_revalidates_and_copies_lists():
    p = SamplingParams(stop=["x"], stop_token_ids=[7], temperature=0.5)
    q = p.clone(temperature=0.0)
    assert q.temperature == 0.0 and q.stop == ["x"] and p.temperature == 0.5
    q.stop.append("y")
    q.stop_token_ids.append(8)
    assert p.stop == ["x"] and p.stop_token_ids == [7]
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0.0)
    with pytest.raises(ValueError, match="bogus"):
        p.clone(bogus=1)


# Greedy -------------------------------------------------------------------------------------
def test_greedy_equals_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 101)
    rows = [SamplingRow(SamplingParams(temperature=0.0)), SamplingRow(SamplingParams(top_k=1)),
            SamplingRow(SamplingParams(temperature=0.0, top_p=0.1, min_p=0.9)),
            SamplingRow(SamplingParams(temperature=0.7)),
            SamplingRow(SamplingParams(top_k=1, temperature=3.0)),
            SamplingRow(SamplingParams(temperature=0.0, seed=3))]
    before = logits.clone()
    out = Sampler(seed=0).sample(logits, rows)
    greedy = [0, 1, 2, 4, 5]
    assert out.token_ids[greedy].tolist() == logits.argmax(-1)[greedy].tolist()
    assert torch.equal(logits, before)
    assert out.logprobs is None


def test_greedy_rows_untouched_by_prepare():
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    rows = rows_of(SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5), 2)
    assert torch.equal(Sampler().processed_logits(logits, rows), logits)


# Filtering ------------------------------------------------------------------------------------
def sampled_support(params: SamplingParams, n: int = 3000) -> tuple[set[int], torch.Tensor]:
    out = Sampler(seed=123).sample(crafted_logits(n), rows_of(params, n))
    tokens = out.token_ids
    return set(tokens.tolist()), torch.bincount(tokens, minlength=VOCAB).float() / n


@pytest.mark.parametrize(("params", "allowed"), [
    pytest.param(SamplingParams(), {0, 1, 2, 3, 4}, id="unfiltered"),
    pytest.param(SamplingParams(top_k=3), {0, 1, 2}, id="top_k3"),
    pytest.param(SamplingParams(top_k=2, top_p=0.99), {0, 1}, id="top_k2-top_p"),
    pytest.param(SamplingParams(top_p=0.75), {0, 1}, id="top_p0.75"),
    pytest.param(SamplingParams(top_p=0.85), {0, 1, 2}, id="top_p0.85"),
    pytest.param(SamplingParams(top_p=0.01), {0}, id="top_p-keeps-top1"),
    pytest.param(SamplingParams(min_p=0.15), {0, 1, 2}, id="min_p0.15"),
    pytest.param(SamplingParams(min_p=0.5), {0, 1}, id="min_p0.5"),
    pytest.param(SamplingParams(min_p=1.0), {0}, id="min_p-keeps-top1"),
    # temperature 2 flattens the distribution before min-p: sqrt(p) / sqrt(0.5) = 1, .77, .45
    pytest.param(SamplingParams(temperature=2.0, min_p=0.4), {0, 1, 2}, id="temp2-min_p0.4"),
    pytest.param(SamplingParams(temperature=1.0, min_p=0.4), {0, 1}, id="temp1-min_p0.4"),
    pytest.param(SamplingParams(top_k=4, top_p=0.9, min_p=0.15), {0, 1, 2}, id="k-p-min_p"),
])
def test_filtering_support_is_exact(params, allowed):
    support, freq = sampled_support(params)
    assert support == allowed
    expected = torch.zeros(VOCAB)
    kept = sorted(allowed)
    weights = torch.tensor([PROBS[i] for i in kept]) ** (1.0 / params.temperature)
    expected[kept] = weights / weights.sum()
    assert torch.allclose(freq, expected, atol=0.04)


def test_prepare_marks_filtered_tokens_minus_inf():
    logits = crafted_logits(2)
    rows = [SamplingRow(SamplingParams(temperature=0.5, top_k=3)),
            SamplingRow(SamplingParams(top_p=0.75))]
    processed = Sampler().processed_logits(logits, rows)
    assert torch.equal(processed[0, :3], logits[0, :3] / 0.5)
    assert torch.isneginf(processed[0, 3:]).all()
    assert torch.equal(processed[1, :2], logits[1, :2])
    assert torch.isneginf(processed[1, 2:]).all()


def test_top_k_larger_than_vocab_is_a_no_op():
    logits = crafted_logits(1)
    rows = [SamplingRow(SamplingParams(top_k=1000))]
    assert torch.equal(Sampler().processed_logits(logits, rows), logits)


# Penalties ------------------------------------------------------------------------------------
def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]]).repeat(3, 1)
    pen = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                         presence_penalty=0.25)
    rows = [
        SamplingRow(pen, prompt_token_ids=[0, 1], output_token_ids=[2, 2, 3]),
        SamplingRow(SamplingParams(temperature=0.0), [0, 1], [2, 2, 3]),
        SamplingRow(SamplingParams(presence_penalty=-1.0), [5], [5, 4, 4]),
    ]
    processed = Sampler().processed_logits(logits, rows)
    # repetition over prompt+output {0,1,2,3}: 2/2, -1*2, 0.5/2, -0.5*2; then output counts
    # {2: 2, 3: 1} cost 0.5 each (frequency) and 0.25 once (presence); prompt tokens only get
    # the repetition penalty.
    expected = torch.tensor([
        [1.0, -2.0, 0.25 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 1.0, 3.0],
        [2.0, -1.0, 0.5, -0.5, 1.0, 3.0],
        [2.0, -1.0, 0.5, -0.5, 2.0, 4.0],
    ])
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_below_one_rewards_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    rows = [SamplingRow(SamplingParams(temperature=0, repetition_penalty=0.5), [1], [0])]
    torch.testing.assert_close(Sampler().processed_logits(logits, rows),
                               torch.tensor([[4.0, -0.5, 0.5]]))


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert Sampler().sample(logits, [SamplingRow(params, [], [0])]).token_ids.item() == 1
    assert Sampler().sample(logits, [SamplingRow(params, [0], [])]).token_ids.item() == 0


def test_out_of_range_token_ids_are_rejected():
    rows = [SamplingRow(SamplingParams(repetition_penalty=1.1), [0, 99], [])]
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        Sampler().processed_logits(crafted_logits(1), rows)


def test_bad_logits_shape():
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(torch.zeros(2, 5), rows_of(SamplingParams(), 3))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        Sampler().sample(torch.zeros(5), rows_of(SamplingParams(), 5))


# min_tokens -----------------------------------------------------------------------------------
def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 9.0]]).repeat(2, 1)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])
    other = SamplingRow(SamplingParams(temperature=0.0), eos_token_ids=[4])
    sampler = Sampler()
    for produced in range(3):
        row = SamplingRow(params, [0], [3] * produced, eos_token_ids=[4])
        processed = sampler.processed_logits(logits, [row, other])
        assert torch.isneginf(processed[0, [1, 4]]).all()
        assert torch.isfinite(processed[0, [0, 2, 3]]).all()
        assert sampler.sample(logits, [row, other]).token_ids.tolist() == [3, 4]
    done = SamplingRow(params, [0], [3, 3, 3], eos_token_ids=[4])
    assert sampler.sample(logits, [done, other]).token_ids.tolist() == [4, 4]


def test_min_tokens_holds_for_random_rows():
    logits = torch.tensor([[0.0, 0.0, 6.0]]).repeat(500, 1)
    rows = [SamplingRow(SamplingParams(min_tokens=1), eos_token_ids=[2]) for _ in range(500)]
    assert 2 not in Sampler(seed=0).sample(logits, rows).token_ids.tolist()


# Seeds ------------------------------------------------------------------------------------------
def run_seeded(seed: int, batch_of: int, steps: int = 24) -> list[int]:
    torch.manual_seed(99)
    base = torch.randn(steps, 64)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    generator = make_generator(params)
    fillers = [SamplingParams(temperature=0.0), SamplingParams(seed=seed + 1),
               SamplingParams(top_k=5), SamplingParams(seed=7, min_p=0.1)]
    filler_gens = [make_generator(p) for p in fillers]
    sampler = Sampler()
    tokens: list[int] = []
    for step in range(steps):
        row = SamplingRow(params, [1, 2], list(tokens), generator)
        others = [SamplingRow(p, [3], [], g) for p, g in zip(fillers, filler_gens)]
        others = others[: batch_of - 1]
        position = step % batch_of
        rows = others[:position] + [row] + others[position:]
        logits = torch.randn(batch_of, 64)
        logits[position] = base[step]
        tokens.append(int(sampler.sample(logits, rows).token_ids[position]))
    return tokens


def test_seeded_rows_ignore_batch_composition():
    alone = run_seeded(1234, batch_of=1)
    assert run_seeded(1234, batch_of=5) == alone
    assert run_seeded(1234, batch_of=3) == alone


def test_different_seeds_differ():
    assert run_seeded(1, batch_of=1) != run_seeded(2, batch_of=1)


def test_make_generator():
    assert make_generator(SamplingParams()) is None
    a = make_generator(SamplingParams(seed=5))
    b = make_generator(SamplingParams(seed=5))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert make_generator(SamplingParams(seed=-1)) is not None


def test_sampler_seed_makes_unseeded_rows_reproducible():
    logits = crafted_logits(50)
    rows = rows_of(SamplingParams(), 50)
    assert torch.equal(Sampler(seed=4).sample(logits, rows).token_ids,
                       Sampler(seed=4).sample(logits, rows).token_ids)


# probs / sample_from_probs ------------------------------------------------------------------
def test_probs_sum_to_one_and_greedy_rows_are_one_hot():
    torch.manual_seed(2)
    logits = torch.randn(4, 40)
    rows = [SamplingRow(SamplingParams(temperature=0.0)), SamplingRow(SamplingParams(top_k=4)),
            SamplingRow(SamplingParams(temperature=0.3, top_p=0.5)),
            SamplingRow(SamplingParams(top_k=1))]
    sampler = Sampler()
    processed = sampler.processed_logits(logits, rows)
    probs = sampler.probs(processed, rows)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    for i in (0, 3):
        expected = torch.zeros(40)
        expected[logits[i].argmax()] = 1.0
        assert torch.equal(probs[i], expected)
    assert (probs[1] > 0).sum() == 4
    assert torch.equal(probs[1] > 0, torch.isfinite(processed[1]))
    torch.testing.assert_close(probs[2], torch.softmax(processed[2], -1))


def test_sample_from_probs_never_picks_zero_probability():
    residual = torch.tensor([[0.0, 0.2, 0.0, 0.1, 0.0]]).repeat(2000, 1)  # unnormalised
    tokens = Sampler(seed=0).sample_from_probs(residual, rows_of(SamplingParams(), 2000))
    assert set(tokens.tolist()) == {1, 3}
    assert abs((tokens == 1).float().mean().item() - 2 / 3) < 0.04


def test_inverse_cdf_edges():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.3, 0.7, 0.0, 0.0], [0.3, 0.7, 0.0, 0.0]])
    u = torch.tensor([0.0, 1.0, 0.0])  # u == 1 stands for u * total rounding up to total
    assert _inverse_cdf(probs, u).tolist() == [1, 1, 0]


def test_uniform_draws_one_value_per_row_from_its_generator():
    params = SamplingParams(seed=11)
    g = make_generator(params)
    rows = [SamplingRow(SamplingParams()), SamplingRow(params, generator=g)]
    u = Sampler(seed=0).uniform(rows, 3, "cpu")
    assert u.shape == (2, 3)
    assert torch.equal(u[1], torch.rand(3, generator=make_generator(params)))


# Logprobs -------------------------------------------------------------------------------------
def test_logprobs_match_log_softmax_of_penalised_logits():
    torch.manual_seed(3)
    logits = torch.randn(4, 30)
    rows = [
        SamplingRow(SamplingParams(logprobs=5, temperature=0.5, top_k=3)),
        SamplingRow(SamplingParams(logprobs=0, temperature=0.0)),
        SamplingRow(SamplingParams()),
        SamplingRow(SamplingParams(logprobs=2, temperature=0.0, frequency_penalty=1.0),
                    output_token_ids=[int(logits[3].argmax())]),
    ]
    out = Sampler(seed=1).sample(logits, rows)
    assert out.logprobs[2] is None
    penalised = logits.clone()
    penalised[3, logits[3].argmax()] -= 1.0
    reference = torch.log_softmax(penalised, -1)  # before temperature and top-k
    for i, n in ((0, 5), (1, 0), (3, 2)):
        lp = out.logprobs[i]
        assert isinstance(lp, RowLogprobs)
        token = int(out.token_ids[i])
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[i, token].item(), abs=1e-6)
        assert lp.rank == int((reference[i] > reference[i, token]).sum()) + 1
        values, ids = reference[i].topk(n)
        assert len(lp.top) == n
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[3].rank == 1  # greedy picks the best penalised token


def test_top_logprobs_break_ties_by_token_id_whatever_the_batch():
    """Equal logprobs (bf16 logits tie often) are listed lowest token id first, so a row's top
    list is the same alone and beside rows asking for more of them or fewer; every value above
    the last one listed is in it."""
    row = torch.tensor([0.5, 2.0, 1.0, 2.0, 1.0, -1.0, 2.0, 1.0, 0.0, 1.0])
    other = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    for n, ids in ((2, [1, 3]), (4, [1, 3, 6, 2]), (6, [1, 3, 6, 2, 4, 7])):
        tops = []
        for logits, wants in ((row[None], [n]), (torch.cat([other, row[None]]), [9, 1, 0, n]),
                              (torch.cat([row[None], other]), [n, 3, 20, 5])):
            rows = [SamplingRow(SamplingParams(logprobs=k, temperature=0.0)) for k in wants]
            j = 0 if logits.shape[0] == 1 or wants[0] == n else logits.shape[0] - 1
            tops.append(Sampler(seed=1).sample(logits, rows).logprobs[j].top)
        assert [t for t, _ in tops[0]] == ids, n
        assert tops[1] == tops[0] == tops[2], n


# Stop strings ---------------------------------------------------------------------------------
def test_find_stop_basic():
    assert find_stop("hello world", ["world"], 0) == 6
    assert find_stop("hello world", ["xyz"], 0) is None
    assert find_stop("hello world", [], 0) is None
    assert find_stop("a END b STOP", ["STOP", "END"], 0) == 2


def test_find_stop_straddling_two_deltas():
    text = "Hello wor"
    assert find_stop(text, ["world"], 0) is None
    start = len(text)
    text += "ld! more"
    assert find_stop(text, ["world"], start) == 6


def test_find_stop_only_searches_where_a_new_match_can_appear():
    # "ab" at 0 ended before the new text; only from start - len + 1 on is searched.
    assert find_stop("ab xyz ab", ["ab"], 6) == 7
    assert find_stop("ab xyz", ["ab"], 4) is None
    assert find_stop("xab", ["ab"], 2) == 1
    assert find_stop("short", ["t"], 4) == 4
    assert find_stop("short", ["t"], 5) is None  # nothing new since the last call


@pytest.fixture(params=["torch", "native"])
def argmax_path(request, monkeypatch):
    """sampler.argmax_rows by each of its paths: the torch two-pass form and csrc/argmax.c."""
    from hybridrt.kernels import native

    if request.param == "native":
        if native.load() is None:
            pytest.skip("no compiled CPU kernels")
    else:
        monkeypatch.setattr(native, "argmax_rows", lambda x: None)
    return request.param


@pytest.fixture(params=[1, 3])
def argmax_threads(request):
    """Torch's thread count (the kernel's): 3 splits one row in parts (a part per thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1, 63, 64, 65, 100, 255, 256, 257, 513, 2048, 2049, 3 * 2048 + 7,
                               65536 + 1000, 248320])
def test_argmax_rows_equals_torch_argmax(V, dtype, argmax_path, argmax_threads):
    """The greedy pick returns exactly torch's argmax: first maximum on ties, NaN as maximal,
    rows of -inf, maxima in the short tail block, +0 tied with -0, rows with a stride; one row
    split among threads too (ties and NaNs across the parts)."""
    from hybridrt.sampler import argmax_rows

    x = torch.randn(7, V, generator=torch.Generator().manual_seed(V)).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    x[0] = 1.0  # all tied: index 0
    x[1, [V // 2, V - 1]] = float("nan")
    x[2, -1] = 1e9  # in the tail
    x[3] = float("-inf")
    x[4, [V - 1, V // 3]] = 50.0  # a tie across blocks: the earlier one
    x[5] = -1.0
    x[5, [V - 1, V // 2]] = torch.tensor([-0.0, 0.0], dtype=dtype)
    x[6, V - 1] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    wide = torch.zeros(7, V + 5, dtype=dtype)
    wide[:, :V] = x
    view = wide[:, :V]  # rows V + 5 apart
    assert torch.equal(argmax_rows(view), x.argmax(-1))
    for r in range(7):  # one row: in parts where there are threads
        assert torch.equal(argmax_rows(x[r:r + 1]), x[r:r + 1].argmax(-1)), r
    if V >= 3 * 256:  # across the parts of three threads: a tie, a NaN in the last part only
        y = torch.zeros(1, V, dtype=dtype)
        y[0, [V // 3 + 5, V - 2]] = 7.0
        assert argmax_rows(y).item() == V // 3 + 5
        y[0, V - 1] = float("nan")
        assert argmax_rows(y).item() == V - 1
        y[0, 1] = float("nan")
        assert argmax_rows(y).item() == 1
        y = torch.zeros(1, V, dtype=dtype)  # one maximum at either side of every block edge
        for p in sorted({q for k in range(1, V // 256 + 1) for q in (256 * k - 1, 256 * k)}
                        - {V}):
            y[0, p] = 1.0
            assert argmax_rows(y).item() == p
            y[0, p] = 0.0


def test_greedy_fast_path_is_the_full_pipeline(argmax_path):
    """Plain greedy rows skip the fp32 copy and the filters (they never reach ``_penalise``)
    and get the tokens of rows that take the whole pipeline (kept on it by a presence penalty
    of 1e-30, which moves nothing before any output), on bf16 logits with ties and NaN."""
    V = 5000
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[1, [7, 4000]] = 9.0
    x[2, 2500] = float("nan")
    sampler = Sampler()
    sampler._penalise = None  # not called
    fast = sampler.sample(x, rows_of(SamplingParams(temperature=0), 4)).token_ids
    slow = Sampler().sample(x, rows_of(SamplingParams(temperature=0, presence_penalty=1e-30),
                                       4)).token_ids
    assert torch.equal(fast, x.float().argmax(-1)) and torch.equal(fast, slow)
    assert fast.tolist()[1:3] == [7, 2500]

"""Reduced draft vocabularies (``draft_vocab_size``), the engine's step costs and the simulated
acceptance of ``hybridrt bench spec``.

The draft head only decides which drafts are proposed: greedy output must equal k = 0 token for
token and every draft must come from the draft vocabulary. Sampling with a reduced draft head
is checked model-free in test_rejection_sampling.py (a draft distribution that is zero outside
a fixed subset) and there on the demo model (the target's top-k support).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from hybridrt.bench.fixtures import tiny_text_config, write_char_tokenizer, write_random_checkpoint
from hybridrt.bench.spec import (
    SimulatedDrafts,
    break_even_alpha,
    expected_acceptance_length,
    format_table,
    run_spec_bench,
)
from hybridrt.kernels import quant
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
from hybridrt.specdec.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab, rank_tokens

TEXT_CONFIG = tiny_text_config()
VOCAB = TEXT_CONFIG["vocab_size"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def assert_head_copy(dh, rows: torch.Tensor) -> None:
    """The draft head's copy is ``rows``: in int8 (those rows quantized) where the CPU backend
    has int8 products, else the rows themselves."""
    if isinstance(dh.weight, quant.QuantWeight):
        want = quant.quantize(rows)
        assert all(torch.equal(a, b) for a, b in zip(dh.weight.tensors(), want.tensors(),
                                                       strict=True))
    else:
        assert torch.equal(dh.weight, rows)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("tiny_dv"), TEXT_CONFIG, seed=3)
    write_char_tokenizer(d, VOCAB)
    return d


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]


def make_llm(ckpt, k=0, **kw):
    return LLM(ckpt, dtype="float32", speculative_tokens=k, max_model_len=128, max_num_seqs=8,
               cache_memory=32 << 20, **kw)


def spy_drafts(llm) -> list[list[int]]:
    """Every request's drafts as the proposer leaves them."""
    seen: list[list[int]] = []
    proposer = llm.engine.proposer
    inner = proposer.propose

    def propose(plan, *args):
        proposed = inner(plan, *args)
        seen.extend(list(d.token_ids) for d in proposed if d.token_ids)
        return proposed

    proposer.propose = propose
    return seen


# Greedy: lossless, drafts inside the draft vocabulary ---------------------------------------
@pytest.mark.parametrize("n", [1, 7, VOCAB // 2])
def test_greedy_with_a_draft_vocabulary_equals_k0(ckpt, prompts, n):
    base = make_llm(ckpt).generate(prompts, GREEDY, use_tqdm=False)
    llm = make_llm(ckpt, 3, draft_vocab_size=n)
    drafts = spy_drafts(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for b, o in zip(base, outs):
        assert o.outputs[0].token_ids == b.outputs[0].token_ids
    assert drafts and all(0 <= t < n for d in drafts for t in d)  # no table: the first n ids
    assert llm.draft_vocab_source.startswith(f"the first {n} token ids")


def test_draft_vocabulary_from_the_model_directory_table(ckpt, prompts, tmp_path):
    d = tmp_path / "with_table"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    table = random.Random(0).sample(range(VOCAB), VOCAB)  # every id, in a shuffled order
    (d / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": table}))
    llm = make_llm(d, 2, draft_vocab_size=5)
    assert llm.engine.proposer.draft_head.token_ids.tolist() == table[:5]
    head = llm.model.model.embed_tokens.weight  # tied: the head's rows are the embedding's
    assert_head_copy(llm.engine.proposer.draft_head, head[table[:5]])
    drafts = spy_drafts(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    base = make_llm(ckpt).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert drafts and {t for dr in drafts for t in dr} <= set(table[:5])


def test_draft_logits_are_the_full_heads_on_the_draft_vocabulary(ckpt):
    llm = make_llm(ckpt, 1, draft_vocab_size=9)
    proposer = llm.engine.proposer
    h = torch.randn(3, TEXT_CONFIG["hidden_size"])
    full = llm.model.compute_logits(h)
    ids = proposer.draft_head.token_ids
    got = proposer._logits(h, proposer.draft_head)
    small = llm.model.backend.linear(h, proposer.draft_head.weight).float()
    assert torch.equal(got[:, ids], small)  # the copy's product (int8 where it runs)
    assert torch.allclose(got[:, ids], full[:, ids], rtol=0.03, atol=0.03 * full.abs().max())
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()


def test_greedy_drafts_are_the_argmax_of_the_draft_logits(ckpt, tmp_path):
    """``_greedy`` (all rows greedy, no full-vocabulary tensor) picks ``_logits``' argmax,
    a tie going to the lowest token id as over the full vocabulary: the head's rows in a
    shuffled order, and rows of zeros, where every draft logit ties."""
    d = tmp_path / "shuffled"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    table = random.Random(1).sample(range(VOCAB), VOCAB)
    (d / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": table}))
    proposer = make_llm(d, 1, draft_vocab_size=11).engine.proposer
    h = torch.randn(4, TEXT_CONFIG["hidden_size"])
    h[1] = 0  # every logit 0: the lowest of the 11 ids
    want = proposer._logits(h, proposer.draft_head).argmax(dim=-1)
    assert want[1] == min(table[:11]) != table[0]
    assert torch.equal(proposer._greedy(h, proposer.draft_head), want)
    full = make_llm(ckpt, 1).engine.proposer  # the full head
    assert torch.equal(full._greedy(h, None), full._logits(h, None).argmax(dim=-1))


def test_draft_head_stays_in_the_models_dtype_when_asked(ckpt):
    from hybridrt.specdec.mtp import DraftHead

    llm = make_llm(ckpt, 1, draft_vocab_size=9)
    own = DraftHead(llm.model, list(range(9)), quantize=False)
    assert isinstance(own.weight, torch.Tensor) and own.weight.dtype == llm.model.dtype
    assert isinstance(llm.engine.proposer.draft_head.weight, quant.QuantWeight) == (
        llm.model.backend.__class__.__name__ == "CPUBackend"
        and llm.model.backend.int8_isa is not None)


@pytest.mark.parametrize("untie", [False, True])
def test_int8_draft_vocabulary_head_is_the_dequantized_rows(ckpt, prompts, untie, tmp_path):
    """An int8 model's draft head: the rows of its quantized head (the tied embedding, or an
    untied lm_head), dequantized (and kept in int8); greedy output equal to its own k=0."""
    src = ckpt
    if untie:
        src = tmp_path / "untied"
        src.mkdir()
        for f in ckpt.iterdir():
            (src / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((src / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        (src / "config.json").write_text(json.dumps(cfg))
        from safetensors.torch import load_file, save_file

        sd = load_file(src / "model.safetensors")
        emb = next(k for k in sd if k.endswith("embed_tokens.weight"))
        sd["lm_head.weight"] = torch.randn_like(sd[emb])
        save_file(sd, src / "model.safetensors")
    llm = make_llm(src, 2, draft_vocab_size=7, quantization="int8")
    model = llm.model
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    assert (model.lm_head is not None) == untie
    ids = torch.tensor([2, 0, 5, 1])
    want = head.qweight.rows(torch.arange(7), model.dtype)
    dh = llm.engine.proposer.draft_head
    assert_head_copy(dh, want)
    assert dh.token_ids.tolist() == list(range(7))
    assert not torch.equal(want[ids], want[ids.flip(0)])  # distinct rows: order is checked
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    base = llm.generate(prompts, GREEDY, use_tqdm=False, speculative_tokens=0)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]


def test_demo_model_greedy_with_a_draft_vocabulary_equals_k0():
    from hybridrt.bench.spec import DEFAULT_QUESTIONS

    llm = LLM(dtype="float32", speculative_tokens=3, max_model_len=256, max_num_seqs=4,
              cache_memory=64 << 20, draft_vocab_size=1500)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in DEFAULT_QUESTIONS[:4]]
    params = SamplingParams(temperature=0, max_tokens=32)
    spec = llm.generate(prompts, params, use_tqdm=False)
    base = llm.generate(prompts, params, use_tqdm=False, speculative_tokens=0)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    accepted = sum(o.metrics["spec"]["num_accepted"] for o in spec)
    assert accepted > 20  # the reduced head still drafts well on the demo model
    # some output tokens lie outside the draft vocabulary: verification emitted them itself
    assert any(t >= 1500 for o in spec for t in o.outputs[0].token_ids)


# Tables and bad input -------------------------------------------------------------------------
def test_rank_tokens_orders_by_count_then_id():
    from collections import Counter

    assert rank_tokens(Counter({5: 3, 2: 3, 7: 9, 1: 1}), 9) == [7, 2, 5, 1, 0, 3, 4, 6, 8]


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_bad_draft_vocab_size_is_refused(ckpt, bad):
    with pytest.raises(ValueError, match="draft_vocab_size must be a positive integer"):
        make_llm(ckpt, 2, draft_vocab_size=bad)


def test_draft_vocab_size_limits(ckpt, tmp_path):
    with pytest.raises(ValueError, match=rf"draft_vocab_size must be an integer in \[1, {VOCAB}\]"):
        make_llm(ckpt, 2, draft_vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="needs speculative_tokens > 0"):
        make_llm(ckpt, 0, draft_vocab_size=4)
    nomtp = write_random_checkpoint(tmp_path / "nomtp", TEXT_CONFIG, seed=3, with_mtp=False)
    with pytest.raises(ValueError, match="no mtp.. tensors"):
        make_llm(nomtp, 2, draft_vocab_size=4)


@pytest.mark.parametrize("table, message", [
    ({"token_ids": [1, 2, 2]}, "repeated"),
    ({"token_ids": [1, VOCAB]}, "token ids in"),
    ({"token_ids": [1, 2]}, "larger than the 2 ids"),
    ("not json", "not a readable JSON"),
])
def test_bad_tables_are_refused(tmp_path, table, message):
    text = table if isinstance(table, str) else json.dumps(table)
    (tmp_path / DRAFT_VOCAB_FILE).write_text(text)
    with pytest.raises(ValueError, match=message):
        load_draft_vocab(tmp_path, VOCAB, 3)


def test_draft_vocab_command_counts_the_corpus(ckpt, tmp_path):
    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abracadabra\nbanana band\n")
    out = tmp_path / "table.json"
    res = CliRunner().invoke(app, ["draft-vocab", str(ckpt), str(corpus), "--size", "6",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(ckpt))
    counts: dict[int, int] = {}
    for ch in corpus.read_text():
        t = tok.convert_tokens_to_ids(ch)
        counts[t] = counts.get(t, 0) + 1
    want = sorted(counts, key=lambda t: (-counts[t], t))[:6]
    assert json.loads(out.read_text())["token_ids"] == want
    assert load_draft_vocab(ckpt, VOCAB, 3)[0] == [0, 1, 2]  # the model dir has no table


def test_cli_draft_vocab_usage_errors(ckpt):
    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    r = CliRunner()
    res = r.invoke(app, ["generate", str(ckpt), "-p", "ab", "-k", "1", "--draft-vocab", "0"])
    assert res.exit_code == 2 and "--draft-vocab must be a positive integer" in res.output
    res = r.invoke(app, ["generate", str(ckpt), "-p", "ab", "--draft-vocab", "4"])
    assert res.exit_code == 2 and "needs -k/--speculative-tokens > 0" in res.output
    res = r.invoke(app, ["bench", "spec", str(ckpt), "--simulate-acceptance", "1.5"])
    assert res.exit_code == 2 and "rates in [0, 1]" in res.output


# Step costs -----------------------------------------------------------------------------------
def test_step_costs_count_the_steps(ckpt, prompts):
    llm = make_llm(ckpt, 2)
    (o,) = llm.generate([prompts[2]], GREEDY, use_tqdm=False, speculative_tokens=0)
    c = llm.engine.step_costs
    assert (c.counts["prefill"], c.counts["decode"], c.counts["verify"], c.counts["draft"]) == (
        1, len(o.outputs[0].token_ids) - 1, 0, 0)
    llm.engine.step_costs = type(c)()
    (o,) = llm.generate([prompts[2]], GREEDY, use_tqdm=False)
    c = llm.engine.step_costs
    rounds = o.metrics["spec"]["num_rounds"]
    assert c.counts["prefill"] == 1 and c.counts["verify"] == rounds
    assert c.counts["draft"] == c.counts["prefill"] + c.counts["verify"] + c.counts["decode"]
    assert all(v > 0 for k, v in c.seconds.items() if c.counts[k])
    assert c.as_dict()["verify_count"] == rounds
    ticks = iter(range(10**6))  # a clock that advances by 1 per reading
    llm.engine.step_costs = type(c)(clock=lambda: next(ticks))
    llm.generate([prompts[2]], GREEDY, use_tqdm=False)
    c = llm.engine.step_costs
    assert c.seconds == {k: float(n) for k, n in c.counts.items()}  # one tick per step


# Simulated acceptance -------------------------------------------------------------------------
def test_expected_length_and_break_even():
    assert expected_acceptance_length(0.5, 2) == pytest.approx(1.75)
    assert expected_acceptance_length(1.0, 3) == 4
    for k, r in [(1, 1.3), (2, 1.9), (3, 3.5)]:
        a = break_even_alpha(r, k)
        assert expected_acceptance_length(a, k) == pytest.approx(r, abs=1e-9)
    assert break_even_alpha(0.9, 2) == 0.0 and break_even_alpha(3.5, 2) is None


def test_simulated_drafts_follow_the_reference():
    class Req:
        prompt_token_ids = [5, 6]
        token_ids = [5, 6, 7]

    sim = SimulatedDrafts({(5, 6): [5, 6, 7, 8, 9]}, 1.0, VOCAB)
    assert [sim(Req, j, 0) for j in range(3)] == [8, 9, 0]  # past the reference: its own
    sim = SimulatedDrafts({(5, 6): [5, 6, 7, 8, 9]}, 0.0, VOCAB)
    assert [sim(Req, j, 8) for j in range(2)] == [9, 10]  # always a wrong token
    Req.token_ids = [5, 6, 4]  # left the reference: the MTP's token stays
    assert sim(Req, 0, 3) == 3 and sim.coverage == 2 / 3


def test_simulated_drafts_draw_per_request_and_per_seed():
    """Each request's own stream, seeded by the run's seed and its prompt: the fraction right
    is alpha (4000 draws, 5 sigma), a request's draws do not move with another's, and another
    seed (a benchmark's next repeat) draws others (with one stream seeded alike every repeat
    replayed the same first draws, 0.84 and 0.76 for seed 0: adaptive k's few drafts at alpha
    0.2 were all rejected in every repeat)."""
    class Req:
        def __init__(self, p):
            self.prompt_token_ids, self.token_ids = p, p

    a, b = Req([1, 2]), Req([3, 4])
    refs = {(1, 2): [1, 2] + [7] * 4000, (3, 4): [3, 4] + [7] * 4000}

    def draws(sim, req, n):
        return [sim(req, j, 0) == 7 for j in range(n)]

    sim = SimulatedDrafts(refs, 0.2, VOCAB, seed=0)
    got = draws(sim, a, 4000)
    assert abs(sum(got) / 4000 - 0.2) < 5 * (0.2 * 0.8 / 4000) ** 0.5
    assert sim.num_right == sum(got)
    other = SimulatedDrafts(refs, 0.2, VOCAB, seed=0)
    draws(other, b, 37)  # another request drafting first changes nothing of a's
    assert draws(other, a, 200) == got[:200]
    assert draws(SimulatedDrafts(refs, 0.2, VOCAB, seed=1), a, 200) != got[:200]
    assert draws(SimulatedDrafts(refs, 0.2, VOCAB, seed=0), b, 200) != got[:200]


def test_simulated_drafts_through_the_probe_head_are_right_less_often():
    """``probe_factor``: a draft while the drafter drafts through its probe head is right with
    that fraction of alpha (4000 draws, 5 sigma); through another head, with alpha."""
    from types import SimpleNamespace

    class Req:
        prompt_token_ids = token_ids = [1, 2]

    refs = {(1, 2): [1, 2] + [7] * 4000}
    probe = object()
    for head, rate in ((probe, 0.4), (None, 0.8)):
        sim = SimulatedDrafts(refs, 0.8, VOCAB, probe_factor=0.5)
        sim.drafter = SimpleNamespace(probe_head=probe, drafting_head=head)
        got = sum(sim(Req, j, 0) == 7 for j in range(4000)) / 4000
        assert abs(got - rate) < 5 * (rate * (1 - rate) / 4000) ** 0.5, (head, got)


def test_simulated_acceptance_bench(ckpt, capsys, tmp_path):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (6,), generator=g).tolist() for _ in range(8)]
    out = tmp_path / "sim.json"
    report = run_spec_bench(str(ckpt), ks=(0, 1, 3), batch_sizes=(1, 4), prompts=prompts,
                            max_tokens=48, threads=1, ignore_eos=True, draft_vocabs=(0, 10),
                            simulate_acceptance=(0.0, 0.5, 1.0), json_path=out)
    table = capsys.readouterr().out
    assert "SIMULATED ACCEPTANCE" in table and "0.50 sim" in table
    assert json.loads(out.read_text()) == report and report["acceptance"] == "simulated"
    rows = [r for r in report["rows"] if r["k"] > 0]
    assert len(rows) == 2 * 2 * 3 * 2  # batch x head x alpha x k
    for r in report["rows"]:
        assert r["identical_to_k0"] is True  # fp32: the simulation never changes the output
        if r["k"] == 0:
            assert r["acceptance"] == "real" and r["simulated_alpha"] is None
            continue
        assert r["acceptance"] == "simulated" and r["reference_coverage"] == 1.0
        assert r["draft_vocab"] in (0, 10) and r["step_costs"]["draft_count"] > 0
        assert r["verify_over_step"] > 0 and r["draft_pass_over_step"] > 0
        if r["simulated_alpha"] == 1.0:
            assert r["acceptance_rate"] == 1.0
        elif r["simulated_alpha"] == 0.0:
            assert r["acceptance_rate"] == 0.0
        elif r["k"] == 1:  # draft 1 is accepted with probability 0.5, round after round
            n = r["num_rounds"]
            assert n > 150
            assert abs(r["per_position_acceptance"][0] - 0.5) < 4 * (0.25 / n) ** 0.5


def test_repeated_rows_report_the_median(ckpt):
    import statistics

    report = run_spec_bench(str(ckpt), ks=(0, 1), batch_sizes=(2,), threads=1, quick=True,
                            repeats=3, verbose=False, simulate_acceptance=(0.5,), cpu_time=True)
    assert report["clock"] == "cpu" and "CPU TIME" in format_table(report)
    for r in report["rows"]:
        assert len(r["tok_s_runs"]) == 3 and r["tok_s"] == statistics.median(r["tok_s_runs"])
        n = r["step_costs"]["prefill_count"]  # the same steps in each of the 3 runs
        assert n >= 3 * 2 and n % 3 == 0
    base, spec = report["rows"]
    # each run over the k = 0 run of its repeat, the median of those
    assert spec["speedup"] == pytest.approx(statistics.median(
        t / b for t, b in zip(spec["tok_s_runs"], base["tok_s_runs"])))


def test_spec_bench_runs_every_prompt_cold(ckpt, monkeypatch):
    """The same prompts run once per row and repeat: none may resume from an earlier row's
    prefix cache (in half precision a hit can turn a near-tied greedy token, and a simulated run
    then leaves its reference; the rows would also depend on the order they ran in)."""
    cached, generate = [], LLM.generate

    def counting(self, *a, **kw):
        outs = generate(self, *a, **kw)
        cached.extend(o.num_cached_tokens for o in outs)
        return outs

    monkeypatch.setattr(LLM, "generate", counting)
    run_spec_bench(str(ckpt), ks=(0, 1), batch_sizes=(1,), threads=1, quick=True, repeats=2,
                   verbose=False, simulate_acceptance=(0.5,))
    assert len(cached) > 8 and not any(cached)


def test_a_probe_head_only_for_adaptive_mtp_through_a_large_full_head(tmp_path):
    """``draft_vocabs``: adaptive k's probe ids are the ``PROBE_VOCAB`` most frequent (the
    table's, else the first ids) where MTP drafts go through the full head of a vocabulary of
    at least 4 x ``PROBE_VOCAB`` ids; none with a draft vocabulary, fixed k, prompt lookup
    alone, or a smaller vocabulary (the probe would cost about what the head does). A table of
    fewer ids gives a probe head of all of them; ``draft_vocab_size`` past the table is an
    error."""
    from types import SimpleNamespace

    from hybridrt.specdec.draft_vocab import PROBE_VOCAB, draft_vocabs

    V = 4 * PROBE_VOCAB
    table = list(range(V))[::-1]
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": table}))

    def args(k=2, adaptive=True, method="mtp"):
        return SimpleNamespace(speculative_tokens=k, speculative_adaptive=adaptive,
                               speculative_method=method)

    assert draft_vocabs(tmp_path, V, None, args()) == (None, None, table[:PROBE_VOCAB])
    assert draft_vocabs(tmp_path, V, None, args(method="mtp+ngram"))[2] == table[:PROBE_VOCAB]
    ids, source, probe = draft_vocabs(tmp_path, V, 100, args())
    assert ids == table[:100] and "most frequent" in source and probe is None
    for a in (args(adaptive=False), args(k=0), args(method="ngram")):
        assert draft_vocabs(tmp_path, V, None, a) == (None, None, None)
    assert draft_vocabs(tmp_path, V - 1, None, args())[2] is None
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": table[:100]}))
    assert draft_vocabs(tmp_path, V, None, args())[2] == table[:100]  # a shorter table: all
    with pytest.raises(ValueError, match="larger than the 100 ids"):
        draft_vocabs(tmp_path, V, 200, args())  # asked for by draft_vocab_size: an error

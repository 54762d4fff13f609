"""The copy model (hybridrt/bench/copy_workload.py): a checkpoint whose random weights carry a
two-layer induction head, so that its greedy output copies its prompt and prompt-lookup drafts
are accepted as on a trained model copying a file. On it the n-gram drafter earns what it is
for (most drafts accepted, several tokens a step) with k = 0's tokens."""

from __future__ import annotations

import pytest

from hybridrt.bench.copy_workload import copy_prompts, make_copy_model
from hybridrt.bench.fixtures import tiny_text_config
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py

# wide enough for the circuit: value dims >= half the hidden size, 48 dims of q / k past RoPE
CFG = tiny_text_config(vocab_size=512, hidden_size=96, head_dim=64, num_attention_heads=2,
                       num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.25})
SPAN, NEW = 96, 40
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import torch

    return make_copy_model(tmp_path_factory.mktemp("copy"), CFG, dtype=torch.float32)


def _llm(model, k=0, **kw):
    if k:
        kw.setdefault("speculative_method", "ngram")
    return LLM(model, dtype="float32", speculative_tokens=k, max_model_len=256, max_num_seqs=4,
               cache_memory=32 << 20, **kw)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_output_copies_the_prompt(model):
    """Greedy output goes on copying the document from where the prompt's last four tokens
    took it up (the circuit works: without it the test below would draft nothing useful)."""
    llm = _llm(model)
    prompts = copy_prompts(llm, n=3, span=SPAN)
    for prompt, out in zip(prompts, _ids(llm.generate(prompts, GREEDY, use_tqdm=False))):
        doc, cue = prompt[:SPAN], prompt[SPAN:]
        at = next(i for i in range(SPAN) if doc[i:i + 4] == cue)
        assert out == doc[at + 4:at + 4 + NEW]


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_drafts_on_the_copy_model_are_accepted_with_k0_tokens(model, adaptive):
    """Prompt lookup at k = 4 (and adaptive up to 4, the batch-invariant mode's prior costs
    so that its choices do not depend on time): k = 0's tokens, at least 90% of the drafts
    accepted, and under half the steps."""
    base = _llm(model)
    prompts = copy_prompts(base, n=3, span=SPAN)
    want = _ids(base.generate(prompts, GREEDY, use_tqdm=False))
    kw = {"speculative_adaptive": True, "batch_invariant": True} if adaptive else {}
    llm = _llm(model, 4, **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _ids(outs) == want
    stats = llm.engine.spec_stats
    assert stats.drafts_by_source["ngram"] == stats.num_draft_tokens > 0
    assert stats.num_accepted >= 0.9 * stats.num_draft_tokens, stats
    for o in outs:
        spec = o.metrics["spec"]
        assert spec["num_rounds"] < NEW / 2, spec
        if adaptive:
            assert spec["mean_k_chosen"] > 1.5, spec  # 1.92: it rises from the prior

"""The encoder's work per step (hybridrt.vision.budget) and the encoder-output cache
(hybridrt.vision.encoder_cache), on a tiny random fp32 checkpoint with a vision tower and an
MTP layer (tests/vision_helpers.py): a decoding request gets a token in every step while
another request's images are encoded, each step within the encoder budget (an image larger
than the budget alone), with the outputs of an unbudgeted run; the same image after another
prefix skips the encoder, another image of the same size does not, the cache evicts by
bytes, and its size comes from ``LLM(encoder_cache_memory=...)``."""

from __future__ import annotations

import pytest
from vision_helpers import image, write_vision_checkpoint

from hybridrt import LLM, SamplingParams
from hybridrt.vision.encoder_cache import EncoderCache, parse_cache_bytes

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=6)
SMALL, BIG = (40, 24), (80, 48)  # 15 and 60 image tokens (patch 4, merge 2)


def prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("vbudget"), seed=3, with_mtp=True)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
               speculative_tokens=2, enable_prefix_caching=False)


def steps(llm, budget: int, k: int):
    """A text request decoding (30 tokens), joined after its first step by one with three
    images (15, 60 and 15 tokens) -> (each request's tokens, and per step: the image tokens
    each encoder run took, and the tokens the text request got)."""
    eng, tower = llm.engine, llm.vision
    eng.scheduler.encoder_budget = budget
    tower.cache = EncoderCache(0)
    runs = []
    plain = tower.encode
    tower.encode = lambda items: runs.append([it.num_tokens(2) for it in items]) or plain(items)
    text_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    try:
        _, ids, _ = llm.inputs.encode(prompt("Tell me a story about a cat and a dog."))
        a = eng.add_request(ids, text_params, speculative_tokens=k)
        eng.step()
        imgs = [image(*SMALL, 1), image(*BIG, 2), image(*SMALL, 3)]
        _, ids, vision = llm.inputs.encode({"prompt": prompt(f"{IMG} then {IMG} and {IMG}?"),
                                            "multi_modal_data": {"image": imgs}})
        b = eng.add_request(ids, GREEDY, speculative_tokens=k, vision=vision)
        per_step = []
        while eng.has_unfinished_requests():
            before, at = eng.get_request(a).num_output_tokens, len(runs)
            eng.step()
            per_step.append((runs[at:], eng.get_request(a).num_output_tokens - before))
            assert len(per_step) < 100, "the image request never ran"
        out = [eng.get_request(r).output_token_ids for r in (a, b)]
        for r in (a, b):
            eng.pop_request(r)
        return out, per_step
    finally:
        tower.encode = plain
        eng.scheduler.encoder_budget = eng.args.max_num_batched_tokens


@pytest.mark.parametrize("k", [0, 2])
def test_a_decoding_request_goes_on_while_images_are_encoded_within_budget(llm, k):
    want, unbudgeted = steps(llm, 10**6, k)
    assert [r for r, _ in unbudgeted if r] == [[[15, 60, 15]]]  # one run, one step
    got, per_step = steps(llm, 20, k)
    assert got == want
    encoding = [(r, a) for r, a in per_step if r]
    assert [r for r, _ in encoding] == [[[15]], [[60]], [[15]]]  # a step each; 60 alone
    assert all(a >= 1 for _, a in encoding)  # the text request got tokens in each of them


def test_two_images_that_fit_share_a_step(llm):
    _, per_step = steps(llm, 75, 0)
    assert [r for r, _ in per_step if r] == [[[15, 60]], [[15]]]


def _metrics(llm, text, img, params=GREEDY):
    (out,) = llm.generate([{"prompt": prompt(text), "multi_modal_data": {"image": [img]}}],
                          params, use_tqdm=False)
    assert out.error is None, out.error
    return out.outputs[0].token_ids, out.metrics["vision"]


def test_the_same_image_after_another_prefix_skips_the_encoder(llm):
    img = image(*SMALL, 7)
    llm.vision.cache = EncoderCache(1 << 20)
    first, m1 = _metrics(llm, f"{IMG}What is it?", img)
    assert (m1["encoder_runs"], m1["encoder_cache_hits"]) == (1, 0)
    hit, m2 = _metrics(llm, f"Look here: {IMG}What is it?", img)  # no prefix-cache hit
    assert (m2["encoder_runs"], m2["encoder_cache_hits"]) == (0, 1)
    llm.vision.cache = EncoderCache(0)  # off: the same tokens, encoded again
    cold, m3 = _metrics(llm, f"Look here: {IMG}What is it?", img)
    assert (m3["encoder_runs"], m3["encoder_cache_hits"]) == (1, 0)
    assert hit == cold
    llm.vision.cache = EncoderCache(1 << 20)
    _metrics(llm, f"{IMG}What is it?", img)
    _, m4 = _metrics(llm, f"{IMG}What is it?", image(*SMALL, 8))  # same size, other pixels
    assert (m4["encoder_runs"], m4["encoder_cache_hits"]) == (1, 0)


def test_the_cache_evicts_by_bytes_least_recently_used_first(llm):
    one = 15 * llm.config.hidden_size * 4  # an image's fp32 embeddings
    a, b, c = (image(*SMALL, s) for s in (11, 12, 13))
    llm.vision.cache = EncoderCache(2 * one)
    for img in (a, b):
        _metrics(llm, f"{IMG}?", img)
    assert llm.vision.cache.num_bytes == 2 * one
    assert _metrics(llm, f"Again {IMG}?", a)[1]["encoder_cache_hits"] == 1  # a: most recent
    _metrics(llm, f"{IMG}?", c)  # evicts b, the least recently used
    assert len(llm.vision.cache) == 2 and llm.vision.cache.num_bytes == 2 * one
    assert _metrics(llm, f"Once more {IMG}?", a)[1]["encoder_cache_hits"] == 1
    assert _metrics(llm, f"Once more {IMG}?", b)[1]["encoder_runs"] == 1
    llm.vision.cache = EncoderCache(one - 1)  # smaller than one image: nothing kept
    _metrics(llm, f"{IMG}?", a)
    assert len(llm.vision.cache) == 0


def test_encoder_cache_memory_sizes_the_cache(ckpt):
    small = LLM(ckpt[0], dtype="float32", max_model_len=64, cache_memory="8MiB",
                encoder_cache_memory="1MiB")
    assert small.vision.cache.max_bytes == 1 << 20
    assert LLM(ckpt[0], dtype="float32", max_model_len=64, cache_memory="8MiB",
               encoder_cache_memory=0).vision.cache.max_bytes == 0
    assert parse_cache_bytes("256MiB") == 256 << 20 and parse_cache_bytes(1000) == 1000
    for bad in (0.5, "lots", -1, True):
        with pytest.raises(ValueError, match="encoder_cache_memory"):
            parse_cache_bytes(bad)
    with pytest.raises(ValueError, match="encoder_cache_memory"):
        LLM(ckpt[0], encoder_cache_memory="lots")

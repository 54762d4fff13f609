"""Images through the whole runtime against transformers' Qwen3_5ForConditionalGeneration on a
tiny random fp32 checkpoint with a vision tower (tests/vision_helpers.py): greedy tokens equal
and every step's logits within 1e-4 x max |logit|, for one image, two images of different
sizes, an image in a chat's second turn, and an image split across prefill chunks."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from helpers import assert_rel_close
from vision_helpers import image, write_vision_checkpoint

from hybridrt import LLM, SamplingParams

TOL = 1e-4
STEPS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS)
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("vision"), seed=3)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB")


def recording(llm) -> list[torch.Tensor]:
    """Every step's logits of ``llm`` from now on."""
    seen, runner = [], llm.engine.runner
    plain = type(runner).logits.__get__(runner)

    def logits(*args, **kwargs):
        out = plain(*args, **kwargs)
        seen.append(out.float().clone())
        return out

    runner.logits = logits
    return seen


def reference(ckpt, prompt_ids: list[int], images: list) -> tuple[list[int], list]:
    """transformers' greedy tokens and per-step logits for the expanded prompt."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path, ref = ckpt
    px = Qwen2VLImageProcessorPil.from_pretrained(str(path))(images=images, return_tensors="pt")
    ids = torch.tensor([prompt_ids])
    image_id = ref.config.image_token_id
    n = int((px["image_grid_thw"].prod(-1) // 4).sum())
    assert int((ids == image_id).sum()) == n, "the prompt's image tokens != the images' count"
    with torch.no_grad():
        g = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                         mm_token_type_ids=(ids == image_id).int(), max_new_tokens=STEPS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return g.sequences[0, ids.shape[1]:].tolist(), [x[0] for x in g.logits]


def check(llm, ckpt, run, images) -> list[int]:
    """``run()`` -> its output, compared with the reference: tokens and each step's logits."""
    seen = recording(llm)
    out = run()
    assert out.error is None, out.error
    toks, ref_logits = reference(ckpt, out.prompt_token_ids, images)
    assert out.outputs[0].token_ids == toks
    ours = [x[-1] for x in seen if x.shape[0]]  # the sampled row of each sampling step
    assert len(ours) == len(ref_logits)
    for i, (a, b) in enumerate(zip(ours, ref_logits)):
        assert_rel_close(a, b, TOL, f"step {i}")
    return ours


def generate(llm, text, images, params=GREEDY):
    return lambda: llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}],
                                params, use_tqdm=False)[0]


def test_one_image(llm, ckpt):
    img = image(40, 24, 1)
    text = f"<|im_start|>user\n{IMG}What is it?<|im_end|>\n<|im_start|>assistant\n"
    first = check(llm, ckpt, generate(llm, text, [img]), [img])[0]
    # the image is seen: another image of the same size gives other logits
    seen = recording(llm)
    generate(llm, text, [image(40, 24, 2)])()
    assert (seen[0][-1] - first).abs().max() > 1e-2


def test_two_images_of_different_sizes(llm, ckpt):
    imgs = [image(40, 24, 3), image(24, 72, 4)]
    text = f"<|im_start|>user\nA {IMG} and B {IMG}: same?<|im_end|>\n<|im_start|>assistant\n"
    check(llm, ckpt, generate(llm, text, imgs), imgs)


def test_image_in_a_chats_second_turn_as_a_data_url(llm, ckpt):
    img = image(32, 48, 5)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    conv = [{"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi! Ask me."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]
    check(llm, ckpt, lambda: llm.chat(conv, GREEDY, use_tqdm=False)[0], [img])


def test_an_image_split_across_prefill_chunks_is_encoded_once(ckpt):
    small = LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
                max_num_batched_tokens=8)
    img = image(40, 24, 1)
    text = f"<|im_start|>user\n{IMG}What is it?<|im_end|>\n<|im_start|>assistant\n"
    prompt = {"prompt": text, "multi_modal_data": {"image": [img]}}
    _, ids, vision = small.inputs.encode(prompt)
    runs = []
    plain = vision.tower.encode
    vision.tower.encode = lambda items: runs.append(len(items)) or plain(items)
    try:
        check(small, ckpt, generate(small, text, [img]), [img])
    finally:
        vision.tower.encode = plain
    assert runs == [1]  # one image, encoded once although its 15 tokens span two chunks


def test_prefix_cache_keys_image_tokens_by_content(llm, ckpt):
    """Turn 2 of a chat about an image: the image's tokens come from the cache, neither
    encoded nor prefilled again, and the output is exact; a different image of the same size
    hits only the text before it."""
    llm.reset_prefix_cache()
    img, other = image(32, 48, 6), image(32, 48, 7)

    def conv(picture, answer=None):
        turn1 = [{"role": "user", "content": [{"type": "image", "image": picture},
                                              {"type": "text", "text": "What is it?"}]}]
        if answer is None:
            return turn1
        return turn1 + [{"role": "assistant", "content": answer},
                        {"role": "user", "content": "And the colour?"}]

    (first,) = llm.chat(conv(img), GREEDY, use_tqdm=False)
    assert first.metrics["vision"]["encoder_runs"] == 1
    answer = llm.tokenizer.decode(first.outputs[0].token_ids, skip_special_tokens=True)
    start = first.prompt_token_ids.index(ckpt[1].config.image_token_id)
    second = check(llm, ckpt, lambda: llm.chat(conv(img, answer), GREEDY, use_tqdm=False)[0],
                   [img])
    assert second  # compared with transformers
    (again,) = llm.chat(conv(img, answer), GREEDY, use_tqdm=False)
    assert again.metrics["vision"]["encoder_runs"] == 0
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 1
    (diff,) = llm.chat(conv(other, answer), GREEDY, use_tqdm=False)
    assert diff.metrics["vision"]["encoder_runs"] == 1
    assert diff.num_cached_tokens <= start


def test_images_beside_text_requests_and_after_preemption(ckpt):
    """A batch of two image requests and a text one, with preemptions (recompute from the
    tokens): every output equal to its own run alone, the images' equal to transformers'."""
    import random

    from helpers import preempt_at

    eng = LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
              max_num_batched_tokens=24, enable_prefix_caching=False)
    imgs = [image(40, 24, 8), image(24, 40, 9)]
    prompts = [{"prompt": f"<|im_start|>user\n{IMG}Which?<|im_end|>\n<|im_start|>assistant\n",
                "multi_modal_data": {"image": [im]}} for im in imgs]
    prompts.insert(1, "<|im_start|>user\nNo image here.<|im_end|>\n<|im_start|>assistant\n")
    alone = [eng.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    preempt_at(eng, random.Random(0), {3, 6, 9, 12})
    together = eng.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert sum(o.metrics["num_preemptions"] for o in together) > 0
    for out, im in zip([together[0], together[2]], imgs):
        assert out.outputs[0].token_ids == reference(ckpt, out.prompt_token_ids, [im])[0]


def test_server_takes_image_url_data_urls(llm, ckpt):
    """The OpenAI chat endpoint with an ``image_url`` data URL answers what LLM.chat does (and
    so transformers); a path, an http URL (no domain allowed: tests/test_vision_fetch.py), or
    a placeholder without its image, is a 400."""
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    from test_serve import MODEL, Running

    img = image(24, 32, 10)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    conv = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    (want,) = llm.chat(conv, GREEDY, use_tqdm=False)
    srv = Running(llm)
    try:
        r = httpx.post(f"{srv.base}/v1/chat/completions", json={
            "messages": conv, "max_tokens": STEPS, "temperature": 0,
            "return_token_ids": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        # the same image through the Anthropic and Responses APIs: the same prompt, answer
        b64 = url.split(",", 1)[1]
        r = httpx.post(f"{srv.base}/v1/messages", json={
            "model": MODEL, "max_tokens": STEPS, "temperature": 0, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": b64}}]}]}, timeout=60)
        assert r.status_code == 200, r.text
        texts = [b["text"] for b in r.json()["content"] if b["type"] == "text"]
        assert "".join(texts) == want.outputs[0].text
        r = httpx.post(f"{srv.base}/v1/responses", json={
            "model": MODEL, "max_output_tokens": STEPS, "temperature": 0, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                             {"type": "input_image", "image_url": url}]}]},
            timeout=60)
        assert r.status_code == 200, r.text
        texts = [c["text"] for it in r.json()["output"] if it["type"] == "message"
                 for c in it["content"] if c["type"] == "output_text"]
        assert "".join(texts) == want.outputs[0].text
        for bad, words in [("/etc/passwd", "data URLs"), ("http://example.com/a.png",
                                                             "--allowed-media-domains"),
                           ("data:image/png;base64,!!", "not valid base64")]:
            body = {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": bad}}]}], "max_tokens": 2}
            r = httpx.post(f"{srv.base}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    finally:
        srv.stop()

"""MTP speculation with images, on a tiny random fp32 checkpoint with a vision tower and an MTP
layer (tests/vision_helpers.py): greedy tokens with k=2 equal k=0's for one image, two images
and an image in a chat's second turn (a prefix-cache hit); such requests really draft; the MTP
layer's outputs over an image or video prompt and its first drafting pass equal a reference MTP
built from transformers' decoder layer fed transformers' merged embeddings and M-RoPE
positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_rel_close
from vision_helpers import image, video_processor, write_vision_checkpoint

from hybridrt import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
TOL = 1e-4


def prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("vspec"), seed=3, with_mtp=True)


@pytest.fixture(scope="module")
def spec(ckpt):
    return LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
               speculative_tokens=2)


def frames(n: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def run(llm, text, images, params=GREEDY, k=None):
    item = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
    (out,) = llm.generate([item], params, use_tqdm=False, speculative_tokens=k)
    assert out.error is None, out.error
    return out


@pytest.mark.parametrize("case", ["one", "two"])
def test_greedy_with_drafts_equals_without(spec, case):
    imgs = {"one": [image(40, 24, 1)], "two": [image(40, 24, 3), image(24, 72, 4)]}[case]
    text = prompt({"one": f"{IMG}What is it?", "two": f"A {IMG} and B {IMG}: same?"}[case])
    want = run(spec, text, imgs, k=0).outputs[0].token_ids
    spec.reset_prefix_cache()
    got = run(spec, text, imgs)
    assert got.outputs[0].token_ids == want
    assert got.metrics["spec"]["num_draft_tokens"] > 0  # it drafted


def test_image_in_the_second_turn_with_a_prefix_hit(spec):
    img = image(32, 48, 6)
    conv = [{"role": "user", "content": [{"type": "image", "image": img},
                                         {"type": "text", "text": "What is it?"}]}]
    spec.reset_prefix_cache()
    (first,) = spec.chat(conv, GREEDY, use_tqdm=False)
    answer = spec.tokenizer.decode(first.outputs[0].token_ids, skip_special_tokens=True)
    conv += [{"role": "assistant", "content": answer},
             {"role": "user", "content": "And the colour?"}]
    (hit,) = spec.chat(conv, GREEDY, use_tqdm=False)
    assert hit.num_cached_tokens > first.prompt_token_ids.index(
        spec.vision.config.image_token_id)  # the image's tokens came from the cache
    assert hit.metrics["spec"]["num_draft_tokens"] > 0
    (plain,) = spec.chat(conv, GREEDY, use_tqdm=False, speculative_tokens=0)
    assert hit.outputs[0].token_ids == plain.outputs[0].token_ids


def recorded_mtp(llm) -> list:
    """Every MTP pass of ``llm`` from now on that drafts: (input ids, positions, output). A
    drafting step writes the KV of a request's earlier rows in a pass of their own
    (``kv_only``); here that pass computes its rows' outputs too (the same KV), and they are
    recorded with the drafting pass after it, as one pass."""
    seen, pending, model = [], [], llm.model
    plain = type(model).mtp_forward.__get__(model)

    def mtp_forward(input_ids, hidden, batch, cache, kv_only=False):
        out = plain(input_ids, hidden, batch, cache)
        pending.append((input_ids.clone(), batch.positions.clone(), out.clone()))
        if kv_only:
            return None
        ids, pos, outs = zip(*pending)
        pending.clear()
        seen.append((torch.cat(ids), torch.cat(pos, dim=-1), torch.cat(outs)))
        return out

    model.mtp_forward = mtp_forward
    return seen


def reference_mtp(ckpt, prompt_ids: list[int], images: list, sampled: int, draft: int,
                  videos: list | None = None):
    """transformers' merged embeddings (``videos``: lists of frames, taken as given), M-RoPE
    positions and final hidden states over the prompt, through a reference MTP (transformers'
    decoder layer with the checkpoint's mtp.* weights): -> (outputs at positions 0..L-1, whose
    input is token p+1, the sampled token last; the output at L of the first drafting pass,
    input ``draft``)."""
    from safetensors.torch import load_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5RMSNorm,
    )

    path, ref = ckpt
    lm, tc = ref.model.language_model, ref.config.text_config
    ids = torch.tensor([prompt_ids])
    seen = {}
    hook = lm.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    kw = {}
    if images:
        px = Qwen2VLImageProcessorPil.from_pretrained(str(path))(images=images,
                                                                 return_tensors="pt")
        kw = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}
    if videos:
        px = video_processor()(videos=[np.stack(v) for v in videos], return_tensors="pt",
                               do_sample_frames=False, do_convert_rgb=False)
        kw.update(pixel_values_videos=px["pixel_values_videos"],
                  video_grid_thw=px["video_grid_thw"])
    if kw:  # 1: image tokens, 2: video tokens (transformers' processor's token types)
        kw["mm_token_type_ids"] = ((ids == ref.config.image_token_id).int()
                                   + 2 * (ids == ref.config.video_token_id).int())
    try:
        with torch.no_grad():
            hidden = ref.model(input_ids=ids, **kw).last_hidden_state[0]
    finally:
        hook.remove()
    embeds, pos = seen["inputs_embeds"][0], seen["position_ids"]
    if pos is None:  # text only: 1-D positions
        pos = torch.arange(len(prompt_ids))[None, None].expand(3, 1, -1)
    pos = pos[-3:]
    w = {n[len("mtp."):]: t for n, t in load_file(str(next(path.glob("*.safetensors")))).items()
         if n.startswith("mtp.")}
    H = tc.hidden_size
    layer = Qwen3_5DecoderLayer(tc, tc.layer_types.index("full_attention"))
    layer.load_state_dict({n[len("layers.0."):]: t for n, t in w.items()
                           if n.startswith("layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(H, eps=tc.rms_norm_eps)
        norms[name].load_state_dict({"weight": w[f"{name}.weight"]})
    fc = torch.nn.Linear(2 * H, H, bias=False)
    fc.load_state_dict({"weight": w["fc.weight"]})

    def mtp(e, h, p):
        x = fc(torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)], -1))
        cos, sin = lm.rotary_emb(x[None], p)
        return norms["norm"](layer(x[None], position_embeddings=(cos, sin))[0])

    with torch.no_grad():
        new = lm.embed_tokens(torch.tensor([sampled, draft]))
        first = mtp(torch.cat([embeds[1:], new[:1]]), hidden, pos)
        nxt = pos[:, :, -1:] + 1  # after the prompt (text): all rows equal
        second = mtp(torch.cat([embeds[1:], new]), torch.cat([hidden, first[-1:]]),
                     torch.cat([pos, nxt], dim=-1))
    return first, second[-1:]


@pytest.mark.parametrize("case", ["text", "image", "two", "video"])
def test_mtp_sees_what_the_target_saw(spec, ckpt, case):
    """The MTP pass over the prompt and the first drafting pass, row by row, against the
    reference: image embeddings where token p+1 is an image token, M-RoPE rows inside images
    and each frame group of a video (timestamps between them), the rope delta after the
    prompt. (Text: the reference itself checked.)"""
    imgs = {"text": [], "image": [image(40, 24, 1)],
            "two": [image(40, 24, 3), image(24, 72, 4)], "video": []}[case]
    clips = [frames(5, 36, 28, 1)] if case == "video" else []
    text = prompt({"text": "What is it?", "image": f"{IMG}What is it?",
                   "two": f"A {IMG} and B {IMG}: same?", "video": f"{VID}What happens?"}[case])
    spec.reset_prefix_cache()
    seen = recorded_mtp(spec)
    try:
        if clips:
            (out,) = spec.generate([{"prompt": text, "multi_modal_data": {"video": clips}}],
                                   SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            assert out.error is None, out.error
        else:
            out = run(spec, text, imgs, SamplingParams(temperature=0, max_tokens=4))
    finally:
        del spec.model.mtp_forward
    ids = out.prompt_token_ids
    (_, pos0, first), (d1, pos1, second) = seen[:2]
    assert first.shape[0] == len(ids) and second.shape[0] == 1
    want_first, want_second = reference_mtp(ckpt, ids, imgs, out.outputs[0].token_ids[0],
                                            int(d1[0]), clips)
    assert_rel_close(first, want_first, TOL, "the prompt's MTP rows")
    assert_rel_close(second, want_second, TOL, "the first drafting pass")


def test_prompt_lookup_drafts_stop_at_an_image_token():
    """A request's token_ids hold its image tokens as negative content keys: prompt lookup
    never drafts one (the target would embed it as a token id)."""
    from types import SimpleNamespace

    from hybridrt.specdec.ngram import NgramDrafter

    def drafts(tokens):
        req = SimpleNamespace(request_id="r", token_ids=tokens, is_finished=False)
        return NgramDrafter(1, 2).drafts(req, 3)

    assert drafts([5, 7, -3, -4, 9, 5, 7]) == []
    assert drafts([5, 7, 8, -3, -4, 5, 7]) == [8]
    assert drafts([5, 7, 8, 9, 4, 5, 7]) == [8, 9, 4]


def test_sampled_output_keeps_the_target_distribution(spec):
    """Temperature 1, k=2, an image prompt: the marginals of the first two tokens (the second
    one verified against the MTP's draft) match the exact ones (chi-square, p > 1e-3 with a
    fixed seed), each context's exact distribution from the target's logits run alone."""
    from helpers import chi2_pvalue

    eng, runner = spec.engine, spec.engine.runner
    item = {"prompt": prompt(f"{IMG}What?"), "multi_modal_data": {"image": [image(40, 24, 1)]}}
    last = []
    plain = type(runner).logits.__get__(runner)
    runner.logits = lambda *a, **kw: last.append(plain(*a, **kw)) or last[-1]
    try:
        def probs_after(extra: list[int]) -> torch.Tensor:
            _, ids, vision = spec.inputs.encode(item)
            rid = eng.add_request(ids + extra, SamplingParams(temperature=0, max_tokens=1),
                                  speculative_tokens=0, vision=vision)
            while eng.has_unfinished_requests():
                eng.step()
            eng.pop_request(rid)
            return torch.softmax(last[-1][-1].double(), -1)

        p1 = probs_after([])
        p2 = torch.stack([probs_after([a]) for a in range(spec.config.vocab_size)])
    finally:
        del runner.logits
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    outs = spec.generate([item] * 1024, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    toks = torch.tensor([o.outputs[0].token_ids[:2] for o in outs])
    drafted = sum(o.metrics["spec"]["num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["spec"]["num_accepted"] for o in outs)
    assert 0 < accepted < drafted
    for i, exact in enumerate([p1, p1 @ p2]):
        counts = torch.bincount(toks[:, i], minlength=len(p1)).double()
        stat, df, pval = chi2_pvalue(counts, exact)
        assert pval > 1e-3, f"token {i + 1}: chi2 {stat:.1f} (df {df}), p = {pval:.2g}"


def test_prompt_lookup_and_adaptive_k_with_images(ckpt, spec):
    """mtp+ngram with adaptive k (the MTP's lazy rows run later, from the first waiting
    position): greedy tokens equal k=0's."""
    llm = LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
              speculative_tokens=2, speculative_method="mtp+ngram", speculative_adaptive=True)
    imgs = [image(40, 24, 3), image(24, 72, 4)]
    text = prompt(f"A {IMG} and B {IMG}: same? A {IMG} or B {IMG}?")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = run(spec, text, imgs * 2, params, k=0).outputs[0].token_ids
    got = run(llm, text, imgs * 2, params)
    assert got.outputs[0].token_ids == want
    assert got.metrics["spec"]["num_draft_tokens"] > 0

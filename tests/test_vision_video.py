"""Video through the whole runtime against transformers' Qwen3_5ForConditionalGeneration on the
tiny random fp32 checkpoint (tests/vision_helpers.py): the prompt's ids equal to what
transformers' Qwen3VLProcessor makes of it (timestamps between frame groups), greedy tokens
equal and every step's logits within 1e-4 x max |logit|, for video frames and for a video
beside an image; a video file decoded with PyAV answers as its sampled frames given as a
list; the same video in turn 2 comes from the prefix cache; bad video input fails its own
request only."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from helpers import assert_rel_close
from test_vision_parity import GREEDY, IMG, STEPS, TOL, recording
from vision_helpers import image, video_processor, write_vision_checkpoint

from hybridrt import LLM, SamplingParams

VID = "<|vision_start|><|video_pad|><|vision_end|>"


def chat_text(body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def frames(n: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def video_file(clip: list[np.ndarray], fps: int) -> bytes:
    """An MPEG-4 file of ``clip`` at ``fps`` frames a second, written with PyAV."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = clip[0].shape[1], clip[0].shape[0]
        stream.pix_fmt = "yuv420p"
        for f in clip:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def decoded(raw: bytes) -> list[np.ndarray]:
    import av

    with av.open(io.BytesIO(raw)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("video"), seed=3)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt[0], dtype="float32", max_model_len=512, cache_memory="32MiB")


def reference(ckpt, text: str, images=None, videos=None, metadata=None):
    """transformers' Qwen3VLProcessor on the prompt's text and media (its video processor at
    the checkpoint's sizes, frames taken as given) -> (its prompt ids, the model's greedy
    tokens, its per-step logits)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    path, ref = ckpt
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *a: None  # our processor subclass
    try:
        proc = Qwen3VLProcessor(Qwen2VLImageProcessorPil.from_pretrained(str(path)),
                                PreTrainedTokenizerFast.from_pretrained(str(path)),
                                video_processor())
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    kwargs = {"do_sample_frames": False, "do_convert_rgb": False}
    if metadata is not None:
        kwargs["video_metadata"] = metadata
    batch = proc(text=[text], images=images, return_tensors="pt",
                 videos=None if videos is None else [np.stack(v) for v in videos],
                 videos_kwargs=kwargs)
    with torch.no_grad():
        g = ref.generate(**batch, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    n = batch["input_ids"].shape[1]
    return batch["input_ids"][0].tolist(), g.sequences[0, n:].tolist(), [x[0] for x in g.logits]


def check(llm, ckpt, prompt: dict, images=None, videos=None, metadata=None):
    """``prompt`` through ``llm`` against transformers: the prompt ids, the greedy tokens and
    each step's logits."""
    seen = recording(llm)
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert out.error is None, out.error
    ids, toks, ref_logits = reference(ckpt, prompt["prompt"], images, videos, metadata)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == toks
    ours = [x[-1] for x in seen if x.shape[0]]
    assert len(ours) == len(ref_logits)
    for i, (a, b) in enumerate(zip(ours, ref_logits)):
        assert_rel_close(a, b, TOL, f"step {i}")
    return out, ours[0]


def test_video_frames_match_transformers(llm, ckpt):
    """Five frames (three groups of two, the last padded) at a size the processor resizes;
    the ids carry "<t seconds>" before each group's vision start, as transformers' processor
    renders them (24 fps for frames without metadata)."""
    clip = frames(5, 36, 28, 1)
    out, first = check(llm, ckpt, {"prompt": chat_text(f"{VID}What happens?"),
                                   "multi_modal_data": {"video": clip}}, videos=[clip])
    v = out.metrics["vision"]  # resized to 32x32: 4x4 tokens a group
    assert (v["num_videos"], v["num_video_tokens"], v["encoder_runs"]) == (1, 3 * 16, 1)
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert "<0.0 seconds><|vision_start|>" in text and "<0.2 seconds><|vision_start|>" in text
    # the frames are seen: other frames of the same size give other logits
    seen = recording(llm)
    llm.generate([{"prompt": chat_text(f"{VID}What happens?"),
                   "multi_modal_data": {"video": frames(5, 36, 28, 2)}}], GREEDY,
                 use_tqdm=False)
    assert (seen[0][-1] - first).abs().max() > 1e-2


def test_video_with_metadata_and_an_image_in_one_prompt(llm, ckpt):
    """An image, then a video given with vLLM's metadata (4 fps, sampled frame indices):
    both as transformers has them, the video's timestamps from its metadata."""
    from transformers.video_utils import VideoMetadata

    img, clip = image(24, 40, 3), frames(4, 32, 32, 4)
    meta = {"fps": 4.0, "frames_indices": [0, 3, 6, 9]}
    out, _ = check(llm, ckpt, {"prompt": chat_text(f"A {IMG} then {VID} same?"),
                            "multi_modal_data": {"image": [img], "video": [(clip, meta)]}},
                   images=[img], videos=[clip],
                   metadata=[VideoMetadata(total_num_frames=10, **meta)])
    v = out.metrics["vision"]
    assert (v["num_images"], v["num_videos"], v["encoder_runs"]) == (1, 1, 2)  # per item
    assert "<0.4 seconds>" in llm.tokenizer.decode(out.prompt_token_ids)  # (0 + 3) / 4 / 2


def test_a_video_split_across_prefill_chunks_beside_a_text_request(ckpt, llm):
    """8-token chunks: the video's 4 x 16 tokens span many steps, encoded once, and the tokens
    are those of one unchunked run; a text request batched beside it is unchanged."""
    small = LLM(ckpt[0], dtype="float32", max_model_len=512, cache_memory="32MiB",
                max_num_batched_tokens=8, enable_prefix_caching=False)
    prompts = [{"prompt": chat_text(f"{VID}What happens?"),
                "multi_modal_data": {"video": frames(8, 32, 32, 11)}}, chat_text("No video.")]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].metrics["vision"]["encoder_runs"] == 1


def test_a_video_file_answers_as_its_sampled_frames(llm, ckpt, tmp_path):
    """A 10-frame MPEG-4 file at 8 fps, sampled at 2 fps (at least 4 frames: 0, 3, 6, 9),
    from a path, bytes and a chat ``video_url`` data URL: the same prompt and tokens as its
    decoded frames at those indices given as a list with that metadata."""
    raw = video_file(frames(10, 32, 24, 5), fps=8)
    path = tmp_path / "clip.mp4"
    path.write_bytes(raw)
    picked = [decoded(raw)[i] for i in (0, 3, 6, 9)]
    text = chat_text(f"{VID}What happens?")
    as_list, from_path, from_bytes = llm.generate([
        {"prompt": text, "multi_modal_data": {"video": (picked, {
            "fps": 8, "frames_indices": [0, 3, 6, 9]})}},
        {"prompt": text, "multi_modal_data": {"video": str(path)}},
        {"prompt": text, "multi_modal_data": {"video": [raw]}}], GREEDY, use_tqdm=False)
    assert as_list.error is None, as_list.error
    for out in (from_path, from_bytes):
        assert out.error is None, out.error
        assert out.prompt_token_ids == as_list.prompt_token_ids
        assert out.outputs[0].token_ids == as_list.outputs[0].token_ids
    url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    conv = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens?"}]}]
    (chat,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert chat.error is None and chat.prompt_token_ids == as_list.prompt_token_ids
    assert chat.outputs[0].token_ids == as_list.outputs[0].token_ids
    # all of a file's frames where the rate allows them, at their own timestamps
    every = LLM(ckpt[0], dtype="float32", max_model_len=512, cache_memory="32MiB",
                video_fps=8)
    (out,) = every.generate([{"prompt": text, "multi_modal_data": {"video": str(path)}}],
                            GREEDY, use_tqdm=False)
    assert out.metrics["vision"]["num_video_tokens"] == 5 * 12
    assert "<1.1 seconds>" in every.tokenizer.decode(out.prompt_token_ids)  # (8 + 9) / 8 / 2


def test_the_same_video_in_turn_2_comes_from_the_prefix_cache(llm, ckpt):
    """Turn 2 of a chat about a video: its tokens neither encoded nor prefilled again, and
    the output as transformers'; other frames of the same size hit only the text before."""
    llm.reset_prefix_cache()
    clip, other = frames(4, 32, 32, 6), frames(4, 32, 32, 7)

    def conv(video, answer=None):
        turn1 = [{"role": "user", "content": [{"type": "video", "video": video},
                                              {"type": "text", "text": "What is it?"}]}]
        if answer is None:
            return turn1
        return turn1 + [{"role": "assistant", "content": answer},
                        {"role": "user", "content": "And then?"}]

    (first,) = llm.chat(conv(clip), GREEDY, use_tqdm=False)
    assert first.metrics["vision"]["encoder_runs"] == 1
    answer = llm.tokenizer.decode(first.outputs[0].token_ids, skip_special_tokens=True)
    (again,) = llm.chat(conv(clip, answer), GREEDY, use_tqdm=False)
    assert again.metrics["vision"]["encoder_runs"] == 0
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 1
    text = llm.inputs.chat_prompt(conv(clip, answer), {}, True)["prompt"]
    ids, toks, _ = reference(ckpt, text, videos=[clip])
    assert again.prompt_token_ids == ids and again.outputs[0].token_ids == toks
    start = first.prompt_token_ids.index(ckpt[1].config.video_token_id)
    (diff,) = llm.chat(conv(other, answer), GREEDY, use_tqdm=False)
    assert diff.metrics["vision"]["encoder_runs"] == 1
    assert diff.num_cached_tokens <= start


@pytest.mark.parametrize("data, words", [
    ({"video": b"not a video"}, "the video bytes cannot be decoded as a video"),
    ({"video": np.zeros((0, 8, 8, 3), np.uint8)}, "the video has no frames"),
    ({"video": frames(33, 8, 8, 0)}, "the video has 33 frames, over the limit of 32"),
    ({"video": frames(1, 8, 8, 0)}, "the video has 1 frame(s): a video needs at least 2"),
    ({"video": [frames(2, 8, 8, 0)[0], frames(1, 16, 8, 0)[0]]}, "video frame 1 is 8x16"),
    ({"video": [frames(2, 8, 8, 0)] * 2}, "the prompt has 1 video placeholder(s)"),
    ({"video": "/no/such.mp4"}, "video file '/no/such.mp4' does not exist"),
    ({"video": "data:video/mp4;base64,!!"}, "the video data URL is not valid base64"),
])
def test_bad_video_input_fails_its_own_request(llm, data, words):
    outs = llm.generate([{"prompt": chat_text(f"{VID}?"), "multi_modal_data": data},
                         chat_text("fine")], SamplingParams(temperature=0, max_tokens=2),
                        use_tqdm=False)
    assert outs[0].error is not None and words in str(outs[0].error), outs[0].error
    assert "\n" not in str(outs[0].error)
    assert outs[1].error is None


def test_video_limits_and_no_pyav_fail_their_own_request(ckpt, llm, monkeypatch):
    """More videos than limit_mm_per_prompt, more frames than video_max_frames, video tokens
    past max_model_len, a file without PyAV: each fails its own request."""
    limited = LLM(ckpt[0], dtype="float32", max_model_len=128, cache_memory="32MiB",
                  limit_mm_per_prompt={"video": 1}, video_max_frames=8)
    assert limited.vision.max_videos == 1 and limited.vision.video_max_frames == 8
    clip = frames(2, 16, 16, 8)
    outs = limited.generate([
        {"prompt": chat_text(f"{VID}{VID}?"), "multi_modal_data": {"video": [clip, object()]}},
        {"prompt": chat_text(f"{VID}?"), "multi_modal_data": {"video": frames(9, 8, 8, 0)}},
        {"prompt": chat_text(f"{VID}?"), "multi_modal_data": {"video": frames(8, 32, 32, 0)}},
        {"prompt": chat_text(f"{VID}?"), "multi_modal_data": {"video": clip}}],
        GREEDY, use_tqdm=False)
    assert str(outs[0].error) == ("the prompt holds 2 video(s), over the limit of 1 per prompt "
                                  "(limit_mm_per_prompt / --limit-mm-per-prompt)")
    assert "the video has 9 frames, over the limit of 8" in str(outs[1].error)
    assert "but max_model_len is 128" in str(outs[2].error)  # video tokens past the context
    assert outs[3].error is None
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # PyAV not installed
    outs = llm.generate([{"prompt": chat_text(f"{VID}?"), "multi_modal_data": {
        "video": b"\0\0\0\x18ftypmp42"}}, {"prompt": chat_text(f"{VID}?"),
                                             "multi_modal_data": {"video": clip}}],
        GREEDY, use_tqdm=False)
    assert str(outs[0].error) == ("decoding a video file needs PyAV: pip install "
                                  "'hybridrt[video]' (or give the video as a list of frames)")
    assert outs[1].error is None  # frames need no decoder


@pytest.mark.parametrize("kwargs, words", [({"video_fps": 0}, "video_fps"),
                                           ({"video_max_frames": 0}, "video_max_frames")])
def test_bad_video_settings_are_one_error_before_loading(kwargs, words):
    from hybridrt.engine_args import EngineArgs

    with pytest.raises(ValueError, match=words):
        EngineArgs(**kwargs)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """A checkpoint with an MTP layer too, drafting 2 tokens (no prefix cache: each run
    prefills and encodes anew)."""
    ckpt, _ = write_vision_checkpoint(tmp_path_factory.mktemp("vspec"), seed=3, with_mtp=True)
    return LLM(ckpt, dtype="float32", max_model_len=512, cache_memory="32MiB",
               speculative_tokens=2, enable_prefix_caching=False)


MIXED = {"prompt": chat_text(f"A {IMG} then {VID}: what happens?"),
         "multi_modal_data": {"image": [image(40, 24, 8)], "video": [frames(5, 32, 32, 9)]}}


def test_mtp_speculation_on_a_video_prompt_keeps_the_greedy_tokens(spec):
    """k=2 (the MTP row before a frame group's token takes its embedding, a row inside one its
    (t, h, w) rotary row) gives k=0's greedy tokens, with drafts, for a video alone and for an
    image then a video."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = {"prompt": chat_text(f"{VID}What happens?"),
             "multi_modal_data": {"video": frames(5, 36, 28, 1)}}
    for item in (alone, MIXED):
        (want,) = spec.generate([item], params, use_tqdm=False, speculative_tokens=0)
        (got,) = spec.generate([item], params, use_tqdm=False)
        assert want.error is None and got.error is None, (want.error, got.error)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.metrics["spec"]["num_draft_tokens"] > 0  # it drafted


def test_a_video_larger_than_the_encoder_budget_is_encoded_alone(spec):
    """An image (15 tokens) then a video (3 x 16 tokens) under an encoder budget of 20 with
    k=2: the image in one step's run, the video alone in a later one, and the tokens of an
    unbudgeted run that encodes both together."""
    from hybridrt.vision.encoder_cache import EncoderCache

    tower, sched = spec.vision, spec.engine.scheduler
    runs, plain = [], tower.encode
    tower.encode = lambda items: runs.append([it.num_tokens(2) for it in items]) or plain(items)
    cache, tower.cache = tower.cache, EncoderCache(0)
    outs = []
    try:
        for budget in (10**6, 20):
            sched.encoder_budget = budget
            (out,) = spec.generate([MIXED], GREEDY, use_tqdm=False)
            assert out.error is None, out.error
            outs.append(out.outputs[0].token_ids)
    finally:
        tower.encode, tower.cache = plain, cache
        sched.encoder_budget = spec.engine.args.max_num_batched_tokens
    assert runs == [[15, 48], [15], [48]]
    assert outs[0] == outs[1]


def test_the_same_video_after_another_prefix_comes_from_the_encoder_cache(llm):
    """The prefix cache cannot serve a video after other text; the encoder cache does (by the
    video's digest), with the tokens of a run that encodes it; other frames miss."""
    from hybridrt.vision.encoder_cache import EncoderCache

    clip = frames(4, 32, 32, 12)

    def run(text, video=clip):
        (out,) = llm.generate([{"prompt": chat_text(text), "multi_modal_data": {"video": video}}],
                              GREEDY, use_tqdm=False)
        assert out.error is None, out.error
        v = out.metrics["vision"]
        return out.outputs[0].token_ids, (v["encoder_runs"], v["encoder_cache_hits"])

    cache, llm.vision.cache = llm.vision.cache, EncoderCache(1 << 20)
    try:
        assert run(f"{VID}What is it?")[1] == (1, 0)
        hit, counts = run(f"Look here: {VID}What is it?")
        assert counts == (0, 1)
        assert run(f"{VID}What is it?", frames(4, 32, 32, 13))[1] == (1, 0)
        llm.vision.cache = EncoderCache(0)
        llm.reset_prefix_cache()
        cold, counts = run(f"Look here: {VID}What is it?")
        assert counts == (1, 0) and cold == hit
    finally:
        llm.vision.cache = cache


def test_server_takes_video_url_data_urls(llm):
    """The OpenAI chat endpoint with a ``video_url`` data URL answers what LLM.chat does; a
    path or an http URL without allowed domains is a 400."""
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    from test_serve import Running

    url = "data:video/mp4;base64," + base64.b64encode(
        video_file(frames(6, 24, 24, 9), fps=4)).decode()
    conv = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": "video_url", "video_url": {"url": url}}]}]
    (want,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert want.error is None, want.error
    srv = Running(llm)
    try:
        r = httpx.post(f"{srv.base}/v1/chat/completions", json={
            "messages": conv, "max_tokens": STEPS, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        for bad, words in [("/tmp/a.mp4", "data URLs"),
                           ("http://example.com/a.mp4", "--allowed-media-domains"),
                           ("data:video/mp4;base64,AAAA", "cannot be decoded as a video")]:
            body = {"messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": bad}}]}], "max_tokens": 2}
            r = httpx.post(f"{srv.base}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def test_server_fetches_video_urls_of_allowed_hosts(llm):
    """An http ``video_url`` on a host the operator allows (a loopback server answering
    video/mp4) answers as the same file as a data URL."""
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from test_serve import Running

    from hybridrt.vision.fetch import MediaPolicy

    raw = video_file(frames(6, 24, 24, 10), fps=4)

    class Clip(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    web = ThreadingHTTPServer(("127.0.0.1", 0), Clip)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    srv = Running(llm, media=MediaPolicy(("localhost",), timeout=20))
    try:
        answers = []
        for url in (f"http://localhost:{web.server_port}/clip.mp4",
                    "data:video/mp4;base64," + base64.b64encode(raw).decode()):
            r = httpx.post(f"{srv.base}/v1/chat/completions", json={"messages": [
                {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What?"}]}],
                "max_tokens": STEPS, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            answers.append((r.json()["choices"][0]["message"],
                            r.json()["usage"]["prompt_tokens"]))
        assert answers[0] == answers[1]
    finally:
        srv.stop()
        web.shutdown()
        web.server_close()


def test_the_video_processor_equals_transformers_with_torchvision():
    """Where torchvision is installed (it is not a dependency): transformers' own
    Qwen3VLVideoProcessor, torchvision's resize and normalize, gives the pixels ours gives."""
    pytest.importorskip("torchvision")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    kw = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
          "size": {"shortest_edge": 128, "longest_edge": 48 * 48 * 8},
          "cap_pixels_per_frame": False}
    clip = np.stack(frames(5, 37, 29, 12))  # resized to 40x32
    want = Qwen3VLVideoProcessor(**kw)(videos=[clip], return_tensors="pt",
                                       do_sample_frames=False)
    got = video_processor()(videos=[clip], return_tensors="pt", do_sample_frames=False,
                            do_convert_rgb=False)
    assert want["video_grid_thw"].tolist() == got["video_grid_thw"].tolist() == [[3, 10, 8]]
    assert torch.equal(want["pixel_values_videos"], got["pixel_values_videos"])

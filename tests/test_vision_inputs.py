"""Images and video are never silently dropped: a model that cannot take them refuses the
request that carries them (a ValueError output in ``LLM.generate`` / ``LLM.chat``, a 400 from
the server, an error line in ``hybridrt chat``), and the other requests run as before."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from hybridrt import LLM, SamplingParams
from hybridrt.cli.main import app
from hybridrt.vision import inputs

GREEDY = SamplingParams(temperature=0, max_tokens=4)
IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.fixture(scope="module")
def text_demo(tmp_path_factory):
    """The embedded demo model without its vision tower (``model.visual.*`` left out): a
    checkpoint that cannot take images."""
    import shutil

    from safetensors.torch import load_file

    from hybridrt.model_path import DEMO_MODEL_DIR

    out = tmp_path_factory.mktemp("text_demo")
    for f in DEMO_MODEL_DIR.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(DEMO_MODEL_DIR / "model.safetensors"))
    save_file({n: t for n, t in weights.items() if not n.startswith("model.visual.")},
              str(out / "model.safetensors"))
    assert not inputs.has_vision_tower(out)
    return out


@pytest.fixture(scope="module")
def demo(text_demo):
    return LLM(str(text_demo), dtype="float32", max_model_len=256, cache_memory="32MiB")


def test_generate_refuses_multi_modal_data_for_that_prompt_only(demo):
    img = object()  # never looked at: the refusal comes first
    outs = demo.generate([{"prompt": "hi <|vision_start|>", "multi_modal_data": {"image": [img]}},
                          "def f(x):"], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert str(outs[0].error) == "multi_modal_data (image) refused: this model has no vision tower"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    (alone,) = demo.generate(["def f(x):"], GREEDY, use_tqdm=False)
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"multi_modal_data \(video\) refused"):
        list(demo.stream({"prompt": "hi", "multi_modal_data": {"video": [[img]]}}, GREEDY))


@pytest.mark.parametrize("part", [IMAGE_URL, {"type": "image", "image": "x.png"},
                                  {"type": "video", "video": ["a.png", "b.png"]}])
def test_chat_refuses_image_and_video_parts_for_that_conversation_only(demo, part):
    with_media = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    text_only = [{"role": "user", "content": "What does json.dumps do?"}]
    outs = demo.chat([with_media, text_only], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert str(outs[0].error) == (f"messages[0].content[1] is an {part['type']!r} part: "
                                  f"refused, this model has no vision tower")
    assert outs[1].error is None and outs[1].outputs[0].token_ids


def test_has_vision_tower_needs_the_config_and_the_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"depth": 1}}))
    save_file({"model.language_model.norm.weight": torch.ones(2)},
              str(tmp_path / "model.safetensors"))
    assert not inputs.has_vision_tower(tmp_path)  # a vision_config without the weights
    save_file({"model.visual.merger.norm.weight": torch.ones(2)},
              str(tmp_path / "model.safetensors"))
    assert inputs.has_vision_tower(tmp_path)
    assert inputs.refusal_reason(True, language_model_only=True) == \
        "the vision tower was not loaded (language_model_only)"
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {}}))
    assert not inputs.has_vision_tower(tmp_path)


def test_server_answers_400_for_image_parts_and_goes_on(demo):
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    from test_serve import Running

    srv = Running(demo)
    try:
        for part in (IMAGE_URL, {"type": "video_url", "video_url": {"url": "data:x"}}):
            body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                              part]}], "max_tokens": 2}
            r = httpx.post(f"{srv.base}/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == (
                f"messages[0].content[1] is an {part['type']!r} part: refused, this model has "
                f"no vision tower")
        r = httpx.post(f"{srv.base}/v1/completions",
                       json={"prompt": "hi", "multi_modal_data": {"image": ["x"]}})
        assert r.status_code == 400 and "refused" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.base}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_cli_chat_refuses_image_flag_and_command(text_demo, tmp_path):
    img = tmp_path / "cat.png"
    img.write_bytes(b"not read")
    run = CliRunner().invoke
    res = run(app, ["chat", str(text_demo), "--image", str(img), "--max-model-len", "256"],
              input="hi\n")
    assert res.exit_code == 2
    assert res.stderr.strip() == (f"error: --image {img}: refused, this model has no vision "
                                  f"tower")
    res = run(app, ["chat", str(text_demo), "--max-model-len", "256", "--max-tokens", "2",
                    "--temperature", "0"], input=f"/image {img}\nhi\n/exit\n")
    assert res.exit_code == 0, res.output
    assert f"error: /image {img}: refused, this model has no vision tower" in res.stderr
    assert "[prompt" in res.stdout  # the chat went on and answered the next message

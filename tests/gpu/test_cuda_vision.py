"""Images on the CUDA backend: backend "cuda" on a GPU, "triton" under TRITON_INTERPRET=1 on
CPU (the same kernels, eager). The tower's products take the backend's ``linear``, its attention
SDPA per image; the text model runs the backend's kernels with the image rows' embeddings and
M-RoPE positions. Against the reference backend on a tiny random checkpoint with a vision tower
and an MTP layer (tests/vision_helpers.py): greedy tokens equal and every step's logits close,
for one image and for two images of different sizes, and with k=2 speculation."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close
from vision_helpers import image, write_vision_checkpoint

from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams

ON_GPU = torch.cuda.is_available()
BACKEND = "cuda" if ON_GPU else "triton"
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
CASES = {
    "one": ("<|im_start|>user\n" + IMG + "What is it?<|im_end|>\n<|im_start|>assistant\n",
            [(40, 24, 1)]),
    "two": ("<|im_start|>user\nA " + IMG + " and B " + IMG + "?<|im_end|>\n"
            "<|im_start|>assistant\n", [(40, 24, 3), (24, 72, 4)]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("cuda_vision"), seed=2,
                                   with_mtp=True)[0]


def run(llm, case: str, k: int):
    text, sizes = CASES[case]
    item = {"prompt": text, "multi_modal_data": {"image": [image(*s) for s in sizes]}}
    (out,) = llm.generate([item], GREEDY, use_tqdm=False, speculative_tokens=k)
    assert out.error is None, out.error
    return out.outputs[0]


@pytest.mark.parametrize("case", list(CASES))
def test_image_prompts_match_the_reference(ckpt, case):
    kw = dict(dtype="float32", max_model_len=256, cache_memory="32MiB", speculative_tokens=2)
    ref = LLM(str(ckpt), backend="reference", device="cpu", **kw)
    ours = LLM(str(ckpt), backend=BACKEND, device="cuda" if ON_GPU else "cpu", **kw)
    want = run(ref, case, 0)
    for k in (0, 2):
        got = run(ours, case, k)
        assert got.token_ids == want.token_ids, k
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert_rel_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())),
                             2e-3, f"k={k} logprobs")

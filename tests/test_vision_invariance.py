"""Batch-invariant mode with images (issue 46): a request with images gives the same token ids
and logprob bytes whatever runs beside it (text requests, other images, the same image), however
the step budget splits its image tokens across prompt chunks, on 1 or 2 threads, and with MTP
speculation at k = 2 as at k = 0. Tiny random bf16 checkpoint with a vision tower and an MTP
layer (tests/vision_helpers.py); the default mode's run of the same harness must differ."""

from __future__ import annotations

import random

import pytest
from helpers import output_bytes
from vision_helpers import image, write_vision_checkpoint

from hybridrt import LLM, SamplingParams
from hybridrt.kernels import native

pytestmark = [pytest.mark.usefixtures("one_thread_module"),
              pytest.mark.skipif(not native.half_paths(),
                                 reason="compiled CPU kernels unavailable")]

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # a tower wide enough that its products' sums would change with the row count
    return write_vision_checkpoint(tmp_path_factory.mktemp("vinv"), seed=11, with_mtp=True,
                                   vision={"hidden_size": 256, "intermediate_size": 512})[0]


TARGETS = [  # (text, images, params)
    (prompt(f"{IMG}What is it?"), [image(40, 24, 1)],
     dict(temperature=0, max_tokens=10, logprobs=2)),
    (prompt(f"A {IMG} and B {IMG}: same?"), [image(40, 24, 3), image(24, 72, 4)],
     dict(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, logprobs=1)),
]


def item(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def llm_for(ckpt, invariant, threads=1, **kw):
    return LLM(ckpt, dtype="bfloat16", batch_invariant=invariant, threads=threads,
               max_model_len=256, cache_memory="32MiB", speculative_tokens=2,
               enable_prefix_caching=False, **kw)


def alone(ckpt, invariant):
    llm = llm_for(ckpt, invariant, max_num_batched_tokens=256)
    return [output_bytes(llm.generate([item(t, imgs)], [SamplingParams(ignore_eos=True, **p)],
                                      use_tqdm=False, speculative_tokens=0)[0])
            for t, imgs, p in TARGETS]


def mismatches(ckpt, ref, invariant, n=3):
    rng = random.Random(0)
    found = []
    for c in range(n):
        k = (2, 0, 2)[c]
        kw = dict(max_num_batched_tokens=(7, 16, 33)[c], max_num_seqs=(3, 5, 8)[c])
        llm = llm_for(ckpt, invariant, threads=(1, 2, 1)[c], **kw)
        items = [(i, item(t, imgs), SamplingParams(ignore_eos=True, **p))
                 for i, (t, imgs, p) in enumerate(TARGETS)]
        for j in range(rng.randint(2, 4)):
            text = prompt("x" * rng.randint(1, 40) + (IMG if j % 2 else ""))
            imgs = [image(rng.choice((24, 40)), rng.choice((24, 32)), 20 + j)] if j % 2 else []
            items.append((None, item(text, imgs), SamplingParams(
                max_tokens=rng.randint(1, 12), ignore_eos=True,
                temperature=rng.choice((0, 1.0)))))
        rng.shuffle(items)
        outs = llm.generate([x for _, x, _ in items], [sp for _, _, sp in items],
                            use_tqdm=False, speculative_tokens=k)
        for (i, _, _), out in zip(items, outs):
            assert out.error is None, out.error
            if i is not None and output_bytes(out) != ref[i]:
                found.append((c, i, kw, k))
    return found


def test_image_requests_do_not_depend_on_the_batch(ckpt):
    ref = alone(ckpt, invariant=True)
    assert mismatches(ckpt, ref, invariant=True) == []


def test_default_mode_differs(ckpt):
    """The same harness without the mode finds a difference: it can fail."""
    ref = alone(ckpt, invariant=False)
    assert mismatches(ckpt, ref, invariant=False)

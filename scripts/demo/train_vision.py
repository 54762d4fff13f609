"""Give hybridrt's demo checkpoint a tiny vision tower, trained on synthetic pictures of shapes.

Input: a text-only demo checkpoint (``train.py``'s output). Output: the same checkpoint with

* a Qwen3.5 vision tower (transformers' ``Qwen3_5VisionModel``: patch 16, temporal patch 2,
  spatial merge 2, a learned 8x8 position grid, ``out_hidden_size`` = the text width) under
  ``model.visual.*``, its ``vision_config`` and the vision token ids in ``config.json``;
* the vision tokens ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` and
  ``<|video_pad|>`` added to the tokenizer after its own ids (the embedding grows to the next
  multiple of 64) and the chat template that renders image parts as Qwen's placeholder;
* ``preprocessor_config.json`` (transformers' Qwen2-VL image processor: images resized to
  multiples of 32 pixels between 64x64 and 128x128 pixels, i.e. 4 to 16 image tokens);
* ``demo.png``, a picture the model answers about (``hybridrt chat --image``).

The pictures: one filled shape (circle, square, triangle) of one colour (red, green, blue,
yellow, purple, orange) on a white, black or grey background, at a random size and place in an
image of random size, all drawn with Pillow from a seeded RNG. Questions and answers:
"What is in this image?" -> "A red circle.", "What colour is the circle?" -> "Red.",
"What shape is this?" -> "A circle." (and rephrasings).

Training, in two phases. First the tower alone (``--pretrain-steps``): two linear probes on the
mean of each picture's merged tokens classify its shape and its colour (cross entropy, the
tower at ``--pretrain-lr``, cosine decay; a tenth of a second a step). Measured: trained only
through the answers, the tower learned colours in 30 steps but no shape in 600 (answers at
chance, 0.38 held out); the probe alone needs about 1000 steps before shapes start to separate.
Then the tower and the text model (and the MTP head) jointly. Each step takes a batch of
pictures (loss on the answer tokens only) and a batch of the demo's text corpus (the loss of
``train.py``: LM + 0.3 MTP), so the text answers and MTP acceptance are kept. The tower learns
at ``--lr``, the text model and MTP head at ``--text-lr``; linear warmup then cosine decay over
``--steps`` steps (no wall-clock budget: the pictures, questions, text batches and the tower's
initialisation follow from ``--seed``; one thread keeps the float sums in one order, and two
torch threads on a loaded 2-core machine ran several times slower). At the end it prints the
held-out accuracy on ``--eval-images`` pictures drawn with another seed.

The command (base: the text-only demo model as of commit 22ad943; a step took from 2.4 s to
over a minute on the project's shared 2-core machine, depending on its other load):

    mkdir -p build/demo/text && for f in config.json generation_config.json \\
        model.safetensors tokenizer.json tokenizer_config.json; do
      git show 22ad943:hybridrt/demo_model/$f > build/demo/text/$f; done
    nice -n 19 python scripts/demo/train_vision.py --base build/demo/text \\
        --out hybridrt/demo_model
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

# sibling scripts, importable only once HERE is on sys.path (set just above)
import make_corpus  # noqa: E402
import train  # noqa: E402

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_ID_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                  "video_token_id")

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 70, 220),
           "yellow": (240, 210, 20), "purple": (140, 50, 180), "orange": (245, 130, 20)}
BACKGROUNDS = [(255, 255, 255), (0, 0, 0), (128, 128, 128)]
SHAPES = ("circle", "square", "triangle")
DESCRIBE = ("What is in this image?", "What do you see?", "Describe the image.",
            "What is this?")
COLOUR_Q = ("What colour is the {shape}?", "What color is the {shape}?")
SHAPE_Q = ("What shape is this?", "What shape is in the image?")

# transformers' Qwen2-VL image processor as the checkpoint's preprocessor_config.json sets it
PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
             "min_pixels": 64 * 64, "max_pixels": 128 * 128}
DEMO_IMAGE = {"shape": "circle", "colour": "red", "size": (128, 128), "box": (28, 28, 100, 100),
              "background": (255, 255, 255)}


# --- pictures -----------------------------------------------------------------------------------

def draw(shape: str, colour: str, size: tuple[int, int], box: tuple[int, int, int, int],
         background: tuple[int, int, int]):
    """One filled shape inside ``box`` (x0, y0, x1, y1) on a plain ``size`` (w, h) image."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, background)
    d = ImageDraw.Draw(img)
    fill = COLOURS[colour]
    x0, y0, x1, y1 = box
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:
        d.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return img


def random_picture(rng: random.Random):
    """-> (PIL image, shape, colour) drawn from ``rng``."""
    w, h = rng.randint(64, 160), rng.randint(64, 160)
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    side = rng.randint(int(0.35 * min(w, h)), int(0.8 * min(w, h)))
    x0, y0 = rng.randint(0, w - side), rng.randint(0, h - side)
    img = draw(shape, colour, (w, h), (x0, y0, x0 + side, y0 + side), rng.choice(BACKGROUNDS))
    return img, shape, colour


def demo_image():
    return draw(**DEMO_IMAGE)


def question_answer(rng: random.Random, shape: str, colour: str) -> tuple[str, str]:
    kind = rng.random()
    if kind < 0.5:
        return rng.choice(DESCRIBE), f"A {colour} {shape}."
    if kind < 0.75:
        return rng.choice(COLOUR_Q).format(shape=shape), colour.capitalize() + "."
    return rng.choice(SHAPE_Q), f"A {shape}."


def describe_answer(shape: str, colour: str) -> str:
    """The answer to "What is in this image?"."""
    return f"A {colour} {shape}."


# --- checkpoint ---------------------------------------------------------------------------------

def with_picture_parts(template: str) -> str:
    """The base's chat template (tools and all) with user and system content rendered by
    ``train.py``'s ``render_content`` macro: text parts as their text, image and video parts as
    Qwen's placeholders."""
    end = "{%- endmacro %}"
    macro = train.CHAT_TEMPLATE[:train.CHAT_TEMPLATE.index(end) + len(end)]
    out = template.replace("+ messages[0].content", "+ render_content(messages[0].content)")
    out = out.replace("+ message.content + '<|im_end|>",
                      "+ render_content(message.content) + '<|im_end|>")
    if out.count("render_content(") != 3:
        raise SystemExit("the base's chat template is not the one with_picture_parts knows")
    return macro + out


def add_vision_tokens(base: Path, out: Path) -> tuple[dict, int]:
    """Tokenizer of ``base`` + the vision tokens and the parts-aware template, written to
    ``out`` -> (the vision token ids by config key, the padded vocabulary size)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    have = tok.get_vocab(with_added_tokens=True)
    new = [t for t in VISION_TOKENS if t not in have]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg["chat_template"] = with_picture_parts(cfg["chat_template"])
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False)
                                               + "\n")
    ids = dict(zip(VISION_ID_KEYS, (tok.token_to_id(t) for t in VISION_TOKENS)))
    return ids, -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64


def vision_config(args, out_hidden: int) -> dict:
    return {"model_type": "qwen3_5_vision", "depth": args.depth, "hidden_size": args.vision_hidden,
            "num_heads": args.vision_heads, "intermediate_size": args.vision_intermediate,
            "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 64,
            "out_hidden_size": out_hidden, "initializer_range": 0.02}


def full_config(text: dict, vision: dict, ids: dict) -> dict:
    cfg = train.published_config(text)
    cfg["vision_config"] = vision
    cfg.update(ids)
    return cfg


def build(base: Path, config: dict, seed: int):
    """-> (transformers' Qwen3_5ForConditionalGeneration with ``base``'s text weights, the
    embedding grown to the new vocabulary, a fresh tower; ``base``'s MTP head), fp32."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    _, trunk, mtp = train.load_checkpoint(base)
    torch.manual_seed(seed)
    hf = Qwen3_5Config(**{k: v for k, v in config.items() if k not in ("architectures", "dtype")})
    hf._attn_implementation = "sdpa"
    hf.text_config._attn_implementation = "sdpa"
    hf.vision_config._attn_implementation = "sdpa"
    model = Qwen3_5ForConditionalGeneration(hf).float()
    sd = trunk.model.state_dict()
    old = sd["embed_tokens.weight"]
    grown = torch.zeros(config["text_config"]["vocab_size"], old.shape[1])
    grown[:len(old)] = old
    n_new = len(VISION_TOKENS)  # the vision tokens' rows: small random; the padding rows: zero
    grown[len(old):len(old) + n_new] = 0.02 * torch.randn(n_new, old.shape[1])
    sd["embed_tokens.weight"] = grown
    model.model.language_model.load_state_dict(sd, strict=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    return model, mtp


def save(out: Path, model, mtp, config: dict, base: Path) -> None:
    from safetensors.torch import save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd.update({"mtp." + k: v for k, v in mtp.state_dict().items()})
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if base.resolve() != out.resolve():
        shutil.copyfile(base / "generation_config.json", out / "generation_config.json")
    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(str(out))
    demo_image().save(out / "demo.png", optimize=True)


# --- data ---------------------------------------------------------------------------------------

class Pictures:
    """Batches of chat samples about pictures: token rows with each image's pad tokens expanded,
    labels on the answer (and its <|im_end|>) only, the processor's patches and grids."""

    def __init__(self, hf_tok, processor, ids: dict):
        self.tok, self.proc, self.ids = hf_tok, processor, ids
        self.eot = hf_tok.convert_tokens_to_ids(train.EOT)

    def prompt_ids(self, question: str, n_image_tokens: int) -> list[int]:
        msgs = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": question}]}]
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = self.tok.encode(text, add_special_tokens=False)
        i = ids.index(self.ids["image_token_id"])
        return ids[:i] + [ids[i]] * n_image_tokens + ids[i + 1:]

    def processed(self, images):
        out = self.proc(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def batch(self, rng: random.Random, n: int):
        samples = [random_picture(rng) for _ in range(n)]
        pixels, grids = self.processed([s[0] for s in samples])
        rows, labels = [], []
        im_end = self.tok.convert_tokens_to_ids(train.IM_END)
        for (_, shape, colour), grid in zip(samples, grids):
            q, a = question_answer(rng, shape, colour)
            prompt = self.prompt_ids(q, int(grid.prod()) // 4)
            answer = self.tok.encode(a, add_special_tokens=False) + [im_end]
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        return (*padded(rows, labels, self.eot), pixels, grids, samples)


def padded(rows: list[list[int]], labels: list[list[int]], pad: int):
    """Token rows and their labels (-100: no loss) right-padded into [n, width] tensors."""
    width = max(map(len, rows))
    x = torch.full((len(rows), width), pad, dtype=torch.long)
    y = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, (a, b) in enumerate(zip(rows, labels)):
        x[r, :len(a)] = torch.tensor(a)
        y[r, :len(b)] = torch.tensor(b)
    return x, y


def chat_batch(tok, chats: list[list[dict]], rng: random.Random, n: int):
    """``n`` of the corpus's one-question chats, labels on the answer (and its <|im_end|>)
    only: the same kind of rows as the pictures' but with no picture, so that a question with
    no picture keeps its docstring answer."""
    im_end, eot = tok.convert_tokens_to_ids(train.IM_END), tok.convert_tokens_to_ids(train.EOT)
    rows, labels = [], []
    for msgs in rng.sample(chats, n):
        prompt = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        p = tok.encode(prompt, add_special_tokens=False)
        a = tok.encode(msgs[-1]["content"], add_special_tokens=False)[:64] + [im_end]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    return padded(rows, labels, eot)


def answer_loss(model, hidden: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the labelled (answer) tokens from the final hidden states (right
    padding: causal, so the pads change nothing before)."""
    logits = model.lm_head(hidden[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1),
                           ignore_index=-100)


def chat_loss(model, x, y):
    return answer_loss(model, model.model.language_model(input_ids=x, use_cache=False)
                       .last_hidden_state, y)


def picture_loss(model, x, y, pixels, grids, image_id: int):
    out = model.model(input_ids=x, pixel_values=pixels, image_grid_thw=grids,
                      mm_token_type_ids=(x == image_id).int(), use_cache=False)
    return answer_loss(model, out.last_hidden_state, y)


@torch.no_grad()
def answer(model, pictures: Pictures, image, question: str, max_new: int = 16) -> str:
    """Greedy answer of the transformers model to ``question`` about ``image``."""
    pixels, grids = pictures.processed([image])
    ids = pictures.prompt_ids(question, int(grids[0].prod()) // 4)
    x = torch.tensor([ids])
    im_end = pictures.tok.convert_tokens_to_ids(train.IM_END)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=pixels,
                         image_grid_thw=grids, mm_token_type_ids=(x == pictures.ids[
                             "image_token_id"]).int(), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=[im_end], pad_token_id=pictures.eot)
    return pictures.tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()


def held_out_accuracy(model, pictures: Pictures, n: int, seed: int) -> float:
    rng = random.Random(seed)
    model.eval()
    good = 0
    for _ in range(n):
        img, shape, colour = random_picture(rng)
        good += answer(model, pictures, img, DESCRIBE[0]) == describe_answer(shape, colour)
    model.train()
    return good / n


# --- training -----------------------------------------------------------------------------------

def lr_scale(step: int, args, steps: int | None = None) -> float:
    warm = min(1.0, (step + 1) / max(args.warmup_steps, 1))
    p = min(step / max(steps or args.steps, 1), 1.0)
    return warm * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


class Probes(torch.nn.Module):
    """Two linear probes on the mean of each picture's merged tokens: its shape and colour."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, len(SHAPES) + len(COLOURS))

    def loss(self, merged: torch.Tensor, grids: torch.Tensor, samples) -> tuple:
        """-> (cross entropy of shape + colour, the fraction of shapes right)."""
        pooled = torch.stack([e.mean(0) for e in torch.split(merged,
                                                             (grids.prod(-1) // 4).tolist())])
        logits = self.linear(pooled)
        shape = torch.tensor([SHAPES.index(s[1]) for s in samples])
        colour = torch.tensor([list(COLOURS).index(s[2]) for s in samples])
        ns = len(SHAPES)
        right = (logits[:, :ns].argmax(-1) == shape).float().mean().item()
        return (F.cross_entropy(logits[:, :ns], shape)
                + F.cross_entropy(logits[:, ns:], colour)), right


def pretrain_tower(model, pictures: Pictures, args, rng: random.Random) -> Probes:
    """The first phase: the tower and the probes, ``--pretrain-steps`` steps of
    ``--image-batch`` pictures -> the probes (the joint phase keeps training them)."""
    tower = model.model.visual
    probes = Probes(model.config.vision_config.out_hidden_size)
    params = list(tower.parameters()) + list(probes.parameters())
    opt = torch.optim.AdamW(params, lr=args.pretrain_lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=args.weight_decay)
    t0 = time.time()
    for step in range(args.pretrain_steps):
        for g in opt.param_groups:
            g["lr"] = args.pretrain_lr * lr_scale(step, args, args.pretrain_steps)
        samples = [random_picture(rng) for _ in range(args.image_batch)]
        pixels, grids = pictures.processed([s[0] for s in samples])
        loss, right = probes.loss(tower(pixels, grid_thw=grids).pooler_output, grids, samples)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % (args.log_every * 10) == 0 or step == args.pretrain_steps - 1:
            print(f"tower step {step:5d} | probes {loss.item():.3f} | shapes right {right:.2f} "
                  f"| {(time.time() - t0) / 60:.1f} min", flush=True)
    return probes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Add a trained vision tower to the demo checkpoint.")
    ap.add_argument("--base", type=Path, required=True, help="text-only demo checkpoint")
    ap.add_argument("--out", type=Path, default=REPO / "hybridrt" / "demo_model")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--pretrain-steps", type=int, default=4000,
                    help="the tower's steps with the shape and colour probes, before the joint")
    ap.add_argument("--pretrain-lr", type=float, default=1e-3)
    ap.add_argument("--chat-batch", type=int, default=24,
                    help="one-question chats with no picture a step, loss on their answers")
    ap.add_argument("--probe-weight", type=float, default=1.0,
                    help="the probes' loss kept in the joint phase, so the tower keeps shapes")
    ap.add_argument("--image-batch", type=int, default=24)
    ap.add_argument("--text-batch", type=int, default=3, help="rows of --seq-len corpus tokens")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-4, help="the tower's peak learning rate")
    ap.add_argument("--text-lr", type=float, default=2e-4,
                    help="the text model's and MTP head's peak learning rate")
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--eval-images", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--vision-hidden", type=int, default=96)
    ap.add_argument("--vision-heads", type=int, default=2)
    ap.add_argument("--vision-intermediate", type=int, default=384)
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    torch.set_num_threads(args.threads)
    t_start = time.time()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    # 1. tokenizer, config, model
    tok_dir = args.work / "vision_tokenizer"
    ids, vocab = add_vision_tokens(args.base, tok_dir)
    text = json.loads((args.base / "config.json").read_text())["text_config"]
    text["vocab_size"] = vocab
    config = full_config(text, vision_config(args, text["hidden_size"]), ids)
    model, mtp = build(args.base, config, args.seed)
    model.train()
    mtp.train()
    hf_tok = AutoTokenizer.from_pretrained(str(tok_dir))
    pictures = Pictures(hf_tok, Qwen2VLImageProcessorPil(**PROCESSOR), ids)
    n_vis = sum(p.numel() for p in model.model.visual.parameters())
    print(f"vision tokens {ids}, vocab {vocab}; tower {n_vis / 1e6:.2f}M params", flush=True)

    # 2. the text corpus, tokenized as train.py does
    corpus = args.work / "corpus"
    if not (corpus / "train.jsonl").is_file():
        make_corpus.write(corpus, 0, repeats=2)
    raw = train.encode(Tokenizer.from_file(str(tok_dir / "tokenizer.json")),
                       train.render(hf_tok, make_corpus.read_jsonl(corpus / "train.jsonl")))
    rows, lens = train.pack(raw, args.seq_len + 1, pictures.eot, random.Random(args.seed))
    chats = [d["messages"] for d in make_corpus.read_jsonl(corpus / "train.jsonl")
             if "messages" in d and d["messages"][-1]["role"] == "assistant"
             and sum(m["role"] == "user" for m in d["messages"]) == 1
             and "<think>" not in d["messages"][-1]["content"]]
    print(f"text corpus: {len(rows)} rows of {args.seq_len + 1}", flush=True)

    # 3. the tower alone, then the optimizer of the joint phase: the tower at --lr, the rest at
    # --text-lr
    probes = pretrain_tower(model, pictures, args, random.Random(args.seed + 7))
    tower = list(model.model.visual.parameters()) + list(probes.parameters())
    tower_ids = {id(p) for p in tower}
    rest = [p for p in list(model.parameters()) + list(mtp.parameters())
            if id(p) not in tower_ids]
    rest = list({id(p): p for p in rest}.values())
    groups = []
    for params, lr in ((tower, args.lr), (rest, args.text_lr)):
        groups.append({"params": [p for p in params if p.dim() >= 2], "lr": lr, "peak": lr,
                       "weight_decay": args.weight_decay})
        groups.append({"params": [p for p in params if p.dim() < 2], "lr": lr, "peak": lr,
                       "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    shim = SimpleNamespace(model=model.model.language_model, lm_head=model.lm_head)
    every = list({id(p): p for p in tower + rest}.values())

    # 4. loop
    rng_chat = random.Random(args.seed + 11)
    ch = torch.zeros(())
    t_loop = time.time()
    cursor = 0
    for step in range(args.steps):
        scale = lr_scale(step, args)
        for g in opt.param_groups:
            g["lr"] = g["peak"] * scale
        x, y, pixels, grids, samples = pictures.batch(rng, args.image_batch)
        if cursor + args.text_batch > len(rows):
            cursor = 0
        part = slice(cursor, cursor + args.text_batch)
        cursor += args.text_batch
        img_loss = picture_loss(model, x, y, pixels, grids, ids["image_token_id"])
        probe_loss, _ = probes.loss(model.model.visual(pixels, grid_thw=grids).pooler_output,
                                    grids, samples)
        lm, mt, _ = train.forward_losses(shim, mtp, rows[part], lens[part], stats=False)
        loss = img_loss + args.probe_weight * probe_loss + lm + args.mtp_weight * mt
        if args.chat_batch:
            ch = chat_loss(model, *chat_batch(hf_tok, chats, rng_chat, args.chat_batch))
            loss = loss + ch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(every, 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d} | image {img_loss.item():.3f} probes {probe_loss.item():.3f} "
                  f"chat {ch.item():.3f} text lm {lm.item():.3f} "
                  f"mtp {mt.item():.3f} | lr x{scale:.2f} | "
                  f"{(time.time() - t_loop) / 60:.1f} min", flush=True)

    # 5. save, held-out accuracy
    model.eval()
    mtp.eval()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, args.out / name)
    save(args.out, model, mtp, config, args.base)
    acc = held_out_accuracy(model, pictures, args.eval_images, args.eval_seed)
    demo = answer(model, pictures, demo_image(), DESCRIBE[0])
    print(f"held-out accuracy ({args.eval_images} pictures, seed {args.eval_seed}, fp32): "
          f"{acc:.3f}; demo.png: {demo!r}")
    files = sorted(p for p in args.out.iterdir() if p.is_file())
    print("files: " + ", ".join(f"{p.name} {p.stat().st_size / 1e6:.2f} MB" for p in files))
    print(f"done: {args.steps} steps in {(time.time() - t_loop) / 60:.1f} min "
          f"({(time.time() - t_start) / 60:.1f} min total)", flush=True)


if __name__ == "__main__":
    main()

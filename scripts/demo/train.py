"""Train hybridrt's demo checkpoint (tokenizer + Qwen3.5-architecture model with MTP) from scratch.

The trunk is transformers' ``Qwen3_5ForCausalLM`` built from a small ``Qwen3_5TextConfig``
(Gated DeltaNet + gated full attention in the 3:1 pattern, tied embeddings). The MTP head is
not part of transformers; ``MTPHead`` below implements it as shared/docs/qwen35.md says:

    e = pre_fc_norm_embedding(embed(t[p+1]))          # zero-centred RMSNorm (1 + w)
    h = pre_fc_norm_hidden(hidden[p])                 # trunk output AFTER the final norm
    x = fc(cat([e, h], -1))                           # no bias, embedding first
    x = mtp.layers.0(x, position p)                   # one full-attention Qwen3_5DecoderLayer
    logits = lm_head(mtp.norm(x))                     # tied lm_head, predicts t[p+2]

Loss = CE(trunk, t[p+1]) + mtp_weight * CE(mtp, t[p+2]). The hidden state fed to the MTP head
is NOT detached by default (as in DeepSeek-V3 / Qwen MTP training: the trunk also learns to
carry what the head needs); ``--mtp-detach`` trains the head on a frozen view instead.

The result is written in the published Qwen/Qwen3.5-0.8B layout: ``config.json``
(``qwen3_5`` + ``text_config``), ``model.safetensors`` (``model.language_model.*`` + ``mtp.*``, no
``lm_head``), ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (ChatML
template with ``enable_thinking``).

Full run (about an hour on 2 CPU cores):

    python scripts/demo/train.py --threads 2 --max-minutes 55 --out hybridrt/demo_model
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

# sibling script, importable only once HERE is on sys.path (set just above)
import make_corpus  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
NON_SPECIAL = ("<think>", "</think>")  # atomic added tokens, kept by skip_special_tokens (Qwen3)
EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen3.5's pre-tokenizer split (transformers' Qwen3_5Tokenizer), then byte-level BPE.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3-style ChatML (no tools). Default: non-thinking, as for Qwen3.5-0.8B. With
# enable_thinking=false the generation prompt carries an empty think block; with
# enable_thinking=true it stops at "<|im_start|>assistant\n" and the model opens <think> itself.
# A user or system message's content may be OpenAI-style parts: text parts are rendered as their
# text, image (video) parts as Qwen's <|vision_start|><|image_pad|><|vision_end|> placeholder.
# Unlike Qwen's template, earlier assistant turns keep their (possibly empty) think block: the
# rendering of a conversation is then a prefix of the next turn's, so a chat session can reuse
# its cached KV blocks and GDN state instead of prefilling the whole conversation again.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- else %}{%- for part in content %}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'video' or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content)"
    " + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if not (enable_thinking is defined and enable_thinking) %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


# --- tokenizer ----------------------------------------------------------------------------------

def _doc_strings(docs):
    for d in docs:
        if "text" in d:
            yield d["text"]
        else:
            for m in d["messages"]:
                yield m["role"] + "\n" + m["content"]
                if m.get("reasoning_content"):
                    yield m["reasoning_content"]


def train_tokenizer(docs: list[dict], vocab_size: int):
    """Byte-level BPE with Qwen's pre-tokenizer; special tokens take ids 0..4."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_doc_strings(docs), trainer)
    raw = json.loads(tok.to_str())
    for entry in raw["added_tokens"]:
        if entry["content"] in NON_SPECIAL:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(raw))


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(tok, out: Path, model_max_length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n")


# --- configs ------------------------------------------------------------------------------------

def text_config(args, vocab_size: int, eos_ids: list[int], pad_id: int) -> dict:
    n = args.layers
    moe = {} if not args.experts else {
        "num_experts": args.experts, "num_experts_per_tok": args.experts_per_token,
        "moe_intermediate_size": args.expert_intermediate,
        "shared_expert_intermediate_size": args.shared_intermediate,
        "router_aux_loss_coef": args.router_aux, "output_router_logits": False,
    }
    return {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        **moe,
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": n,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(n)],
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "attn_output_gate": True,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_key_head_dim": args.linear_head_dim,
        "linear_value_head_dim": args.linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": 0.25,
            # interleaved M-RoPE sections over rotary_dim/2 frequencies (T, H, W); for text all
            # three position rows are equal and this is plain 1-D RoPE
            "mrope_section": _mrope_section(int(args.head_dim * 0.25) // 2),
            "mrope_interleaved": True,
        },
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": args.max_position_embeddings,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "mamba_ssm_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "tie_word_embeddings": True,  # also here: Qwen3_5ForCausalLM reads only text_config
        "dtype": "bfloat16",
    }


def _mrope_section(half: int) -> list[int]:
    a = math.ceil(half * 11 / 32)
    b = a
    return [a, b, half - a - b]


def published_config(text: dict) -> dict:
    """The Qwen/Qwen3.5-* layout: ``qwen3_5`` + ``text_config`` (+ a placeholder vision config;
    the demo ships no vision weights). An MoE model: ``qwen3_5_moe``, text only."""
    if "num_experts" in text:
        return {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "model_type": "qwen3_5_moe", "tie_word_embeddings": True,
                "eos_token_id": text["eos_token_id"], "pad_token_id": text["pad_token_id"],
                "text_config": text, "dtype": "bfloat16"}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32,
                          "num_heads": 2, "intermediate_size": 64,
                          "out_hidden_size": text["hidden_size"]},
        "dtype": "bfloat16",
    }


def generation_config(eos_ids: list[int], pad_id: int) -> dict:
    # Qwen3.5 model-card defaults for non-thinking mode
    return {
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.0,
        "max_new_tokens": 256,
    }


def hf_text_config(text: dict):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    cfg = copy.deepcopy(text)
    cfg.pop("model_type", None)
    cfg.pop("dtype", None)
    cfg["tie_word_embeddings"] = True
    hf = (Qwen3_5MoeTextConfig if "num_experts" in text else Qwen3_5TextConfig)(**cfg)
    hf._attn_implementation = "sdpa"
    return hf


# --- model --------------------------------------------------------------------------------------

class MTPHead(nn.Module):
    """Qwen3.5's multi-token-prediction head (names as in the published ``mtp.*`` tensors)."""

    def __init__(self, hf_config):
        super().__init__()
        if getattr(hf_config, "num_experts", 0):  # the MTP layer is an MoE layer too
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
                Qwen3_5MoeDecoderLayer as Qwen3_5DecoderLayer,
            )
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
                Qwen3_5MoeRMSNorm as Qwen3_5RMSNorm,
            )
        else:
            from transformers.models.qwen3_5.modeling_qwen3_5 import (
                Qwen3_5DecoderLayer,
                Qwen3_5RMSNorm,
            )

        H, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        layer_cfg = copy.deepcopy(hf_config)
        layer_cfg.layer_types = ["full_attention"]
        layer_cfg.num_hidden_layers = 1
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_cfg, 0)])
        self.norm = Qwen3_5RMSNorm(H, eps=eps)

    def reset_parameters(self, std: float) -> None:
        done = set()
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                done.add(id(m.weight))
            elif hasattr(m, "weight") and m.weight.dim() == 1:
                nn.init.zeros_(m.weight)  # zero-centred norms
                done.add(id(m.weight))
        for p in self.parameters():  # an MoE layer's experts and router (not Linears)
            if id(p) not in done and p.dim() >= 2:
                nn.init.normal_(p, std=std)

    def forward(self, trunk, next_ids: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """next_ids [B, N] = t[p+1], hidden [B, N, H] = normed trunk output at p, positions [B, N]
        = p -> MTP logits [B, N, V] for t[p+2]."""
        e = self.pre_fc_norm_embedding(trunk.model.embed_tokens(next_ids))
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(torch.cat([e, h], dim=-1))
        cos_sin = trunk.model.rotary_emb(x, positions)
        for layer in self.layers:  # mask None -> causal SDPA
            x = layer(x, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
        return trunk.lm_head(self.norm(x))


def causal_lm_class(text: dict):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    return Qwen3_5MoeForCausalLM if "num_experts" in text else Qwen3_5ForCausalLM


def build_model(text: dict, seed: int):
    torch.manual_seed(seed)
    hf = hf_text_config(text)
    trunk = causal_lm_class(text)(hf)
    assert trunk.lm_head.weight is trunk.model.embed_tokens.weight, "embeddings must be tied"
    mtp = MTPHead(hf)
    mtp.reset_parameters(hf.initializer_range)
    return trunk, mtp


def forward_losses(trunk, mtp, rows: torch.Tensor, lens: torch.Tensor, detach: bool = False,
                   stats: bool = True):
    """rows [B, L+1] token ids, lens [B] = real (non-pad) length of each row.
    -> (lm loss, mtp loss, stats dict). An MoE trunk's load-balancing loss (transformers',
    times ``router_aux_loss_coef``) is ``stats["aux_loss"]``, to be added to the loss."""
    B, L1 = rows.shape
    L = L1 - 1
    moe = getattr(trunk.config, "num_experts", 0)
    out = trunk.model(input_ids=rows[:, :-1], use_cache=False,
                      **({"output_router_logits": True} if moe else {}))
    hidden = out.last_hidden_state  # after the final norm
    idx = torch.arange(L1, device=rows.device)[None]
    labels = rows.masked_fill(idx >= lens[:, None], -100)  # pad positions carry no loss
    logits = trunk.lm_head(hidden)  # [B, L, V]
    V = logits.shape[-1]
    lm_loss = F.cross_entropy(logits.reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)

    pos = torch.arange(L - 1, device=rows.device)[None].expand(B, -1)
    h_in = hidden[:, :-1].detach() if detach else hidden[:, :-1]
    mtp_logits = mtp(trunk, rows[:, 1:L], h_in, pos)  # [B, L-1, V]: index p predicts t[p+2]
    mtp_loss = F.cross_entropy(mtp_logits.reshape(-1, V), labels[:, 2:].reshape(-1),
                               ignore_index=-100)
    st = {"tokens": int((labels[:, 1:] >= 0).sum())}
    if moe:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

        st["aux_loss"] = trunk.config.router_aux_loss_coef * load_balancing_loss_func(
            out.router_logits, moe, trunk.config.num_experts_per_tok)
    if stats:
        with torch.no_grad():
            # teacher-forced acceptance proxy: MTP argmax at p == trunk argmax at p+1 (both t[p+2])
            m2 = labels[:, 2:] >= 0
            m1 = labels[:, 1:] >= 0
            trunk_pred = logits.argmax(-1)
            st["agree"] = ((mtp_logits.argmax(-1) == trunk_pred[:, 1:]) & m2).sum().item() / max(
                int(m2.sum()), 1)
            st["lm_acc"] = ((trunk_pred == rows[:, 1:]) & m1).sum().item() / max(int(m1.sum()), 1)
    return lm_loss, mtp_loss, st


# --- checkpoint I/O -----------------------------------------------------------------------------

def published_state_dict(trunk, mtp, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in trunk.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        assert name.startswith("model."), name
        out["model.language_model." + name[len("model."):]] = t
    for name, t in mtp.state_dict().items():
        out["mtp." + name] = t
    return {k: v.detach().to(dtype).contiguous() for k, v in out.items()}


def save_checkpoint(out: Path, trunk, mtp, text: dict, eos_ids, pad_id, dtype=torch.bfloat16,
                    tokenizer_dir: Path | None = None):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(published_config(text), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(generation_config(eos_ids, pad_id), indent=2) + "\n")
    tmp = out / "model.safetensors.tmp"
    save_file(published_state_dict(trunk, mtp, dtype), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")


def load_checkpoint(path: str | Path, dtype=torch.float32):
    """Demo checkpoint directory -> (tokenizer, trunk Qwen3_5ForCausalLM, MTPHead), eval mode."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    path = Path(path)
    text = json.loads((path / "config.json").read_text())["text_config"]
    hf = hf_text_config(text)
    trunk = causal_lm_class(text)(hf)
    mtp = MTPHead(hf)
    sd = load_file(str(path / "model.safetensors"))
    t_sd = {"model." + k[len("model.language_model."):]: v for k, v in sd.items()
            if k.startswith("model.language_model.")}
    t_sd["lm_head.weight"] = t_sd["model.embed_tokens.weight"]
    m_sd = {k[len("mtp."):]: v for k, v in sd.items() if k.startswith("mtp.")}
    trunk.load_state_dict({k: v.to(dtype) for k, v in t_sd.items()}, strict=True)
    mtp.load_state_dict({k: v.to(dtype) for k, v in m_sd.items()}, strict=True)
    trunk.tie_weights()
    trunk.to(dtype).eval()
    mtp.to(dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return tok, trunk, mtp


# --- data ---------------------------------------------------------------------------------------

def render(hf_tok, docs: list[dict]) -> list[str]:
    texts = []
    for d in docs:
        if "text" in d:
            texts.append(d["text"] + EOT)
        else:
            texts.append(hf_tok.apply_chat_template(d["messages"], tokenize=False) + EOT)
    return texts


def encode(raw_tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in raw_tok.encode_batch(texts, add_special_tokens=False)]


def pack(docs: list[list[int]], row_len: int, pad_id: int, rng: random.Random,
         open_bins: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """First-fit packing of whole documents into rows of ``row_len`` tokens (documents longer
    than a row are cut into row-sized pieces). -> (rows [R, row_len], real lengths [R])."""
    pieces = []
    for d in docs:
        for i in range(0, len(d), row_len):
            pieces.append(d[i:i + row_len])
    order = list(range(len(pieces)))
    rng.shuffle(order)
    bins: list[list[int]] = []
    done: list[list[int]] = []
    for i in order:
        p = pieces[i]
        for b in bins:
            if len(b) + len(p) <= row_len:
                b.extend(p)
                break
        else:
            if len(bins) >= open_bins:
                bins.sort(key=len)
                done.append(bins.pop())  # close the fullest
            bins.append(list(p))
    done.extend(bins)
    rng.shuffle(done)
    rows = torch.full((len(done), row_len), pad_id, dtype=torch.long)
    lens = torch.zeros(len(done), dtype=torch.long)
    for r, b in enumerate(done):
        rows[r, :len(b)] = torch.tensor(b)
        lens[r] = len(b)
    return rows, lens


# --- training -----------------------------------------------------------------------------------

def lr_at(progress: float, step: int, args) -> float:
    """Linear warmup over the first steps, times a cosine decay over the (time) budget."""
    warm = min(1.0, (step + 1) / max(args.warmup_steps, 1))
    p = min(max(progress, 0.0), 1.0)
    cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
    return args.lr * warm * cos


@torch.no_grad()
def evaluate_loss(trunk, mtp, rows, lens, batch_size: int) -> dict:
    trunk.eval()
    mtp.eval()
    tot = {"lm": 0.0, "mtp": 0.0, "agree": 0.0, "lm_acc": 0.0, "n": 0}
    for i in range(0, len(rows), batch_size):
        lm, mt, st = forward_losses(trunk, mtp, rows[i:i + batch_size], lens[i:i + batch_size])
        n = st["tokens"]
        tot["lm"] += lm.item() * n
        tot["mtp"] += mt.item() * n
        tot["agree"] += st["agree"] * n
        tot["lm_acc"] += st["lm_acc"] * n
        tot["n"] += n
    trunk.train()
    mtp.train()
    n = max(tot.pop("n"), 1)
    return {k: v / n for k, v in tot.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the hybridrt demo checkpoint from scratch.")
    ap.add_argument("--out", type=Path, default=REPO / "hybridrt" / "demo_model")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "demo",
                    help="corpus, tokenized data and logs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=55.0,
                    help="wall-clock budget of the training loop; the LR schedule follows it")
    ap.add_argument("--max-steps", type=int, default=0, help="optional step cap (0: none)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--mtp-detach", action="store_true")
    ap.add_argument("--eval-minutes", type=float, default=5.0)
    ap.add_argument("--log-every", type=int, default=10)
    # sizes
    ap.add_argument("--vocab-size", type=int, default=6144)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--linear-key-heads", type=int, default=4)
    ap.add_argument("--linear-value-heads", type=int, default=4)
    ap.add_argument("--linear-head-dim", type=int, default=64)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--max-position-embeddings", type=int, default=4096)
    # a mixture of experts in place of each MLP (0: the dense demo model)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--experts-per-token", type=int, default=2)
    ap.add_argument("--expert-intermediate", type=int, default=128)
    ap.add_argument("--shared-intermediate", type=int, default=256)
    ap.add_argument("--router-aux", type=float, default=0.001)
    # corpus
    ap.add_argument("--corpus-repeats", type=int, default=2)
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    t_start = time.time()
    rng = random.Random(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)

    # 1. corpus
    corpus = args.work / "corpus"
    meta_path = corpus / "meta.json"
    want = {"seed": args.seed, "repeats": args.corpus_repeats}
    if not meta_path.is_file() or any(json.loads(meta_path.read_text()).get(k) != v
                                      for k, v in want.items()):
        make_corpus.write(corpus, args.seed, repeats=args.corpus_repeats)
    meta = json.loads(meta_path.read_text())
    train_docs = make_corpus.read_jsonl(corpus / "train.jsonl")
    test_docs = make_corpus.read_jsonl(corpus / "test.jsonl")
    print(f"corpus: {meta['train_docs']} train / {meta['test_docs']} test docs, "
          f"{meta['train_chars'] / 1e6:.2f}M chars, python {meta['python']}", flush=True)

    # 2. tokenizer
    t0 = time.time()
    raw_tok = train_tokenizer(train_docs, args.vocab_size)
    tok_dir = args.work / "tokenizer"  # copied into --out with every saved checkpoint
    write_tokenizer(raw_tok, tok_dir, args.max_position_embeddings)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(tok_dir))
    vocab = raw_tok.get_vocab_size()
    eot, im_end = raw_tok.token_to_id(EOT), raw_tok.token_to_id(IM_END)
    eos_ids, pad_id = [eot, im_end], eot
    print(f"tokenizer: vocab {vocab}, eos {eos_ids}, {time.time() - t0:.1f}s", flush=True)

    # 3. data
    t0 = time.time()
    train_ids = encode(raw_tok, render(hf_tok, train_docs))
    test_ids = encode(raw_tok, render(hf_tok, test_docs))
    n_train = sum(map(len, train_ids))
    val_rows, val_lens = pack(test_ids, args.seq_len + 1, pad_id, random.Random(1))
    print(f"data: {n_train} train tokens, {sum(map(len, test_ids))} test tokens, "
          f"{len(val_rows)} val rows, {time.time() - t0:.1f}s", flush=True)

    # 4. model
    text = text_config(args, vocab, eos_ids, pad_id)
    trunk, mtp = build_model(text, args.seed)
    trunk.train()
    mtp.train()
    n_trunk = sum(p.numel() for p in trunk.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"model: trunk {n_trunk / 1e6:.2f}M params (embedding {vocab * args.hidden / 1e6:.2f}M), "
          f"mtp {n_mtp / 1e6:.2f}M; layers {text['layer_types']}", flush=True)
    params = [p for p in list(trunk.parameters()) + list(mtp.parameters())]
    seen, decay, no_decay = set(), [], []
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    save_dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32

    # 5. loop
    budget = args.max_minutes * 60
    history, evals = [], []
    best = float("inf")
    step, epoch, tokens_seen = 0, 0, 0
    t_loop = time.time()
    last_eval = t_loop
    rows, lens, cursor = None, None, 0
    ema = None
    print(f"training: batch {args.batch_size} x {args.seq_len}, lr {args.lr}, "
          f"budget {args.max_minutes} min, mtp weight {args.mtp_weight}"
          f"{' (detached)' if args.mtp_detach else ''}", flush=True)

    def do_eval(final=False):
        nonlocal best
        ev = evaluate_loss(trunk, mtp, val_rows, val_lens, args.batch_size)
        ev.update(step=step, minutes=(time.time() - t_loop) / 60)
        score = ev["lm"] + args.mtp_weight * ev["mtp"]
        saved = score < best
        if saved:
            best = score
            save_checkpoint(args.out, trunk, mtp, text, eos_ids, pad_id, save_dtype, tok_dir)
        ev["saved"] = saved
        evals.append(ev)
        print(f"  eval step {step}: val lm {ev['lm']:.3f} (ppl {math.exp(ev['lm']):.1f}, "
              f"acc {ev['lm_acc']:.3f}) mtp {ev['mtp']:.3f} tf-accept {ev['agree']:.3f}"
              f"{'  [saved]' if saved else ''}{'  (final)' if final else ''}", flush=True)

    while True:
        elapsed = time.time() - t_loop
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        if rows is None or cursor + args.batch_size > len(rows):
            rows, lens = pack(train_ids, args.seq_len + 1, pad_id, rng)
            cursor = 0
            epoch += 1
        b_rows = rows[cursor:cursor + args.batch_size]
        b_lens = lens[cursor:cursor + args.batch_size]
        cursor += args.batch_size
        progress = elapsed / budget
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        lr = lr_at(progress, step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        ts = time.time()
        lm, mt, st = forward_losses(trunk, mtp, b_rows, b_lens, detach=args.mtp_detach)
        loss = lm + args.mtp_weight * mt + st.get("aux_loss", 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(list(seen_params(trunk, mtp)), 1.0)
        opt.step()
        dt = time.time() - ts
        step += 1
        tokens_seen += st["tokens"]
        rec = {"step": step, "epoch": epoch, "lm": lm.item(), "mtp": mt.item(),
               "agree": st["agree"], "lr": lr, "gnorm": float(gnorm), "sec": dt,
               "minutes": (time.time() - t_loop) / 60}
        history.append(rec)
        ema = rec["lm"] if ema is None else 0.9 * ema + 0.1 * rec["lm"]
        if step % args.log_every == 0 or step == 1:
            print(f"step {step:5d} ep {epoch} | lm {rec['lm']:.3f} (ema {ema:.3f}) "
                  f"mtp {rec['mtp']:.3f} "
                  f"agree {rec['agree']:.2f} | lr {lr:.2e} gnorm {rec['gnorm']:.2f} | "
                  f"{dt:.2f}s/step {st['tokens'] / dt:.0f} tok/s | {rec['minutes']:.1f} min",
                  flush=True)
        if time.time() - last_eval >= args.eval_minutes * 60:
            do_eval()
            last_eval = time.time()
    do_eval(final=True)

    # 6. summary
    total = time.time() - t_start
    secs = [h["sec"] for h in history[5:]] or [h["sec"] for h in history]
    summary = {
        "steps": step, "epochs": epoch, "train_tokens_seen": tokens_seen,
        "corpus_train_tokens": n_train, "sec_per_step": sum(secs) / max(len(secs), 1),
        "total_minutes": total / 60, "best_val_score": best,
        "args": {k: str(v) for k, v in vars(args).items()},
        "params": {"trunk": n_trunk, "mtp": n_mtp},
    }
    (args.work / "train_log.json").write_text(json.dumps(
        {"summary": summary, "evals": evals, "history": history}, indent=1))
    print("\nloss curve (train lm / mtp, mean over windows):")
    w = max(1, len(history) // 20)
    for i in range(0, len(history), w):
        chunk = history[i:i + w]
        lm_m = sum(h["lm"] for h in chunk) / len(chunk)
        mt_m = sum(h["mtp"] for h in chunk) / len(chunk)
        print(f"  steps {chunk[0]['step']:5d}-{chunk[-1]['step']:5d}: "
              f"lm {lm_m:.3f}  mtp {mt_m:.3f}  "
              f"{'#' * int(max(0.0, lm_m) * 6)}")
    print("val curve:")
    for ev in evals:
        print(f"  step {ev['step']:5d} ({ev['minutes']:.1f} min): "
              f"lm {ev['lm']:.3f} mtp {ev['mtp']:.3f} "
              f"tf-accept {ev['agree']:.3f}{' *' if ev['saved'] else ''}")
    files = sorted(p for p in args.out.iterdir() if p.is_file())
    print("files: " + ", ".join(f"{p.name} {p.stat().st_size / 1e6:.2f} MB" for p in files))
    print(f"done: {step} steps, {summary['sec_per_step']:.2f} s/step, {total / 60:.1f} min total",
          flush=True)


def seen_params(trunk, mtp):
    seen = set()
    for p in list(trunk.parameters()) + list(mtp.parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            yield p


if __name__ == "__main__":
    main()

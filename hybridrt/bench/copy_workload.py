"""A copy-heavy workload for ``hybridrt bench spec --workload copy``: outputs that repeat
spans of their prompts (an agent rewriting a file, an answer quoting its sources), where
prompt-lookup drafts pay.

With a chat template each prompt hands the model a slice of a Python source file (default:
this package's ``sampler.py``) and asks for it back with one name changed; a model that
follows copies the slice, and the bench reports the acceptance it measured. Without one the
prompts are random token ids, a span three times and half again: the lookup finds the span,
whether the output continues it is the model's (random weights rarely do)."""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_SOURCE = Path(__file__).resolve().parents[1] / "sampler.py"
ASK = ("Here is part of a Python file:\n\n```python\n{code}\n```\n\nRewrite it exactly as it "
       "is, with every `self` renamed to `this`. Reply with the code only.")


def copy_prompts(llm, n: int = 8, lines: int = 24, source: str | Path | None = None,
                 span: int = 48, seed: int = 0) -> list:
    """``n`` copy prompts: chat-formatted slices of ``lines`` lines of ``source`` when the model
    has a chat template, else token-id prompts of a ``span``-token span repeated."""
    tok = llm.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        text = Path(source or DEFAULT_SOURCE).read_text().splitlines()
        step = max(1, (len(text) - lines) // max(1, n))
        slices = ["\n".join(text[i * step:i * step + lines]) for i in range(n)]
        return [llm.apply_chat_template([{"role": "user", "content": ASK.format(code=c)}])
                for c in slices]
    g = torch.Generator().manual_seed(seed)
    vocab = llm.config.vocab_size
    out = []
    for _ in range(n):
        s = torch.randint(min(3, vocab - 1), vocab, (span,), generator=g).tolist()
        out.append(s * 3 + s[:span // 2])
    return out

"""Per-type error of a loaded GGUF file: every weight as hybridrt holds it after loading
(``load_gguf_model``: dequantized from its packed format, or the float parameter) against
``gguf``'s numpy dequantization of the file's tensor (llama.cpp's reference arithmetic), with
the converter's transforms undone on both (``names.restore``).

    hybridrt bench gguf-error FILE.gguf [FILE.gguf ...] [--json out.json]

Per GGUF type: tensors, the max and mean relative RMS error (|ours - gguf| / |gguf|, per
tensor) and how many are bit-exact. One tensor at a time is dequantized (the 0.8B
embedding is 1 GB in fp32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _ours(net, name: str) -> torch.Tensor:
    """Our parameter ``name`` as fp32, dequantized where it is packed."""
    module_name, _, leaf = name.rpartition(".")
    module = net.get_submodule(module_name)
    qw = getattr(module, "qweight", None) if leaf == "weight" else None
    if qw is not None:
        return qw.dequantize()
    return getattr(module, leaf).detach().float()


def measure(path: str | Path) -> dict:
    """-> {"file", "tensors": [{name, gguf, type, format, error, exact}], "types": {type:
    {tensors, max_error, mean_error, exact}}} for every weight of GGUF file ``path``."""
    from gguf.quants import dequantize

    from hybridrt.gguf import names, tensors
    from hybridrt.gguf.loader import load_gguf_model
    from hybridrt.gguf.reader import GGUFFile

    net, config, _ = load_gguf_model(path, "float32", with_mtp=True)
    f = GGUFFile(path)
    srcs = names.sources(config, config.mtp_num_hidden_layers > 0)
    rows = []
    for name, src in srcs.items():
        t = f.tensors[src.name]
        kind = tensors.type_name(t)
        ours = _ours(net, name)
        raw = torch.from_numpy(dequantize(t.data, t.tensor_type))
        ref = names.restore(raw.view(names.stored_shape(tuple(ours.shape), src)), src)
        ref = ref.float().view(ours.shape)
        norm = ref.norm().item()
        diff = (ours - ref).norm().item()
        rows.append({"name": name, "gguf": src.name, "type": kind,
                     "format": tensors.QUANT_FORMATS.get(
                         kind, str(ours.dtype).removeprefix("torch.")),
                     "error": diff / norm if norm else diff,
                     "exact": bool(torch.equal(ours, ref))})
        del ours, raw, ref
    types: dict[str, dict] = {}
    for r in rows:
        types.setdefault(r["type"], []).append(r)
    summary = {k: {"tensors": len(v), "format": v[0]["format"],
                   "max_error": max(r["error"] for r in v),
                   "mean_error": sum(r["error"] for r in v) / len(v),
                   "exact": sum(r["exact"] for r in v)} for k, v in sorted(types.items())}
    return {"file": str(path), "tensors": rows, "types": summary}


def format_report(r: dict) -> str:
    lines = [f"{r['file']}: every weight as loaded against gguf's dequantization "
             f"(relative RMS error per tensor)",
             f"  {'type':8} {'as':7} {'tensors':>7} {'max error':>10} {'mean error':>10}  "
             f"bit-exact"]
    for kind, s in r["types"].items():
        exact = ("all" if s["exact"] == s["tensors"] else
                 f"{s['exact']} of {s['tensors']}" if s["exact"] else "no")
        lines.append(f"  {kind:8} {s['format']:7} {s['tensors']:7d} {s['max_error']:10.2e} "
                     f"{s['mean_error']:10.2e}  {exact}")
    return "\n".join(lines)


def run_gguf_error_bench(paths: list[str | Path], json_path: str | Path | None = None
                         ) -> list[dict]:
    reports = []
    for path in paths:
        report = measure(path)
        print(format_report(report), flush=True)
        reports.append(report)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(reports, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return reports

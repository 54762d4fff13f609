"""The printed report of ``hybridrt bench throughput``: one row per measurement under a human
label, hybridrt's figure, each other engine's and one ratio (hybridrt over that engine) per
engine; one batching ratio; one read-bandwidth figure, the one the batch-1 ceiling is taken
against. Every raw figure stays in the JSON report under its key."""

from __future__ import annotations

from pathlib import Path

RATIO = "ratio"  # the column after each other engine's figure: hybridrt's over it


def row_label(key: str, report: dict) -> str:
    """The human label of a report key (``decode_b32_tok_s`` -> "decode, 32 concurrent")."""
    if key == "prefill_tok_s":
        return f"prefill, {report.get('workload', {}).get('prefill_len', '?')}-token prompt"
    if key == "decode_b1_tok_s":
        return "decode, batch 1"
    kind, rest = key.split("_b", 1)
    c = rest.split("_")[0]
    if kind == "aggregate":
        return f"output, {c} concurrent (prefill incl.)"
    return f"decode, {c} concurrent"


def _loads(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _columns(report: dict) -> tuple[list[tuple[str, str]], dict]:
    """The other engines as (key in ``report``, column name); the report with every further
    GGUF's results at the top level under its column key."""
    others = [(name, label) for name, label in (("llamacpp", "llama.cpp"),
                                                ("transformers", "transformers"))
              if name in report]
    more = report.get("llamacpp_others", {})
    if more:  # several GGUFs: each column named by its file
        others = [(name, Path(report["llamacpp_run"]["gguf"]).name.removesuffix(".gguf")
                   if name == "llamacpp" else label) for name, label in others]
        report = {**report, **{f"llamacpp {k}": v["results"] for k, v in more.items()}}
        others[1:1] = [(f"llamacpp {k}", k) for k in more]
    return others, report


def _peak_rss(report: dict) -> dict[str, float]:
    """Peak RSS in GiB by column key (hybridrt, and each llama.cpp run)."""
    rss = {"hybridrt": report.get("peak_rss_gib")}
    if "llamacpp_run" in report:
        rss["llamacpp"] = report["llamacpp_run"]["peak_rss_gib"]
    for k, v in report.get("llamacpp_others", {}).items():
        rss[f"llamacpp {k}"] = v["run"]["peak_rss_gib"]
    return rss


def _row(label: str, ours: float | None, others: list, theirs: dict) -> str:
    # every column after a space of its own: a figure wider than its column (a stand-in's
    # ratio, say) never runs into the next
    line = f"{label:<38}" + (f" {ours:>9.2f}" if ours else f" {'-':>9}")
    for name, _ in others:
        t = theirs.get(name)
        line += (f" {t:>13.2f} {ours / t:>7.2f}" if t and ours else
                 f" {t:>13.2f} {'-':>7}" if t else f" {'-':>13} {'-':>7}")
    return line


def format_table(report: dict) -> str:
    """The report as text (see the module docstring)."""
    ours = report["hybridrt"]
    others, report = _columns(report)
    rows = []
    cpu = report.get("cpu")
    if cpu:
        load = report.get("load_average", {})
        rows.append(f"CPU: {cpu['model']} ({' '.join(cpu['flags']) or 'no listed flags'}); "
                    f"{report['threads']} threads; load average "
                    + "; ".join(f"{k} {_loads(v)}" for k, v in load.items()))
    if report.get("quantization"):
        rows.append(f"hybridrt weights: {report['quantization']}")
    if report.get("batch_invariant"):
        rows.append("hybridrt mode: batch-invariant")
    rows.append(f"{'metric':<38} {'hybridrt':>9}"
                + "".join(f" {label:>13} {RATIO:>7}" for _, label in others))
    rows.append(f"{'(tok/s; ratio = hybridrt / that engine)':<38}")
    for k, v in ours.items():
        rows.append(_row(row_label(k, report), v, others,
                         {name: report[name].get(k) for name, _ in others}))
    rss = _peak_rss(report)
    if rss["hybridrt"] is not None:
        rows.append(_row("peak RSS (GiB)", rss["hybridrt"], others, rss))
    batching = _batching(report)
    if batching:
        rows.append(batching)
    if "llamacpp" in report:
        rows.append("llama.cpp: llama-bench (prefill; batch 1, without a prompt) and "
                    "llama-batched-bench (decode at each concurrency), on its own random "
                    "prompt tokens; rounds: " + ", ".join(r["engine"] for r in report["rounds"])
                    + ", medians per engine")
    ceil = report.get("ceilings")
    if ceil:
        s = ceil["stream_read"]
        rows.append(f"read bandwidth {s['gb_s']:.1f} GB/s, "
                    f"{ceil['weight_bytes_per_token'] / 1e9:.3f} GB of weights a token -> "
                    f"batch-1 ceiling "
                    f"{ceil['batch1_decode_tok_s']:.2f} tok/s; decode, batch 1: "
                    + ", ".join(f"{e.replace('llamacpp', 'llama.cpp', 1)} {f:.0%}"
                                for e, f in ceil["fraction"].items()) + " of it")
    return "\n".join(rows)


def _batching(report: dict) -> str | None:
    """One batching ratio: decode at the largest concurrency over batch 1, from the alternated
    runs where they ran, else from the rows above."""
    for k, v in report.items():
        if k.startswith("interleaved_decode_b"):
            c = k.split("_b")[1].split("_")[0]
            return f"batching: decode, {c} concurrent / batch 1 = {v:.2f}x (alternated runs)"
    for k, v in report.items():
        if k.startswith("ratio_decode_b"):
            c = k.split("_b")[1].split("_")[0]
            return f"batching: decode, {c} concurrent / batch 1 = {v:.2f}x"
    return None

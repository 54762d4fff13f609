"""``hybridrt bench spec``'s report as a table (hybridrt.bench.spec)."""

from __future__ import annotations


def format_table(report: dict) -> str:
    """The report as a table; simulated-acceptance rows say so in their alpha column and in a
    heading line."""
    def num(v, fmt, none="-"):
        return none if v is None else format(v, fmt)

    head = (f"{'batch':>5} {'k':>4} {'head':>6} {'alpha':>9} {'tok/s':>9} {'speedup':>8} "
            f"{'accept len':>12} {'ref':>4} {'draft/step':>10} {'verify/step':>11} "
            f"{'break-even':>10} {'same as k0':>10}  per-position acceptance")
    lines = []
    if report.get("clock") == "cpu":
        lines.append("CPU TIME: tok/s and step costs in this process's CPU seconds, not wall "
                     "seconds")
    if report.get("acceptance") == "simulated":
        lines.append("SIMULATED ACCEPTANCE: the MTP drafts (at its real cost), then each draft is "
                     "replaced by the target's greedy token with probability alpha, a wrong one "
                     "otherwise")
    if report.get("context"):
        lines.append(f"every prompt behind a shared context of {report['context']} tokens "
                     "(cached)")
    if report.get("draft_vocab_source"):
        lines.append(f"reduced draft heads take {report['draft_vocab_source']}")
    lines += [head, "-" * len(head)]
    for r in report["rows"]:
        al = num(r["mean_acceptance_length"], ".2f")
        if r.get("expected_acceptance_length") is not None:
            al += f" ({r['expected_acceptance_length']:.2f})"
        alpha = "-" if r["k"] == 0 else (
            "real" if r.get("simulated_alpha") is None else f"{r['simulated_alpha']:.2f} sim")
        dv = r.get("draft_vocab")
        dv = "-" if dv is None else ("full" if dv == 0 else str(dv))
        same = {True: "yes", False: "NO", None: "-"}[r["identical_to_k0"]]
        pp = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
        k = ("<=" if r.get("adaptive") else "") + str(r["k"])
        lines.append(
            f"{r['batch_size']:>5} {k:>4} {dv:>6} {alpha:>9} {r['tok_s']:>9.1f} "
            f"{num(r['speedup'], '.2f') + ('x' if r['speedup'] is not None else ''):>8} "
            f"{al:>12} {num(r.get('reference_coverage'), '.2f'):>4} "
            f"{num(r.get('draft_pass_over_step'), '.3f'):>10} "
            f"{num(r.get('verify_over_step'), '.3f'):>11} "
            f"{num(r.get('break_even_alpha'), '.2f', '-' if r['k'] == 0 else 'never'):>10} "
            f"{same:>10}  {pp}")
    cost = report.get("verify_cost") or []
    for b in sorted({c["batch_size"] for c in cost}):
        mine = [c for c in cost if c["batch_size"] == b]
        lines.append(f"verify step, batch {b}, by rows per sequence (decode step: 1 row, "
                     f"{mine[0]['decode_ms']:.1f} ms): " + ", ".join(
                         f"{c['rows_per_sequence']} rows {c['verify_over_step']:.2f} "
                         f"({c['verify_ms']:.1f} ms)" for c in mine))
    if report.get("speculative_method", "mtp") != "mtp" or report.get("speculative_adaptive"):
        lines.append(f"drafts from {report['speculative_method']}"
                     + ("; k <=N rows: k adaptive up to N, the others fixed"
                        if report["speculative_adaptive"] else ""))
        for r in report["rows"]:
            if r["k"] and r.get("drafts_by_source"):
                src = ", ".join(f"{s} {n} drafts, acceptance "
                                f"{num(r['acceptance_by_source'][s], '.2f')}"
                                for s, n in r["drafts_by_source"].items())
                k = ("<=" if r.get("adaptive") else "") + str(r["k"])
                lines.append(f"  batch {r['batch_size']} k {k}: {src}; mean k chosen "
                             f"{num(r['mean_k_chosen'], '.2f')}")
    if any(r.get("draft_pass_over_step") is not None for r in report["rows"]):
        lines.append("accept len: measured (expected for simulated alpha); ref: drafts that had a "
                     "reference token; draft/step: one MTP draft pass, verify/step: one verify "
                     "step, each over a k=0 decode step; break-even: the alpha at which k drafts "
                     "pay for their cost")
    return "\n".join(lines)

"""/metrics: the Prometheus text of one engine loop's counters and gauges
(hybridrt.server.engine_loop), or of several engines' (``metrics_lines``, the Ray Serve
ingress's replicas), and ``family`` for a metric of the ingress's own."""

from __future__ import annotations

_METRICS = [  # name, type, help, how to read it from (counters, gauges)
    ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
     lambda c, g: c["prompt_tokens"]),
    ("generation_tokens_total", "counter", "Generated tokens of finished requests.",
     lambda c, g: c["generation_tokens"]),
    ("prefill_tokens_total", "counter", "Prompt tokens computed (prefilled).",
     lambda c, g: g["prefilled_tokens"]),
    ("prefix_reused_tokens_total", "counter",
     "Prompt tokens of finished requests taken from the prefix cache.",
     lambda c, g: c["prefix_reused_tokens"]),
    ("prefix_cache_queries_total", "counter", "Requests admitted with a prefix-cache look-up.",
     lambda c, g: g["prefix_queries"]),
    ("prefix_cache_query_tokens_total", "counter", "Tokens of the looked-up requests.",
     lambda c, g: g["prefix_query_tokens"]),
    ("prefix_cache_hits_total", "counter", "Admissions that resumed from a cached prefix.",
     lambda c, g: g["prefix_cache_hits"]),
    ("prefix_cache_hit_tokens_total", "counter", "Tokens taken from the prefix cache.",
     lambda c, g: g["prefix_hit_tokens"]),
    ("prefix_cache_checkpoints_saved_total", "counter", "GDN state checkpoints saved.",
     lambda c, g: g["checkpoints_saved"]),
    ("prefix_cache_checkpoint_evictions_total", "counter", "GDN state checkpoints evicted.",
     lambda c, g: g["checkpoint_evictions"]),
    ("prefix_cache_block_evictions_total", "counter", "Cached KV blocks evicted.",
     lambda c, g: g["block_evictions"]),
    ("prefix_cache_branch_points_total", "counter", "Checkpoint positions found where "
     "queued prompts part, or where the cached blocks a prompt matches end.",
     lambda c, g: g["branch_points"]),
    ("prefix_cache_disk_hits_total", "counter", "Admissions that resumed from a checkpoint "
     "restored from the disk tier.", lambda c, g: g["disk_hits"]),
    ("prefix_cache_disk_hit_tokens_total", "counter", "Tokens taken from checkpoints restored "
     "from the disk tier (included in prefix_cache_hit_tokens_total).",
     lambda c, g: g["disk_hit_tokens"]),
    ("prefix_cache_disk_spills_total", "counter", "Blocks and checkpoints written to the disk "
     "tier (evicted, or a request's end).",
     lambda c, g: g["disk_block_writes"] + g["disk_checkpoint_writes"]),
    ("prefix_cache_disk_restores_total", "counter", "Blocks and checkpoints read back from the "
     "disk tier.", lambda c, g: g["disk_block_restores"] + g["disk_checkpoint_restores"]),
    ("prefix_cache_disk_evictions_total", "counter", "Disk tier files deleted for room.",
     lambda c, g: g["disk_evictions"]),
    ("prefix_cache_disk_bad_files_total", "counter", "Disk tier files skipped: truncated, "
     "failing their checksum, or unreadable.", lambda c, g: g["disk_bad_files"]),
    ("preemptions_total", "counter", "Running requests preempted for room.",
     lambda c, g: g["preemptions"]),
    ("engine_errors_total", "counter", "Engine steps that raised.",
     lambda c, g: c["engine_errors"]),
    ("spec_draft_tokens_total", "counter", "Speculative draft tokens verified.",
     lambda c, g: g["spec_draft_tokens"]),
    ("spec_accepted_tokens_total", "counter", "Speculative draft tokens accepted.",
     lambda c, g: g["spec_accepted_tokens"]),
    *[(f"spec_{src}_{what}_tokens_total", "counter",
       f"Speculative draft tokens from {text} {what}.",
       lambda c, g, key=f"spec_{src}_{what}_tokens": g[key])
      for src, text in (("ngram", "prompt lookup"), ("mtp", "the MTP layer"))
      for what in ("draft", "accepted")],
    ("spec_k_chosen_total", "counter", "The drafts asked for, summed over drafting decisions "
     "(over spec_drafting_decisions_total: the mean k).", lambda c, g: g["spec_k_chosen"]),
    ("spec_drafting_decisions_total", "counter", "Drafting decisions (a request's k chosen "
     "after a step, 0 included).", lambda c, g: g["spec_drafting_decisions"]),
    ("requests_running", "gauge", "Requests running.", lambda c, g: g["running"]),
    ("requests_waiting", "gauge", "Requests waiting.", lambda c, g: g["waiting"]),
    ("cache_blocks_total", "gauge", "KV blocks in the cache.", lambda c, g: g["blocks_total"]),
    ("cache_blocks_used", "gauge", "KV blocks held by requests.",
     lambda c, g: g["blocks_used"]),
    ("cache_blocks_cached", "gauge", "KV blocks indexed by the prefix cache.",
     lambda c, g: g["blocks_cached"]),
    ("cache_usage", "gauge", "Fraction of KV blocks in use.",
     lambda c, g: g["blocks_used"] / max(1, g["blocks_total"])),
    ("prefix_cache_checkpoints", "gauge", "GDN state checkpoints held.",
     lambda c, g: g["checkpoints"]),
    ("prefix_cache_checkpoint_bytes", "gauge", "Bytes of the checkpoints held.",
     lambda c, g: g["checkpoint_bytes"]),
    ("prefix_cache_disk_checkpoints", "gauge", "GDN state checkpoints in the disk tier.",
     lambda c, g: g["disk_checkpoints"]),
    ("prefix_cache_disk_blocks", "gauge", "KV blocks in the disk tier.",
     lambda c, g: g["disk_blocks"]),
    ("prefix_cache_disk_bytes", "gauge", "Bytes of the disk tier's files.",
     lambda c, g: g["disk_bytes"]),
]


def metrics_text(loop) -> str:
    """Prometheus text exposition of an ``EngineLoop``'s counters and gauges."""
    return "\n".join(metrics_lines([("", loop.counters, loop.gauges)])) + "\n"


def metrics_lines(sources: list[tuple[str, dict, dict]]) -> list[str]:
    """The metrics of several engines, each ``(labels, counters, gauges)`` (labels: '' or
    'replica="r1"'), one family at a time as the text format wants."""
    lines = ["# HELP hybridrt_requests_total Finished requests, by finish reason.",
             "# TYPE hybridrt_requests_total counter"]
    for labels, c, _ in sources:
        for reason, n in sorted(dict(c["requests"]).items()):
            both = ",".join(x for x in (labels, f'finish_reason="{reason}"') if x)
            lines.append(f"hybridrt_requests_total{{{both}}} {n}")
    for name, kind, text, read in _METRICS:
        lines += [f"# HELP hybridrt_{name} {text}", f"# TYPE hybridrt_{name} {kind}"]
        lines += [f"hybridrt_{name}{{{labels}}} {read(c, g)}" if labels else
                  f"hybridrt_{name} {read(c, g)}" for labels, c, g in sources]
    return lines


def family(name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric's lines: its help and type, then ``(labels, value)`` samples."""
    lines = [f"# HELP hybridrt_{name} {text}", f"# TYPE hybridrt_{name} {kind}"]
    return lines + [f"hybridrt_{name}{{{labels}}} {v}" if labels else f"hybridrt_{name} {v}"
                    for labels, v in samples]

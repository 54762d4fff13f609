"""A trace as text: per step, per request, one line for each of the five variables.

``header_lines(header)`` says what every step shares (which layers are attention and which
GDN); ``step_lines(record, requests)`` one step (only the ``requests`` given, None: all);
``seq_lines(seq, step)`` one request's part of it (the HTML page shows these too).
"""

from __future__ import annotations

from collections.abc import Collection

MAX_IDS = 12  # token ids shown in full; longer lists are cut in the middle


def ids(xs: list[int]) -> str:
    if len(xs) <= MAX_IDS:
        return "[" + " ".join(map(str, xs)) + "]"
    h = MAX_IDS // 2
    return "[" + " ".join(map(str, xs[:h])) + " ... " + " ".join(map(str, xs[-h:])) + \
        f"] ({len(xs)})"


def span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}..{b}"


def _layers(kinds: list[str], want: str) -> str:
    return ",".join(str(i) for i, k in enumerate(kinds) if k == want) or "none"


def header_lines(header: dict) -> list[str]:
    layers = header["layers"]
    rope = header["rope"]
    mtp = f" + {header['mtp_layers']} MTP (drafts)" if header.get("mtp_layers") else ""
    return [
        f"layers: attention {_layers(layers, 'attention')} (paged KV, causal); GDN "
        f"{_layers(layers, 'gdn')} (state slots){mtp}",
        f"hidden {header['hidden_size']}, vocab {header['vocab_size']}; KV blocks of "
        f"{header['block_size']} tokens ({header['num_blocks']}), {header['num_state_slots']} "
        f"state slots; RoPE theta {rope['theta']:g} on {rope['rotary_dim']} of "
        f"{rope['head_dim']} dims; prefix caching {'on' if header['prefix_caching'] else 'off'}"
        f"; {header['max_num_batched_tokens']} tokens a step",
    ]


def step_lines(rec: dict, requests: Collection[str] | None = None,
               times: bool = True) -> list[str]:
    """A step's lines (``times``: with its phases' durations)."""
    cu = rec["cu_seqlens"]
    packed = " | ".join(f"{a}:{b}" for a, b in zip(cu, cu[1:]))
    out = [f"step {rec['step']} · {rec['kind']}{' (chained)' if rec['chained'] else ''} · "
           f"{rec['num_tokens']} tokens packed as [{packed}]"]
    if times:
        out[0] += " · " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rec["phase_s"].items()
                                    if v)
    if rec["preempted"]:
        out.append(f"  preempted: {', '.join(rec['preempted'])} (recomputed later)")
    for seq in rec["seqs"]:
        if requests is None or seq["request"] in requests:
            out += ["  " + line for line in seq_lines(seq, rec)]
    return out


def seq_lines(seq: dict, rec: dict) -> list[str]:
    h, pos, att, cache, dec = (seq[k] for k in ("hidden", "positions", "attention", "cache",
                                                "decoding"))
    n = len(h["token_ids"])
    kinds = {}
    for s in h["source"]:
        kinds[s] = kinds.get(s, 0) + 1
    what = " + ".join(f"{v} {k}" for k, v in kinds.items())
    p = pos["positions"]
    first = f"request {seq['request']}"
    if cache["admitted"]:
        first += " (admitted: " + _prefix(cache["prefix"]) + ")"
    lines = [first]
    lines.append(f"  1 hidden     {what} token(s) {ids(h['token_ids'])} -> rows "
                 f"{h['rows'][0]}:{h['rows'][1]} of [{rec['num_tokens']}, {h['shape'][1]}]")
    lines.append(f"  2 positions  {span(p[0], p[-1]) if p else '-'} (start C={pos['start']}, "
                 f"T={n}, rope delta {pos['rope_delta']})")
    if pos.get("mrope"):
        m = pos["mrope"]
        rows = " / ".join(f"{name} {_short_row(r)}" for name, r in zip("thw", m["rows"]))
        lines.append(f"               M-RoPE {rows}; {len(m['image_tokens'])} image token(s)")
    q0, q1 = att["queries"]
    sees = (f"query {q0} sees keys 0..{q0}" if q0 == q1 else
            f"queries {q0}..{q1}: query p sees keys 0..p (causal)")
    lines.append(f"  3 attention  {sees}, in its blocks {att['block_table']}; GDN: its state "
                 f"slot only")
    lines.append(f"  4 caches     KV write blocks {cache['kv_written']}, read "
                 f"{cache['kv_read']}; GDN {_gdn(cache['gdn'])}")
    lines.append(f"  5 decoding   {_decoding(dec)}")
    if seq.get("progress"):
        kept = cache.get("kept_checkpoint")
        tail = ""
        if kept:
            tail = (f"; its state kept as the checkpoint after {kept['num_tokens']} tokens "
                    f"(slot {kept['slot']})" if kept["own"] else
                    f"; the cache has the checkpoint after {kept['num_tokens']} tokens already "
                    f"(slot {kept['slot']})")
        lines.append(f"    -> {seq['progress']['num_computed_tokens']} tokens computed"
                     f"{tail}")
    return lines


def _prefix(prefix: dict | None) -> str:
    if not prefix:
        return "no prefix cache"
    ck = prefix.get("checkpoint")
    planned = prefix.get("checkpoint_at") or []
    blocks = prefix.get("cached_blocks", 0)
    if not prefix["cached_tokens"]:
        held = (f" ({blocks} leading block(s) cached, but no GDN checkpoint to resume from)"
                if blocks else "")
        return f"prefix cache miss{held}; checkpoints planned after {planned} tokens"
    if ck is None:
        return f"{prefix['cached_tokens']} tokens from the prefix cache"
    tail = f", KV tail of {ck['tail_len']} copied into block {ck['tail_block']}" if (
        ck["tail_block"] is not None) else ""
    return (f"prefix hit: {prefix['cached_tokens']} tokens, GDN state from checkpoint slot "
            f"{ck['slot']}, shared blocks {ck['shared_blocks']}{tail}")


def _gdn(g: dict) -> str:
    read = "zero state" if g["read"] is None else f"slot {g['read']}"
    out = f"{read} -> slot{'s' if len(g['written']) > 1 else ''} " + " ".join(
        map(str, g["written"]))
    if len(g["written"]) > 1:
        out += " (one per verified position)"
    for num_tokens, slot in g["checkpoints"]:
        out += f"; checkpoint after {num_tokens} tokens -> slot {slot}"
    if g.get("restored") is not None:
        out += f"; rolled back to slot {g['restored']}"
    return out


def _decoding(d: dict) -> str:
    if not d["logits_rows"]:
        return "no logits (mid-prompt chunk)"
    params = ", ".join(f"{k} {v}" for k, v in d["params"].items())
    top = " ".join(f"{t} ({v:.2f})" for t, v in d["top"][0]) if d["top"] else ""
    rows = d["logits_rows"]
    out = f"logits row{'s' if len(rows) > 1 else ''} {span(rows[0], rows[-1])} ({params}): " \
          f"top {top}"
    if d["drafts_verified"]:
        out += f"; drafts {ids(d['drafts_verified'])}, {d.get('accepted', 0)} accepted"
    if "emitted" in d:
        out += f" -> {ids(d['emitted'])}"
    if d.get("drafts_next"):
        out += f"; next drafts {ids(d['drafts_next'])}"
    if d.get("finish_reason"):
        out += f"; finished: {d['finish_reason']}"
    return out


def _short_row(row: list[int], keep: int = 6) -> str:
    """A row of positions, its first ``keep`` and its last when longer."""
    head = " ".join(map(str, row[:keep]))
    return f"[{head} ... {row[-1]}]" if len(row) > keep else f"[{head}]"

"""A trace as one self-contained HTML page (no server, nothing fetched): a timeline with a row
per request and a column per step, each cell coloured by what the request did in that step
(prompt chunk, decode, draft verification, prefix hit); clicking a cell shows the five
variables of that request in that step (``render_text.seq_lines``), with the step's line."""

from __future__ import annotations

import html
import json

from hybridrt.trace.render_text import header_lines, seq_lines, step_lines

_STYLE = """
body{font:13px system-ui,sans-serif;margin:1em}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:0;min-width:22px;height:20px;
text-align:center;font-size:11px}th{background:#f4f4f4;padding:2px 4px}
td.c{cursor:pointer}td.prompt{background:#7aa6d8}td.hit{background:#3c6}td.output{background:#f2b552}
td.draft{background:#c58be0}td.chained{background:#f7d48a}td.sel{outline:2px solid #000}
pre{background:#f8f8f8;padding:.6em;white-space:pre-wrap}.key span{padding:2px 6px;margin-right:6px}
"""

_SCRIPT = """
const D = JSON.parse(document.getElementById('data').textContent);
document.querySelectorAll('td.c').forEach(td => td.onclick = () => {
  document.querySelectorAll('td.sel').forEach(x => x.classList.remove('sel'));
  td.classList.add('sel');
  document.getElementById('detail').textContent = D[td.dataset.k];
});
"""


def _kind(seq: dict) -> str:
    src = seq["hidden"]["source"]
    if seq["cache"]["admitted"] and (seq["cache"]["prefix"] or {}).get("cached_tokens"):
        return "hit"
    if "draft" in src:
        return "draft"
    return src[0]


def render_html(header: dict, steps: list[dict], title: str = "hybridrt trace") -> str:
    """The page for ``steps`` (records of ``TraceRecorder``) under ``header``."""
    requests: list[str] = []
    for rec in steps:
        for s in rec["seqs"]:
            if s["request"] not in requests:
                requests.append(s["request"])
    details: dict[str, str] = {}
    cells = {}
    for rec in steps:
        head = step_lines(rec, ())[0]
        for s in rec["seqs"]:
            key = f"{rec['step']}/{s['request']}"
            details[key] = "\n".join([head, *seq_lines(s, rec)])
            cells[rec["step"], s["request"]] = (key, _kind(s), len(s["hidden"]["token_ids"]))
    head_row = "".join(f"<th>{r['step']}<br>{r['kind'][0]}</th>" for r in steps)
    rows = []
    for rid in requests:
        tds = []
        for rec in steps:
            cell = cells.get((rec["step"], rid))
            if cell is None:
                tds.append("<td></td>")
            else:
                key, kind, n = cell
                tds.append(f'<td class="c {kind}" data-k="{html.escape(key)}" '
                           f'title="{kind}, {n} token(s)">{n}</td>')
        rows.append(f"<tr><th>request {html.escape(rid)}</th>{''.join(tds)}</tr>")
    key = ('<p class="key">cells: tokens the request fed in the step; '
           '<span style="background:#7aa6d8">prompt chunk</span>'
           '<span style="background:#3c6">prefix-cache hit</span>'
           '<span style="background:#f2b552">decode</span>'
           '<span style="background:#c58be0">draft verification</span>'
           '<span style="background:#f7d48a">chained decode</span>'
           " (column heads: step, p/d/v = prefill/decode/verify)</p>")
    data = json.dumps(details).replace("</", "<\\/")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<pre>{html.escape(chr(10).join(header_lines(header)))}</pre>{key}"
            f"<table><tr><th>step</th>{head_row}</tr>{''.join(rows)}</table>"
            f"<h2>the five variables</h2><pre id='detail'>click a cell</pre>"
            f"<script type='application/json' id='data'>{data}</script>"
            f"<script>{_SCRIPT}</script></body></html>")

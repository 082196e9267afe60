"""One self-contained HTML report of a profile: inline CSS and SVG, no scripts, no network.

Sections: headline (tok/s, speedup over the first configuration, accept length), mean cycle
time split by phase, a timeline of the last cycles, acceptance by draft position, and the
phase tables. A phase has the same colour everywhere on the page; draft steps are shades of
one blue, "other" is grey. Every label is escaped.
"""

from __future__ import annotations

import colorsys
import math
import os
import re
from html import escape
from pathlib import Path

from specscope.profiler.phases import Phase
from specscope.profiler.profiler import EXPERT_ROWS, MODE_TITLES
from specscope.profiler.trace import CycleRecord, write_text_atomic

TIMELINE_CYCLES = 30
LABEL_W, PLOT_W = 230, 640  # SVG label column and plot width, px

_COLOURS = {
    "prefill": "#8c6d31", "draft_extend": "#8172b3", "draft": "#3a6ea5",
    "tree_build": "#17becf", "verify": "#dd8452", "verify_commit": "#c8553d",
    "accept": "#55a868", "kv_commit": "#e0b84c", "decode": "#c44e52",
    "detokenize": "#a5a02a", "other": "#c4c4c4",
}
_SPARE = ["#937860", "#da8bc3", "#8c8c8c", "#64b5cd", "#b5cf6b"]
_CONFIG_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
_STEP = re.compile(r"^draft_step\[(\d+)\]$")
_ORDER = [p.value for p in Phase]

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;background:#f6f7f9;
color:#1f2328;margin:0;padding:24px 32px;font-size:14px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:16px;margin:0 0 12px}
.sub{color:#656d76;margin-bottom:20px}
.card{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:16px 20px;
margin-bottom:18px;box-shadow:0 1px 2px rgba(0,0,0,.04);overflow-x:auto}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}
th,td{padding:5px 12px;border-bottom:1px solid #eef0f2;text-align:right;white-space:nowrap}
th{font-weight:600;color:#57606a;font-size:12px;text-transform:uppercase;letter-spacing:.03em}
th:first-child,td:first-child{text-align:left}
.badge{display:inline-block;background:#fff4e5;color:#a15c00;border:1px solid #f0b45e;
border-radius:10px;padding:1px 8px;font-size:11px;font-weight:700;margin-left:6px}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;margin:4px 0 10px;font-size:12px}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;
vertical-align:-1px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:18px}
.muted{color:#8c959f}svg text{font-family:inherit}
"""


def _colour(name: str) -> str:
    m = _STEP.match(name)
    if m:  # step 1 darkest; shades repeat every 6 steps
        light = 0.30 + 0.08 * ((int(m.group(1)) - 1) % 6)
        r, g, b = (round(c * 255) for c in colorsys.hls_to_rgb(0.58, light, 0.6))
        return f"#{r:02x}{g:02x}{b:02x}"
    return _COLOURS.get(name, _SPARE[sum(map(ord, name)) % len(_SPARE)])


def _text_colour(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#1f2328" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"


def _phase_key(name: str) -> tuple[int, int, str]:
    m = _STEP.match(name)
    base = "draft_step" if m else name
    rank = _ORDER.index(base) if base in _ORDER else len(_ORDER) - 1
    if name == "other":
        rank = len(_ORDER)  # always last
    return (rank, int(m.group(1)) if m else 0, name)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _badge(summary: dict) -> str:
    return '<span class="badge">SIMULATED acceptance</span>' if summary.get("simulated") else ""


def _swatch(name: str) -> str:
    return f'<span class="sw" style="background:{_colour(name)}"></span>{escape(name)}'


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str, extra: str = "") -> str:
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.5):.2f}" height="{h:.2f}" '
            f'fill="{fill}"{extra}><title>{escape(title)}</title></rect>')


def _label(x: float, y: float, text: str, anchor: str = "end", size: int = 12,
           fill: str = "#1f2328", extra: str = "") -> str:
    return (f'<text x="{x:.2f}" y="{y:.2f}" text-anchor="{anchor}" font-size="{size}" '
            f'fill="{fill}"{extra}>{escape(text)}</text>')


def _short(label: str, n: int = 34) -> str:
    """Row labels fit the SVG label column; the tables carry the full text."""
    return label if len(label) <= n else label[: n - 1] + "…"


def _svg(w: float, h: float, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" height="{h:.0f}" '
            f'viewBox="0 0 {w:.0f} {h:.0f}">{"".join(body)}</svg>')


def _nice_step(span: float, ticks: int = 6) -> float:
    """The smallest 1/2/5 x 10^n axis step giving at most `ticks` intervals over `span`."""
    raw = max(span, 1e-9) / ticks
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _experts_cell(s: dict) -> str:
    """MoE: mean distinct experts per layer, verify and decode cycles."""
    e = s.get("experts") or {}
    return " · ".join(f"{kind} {x:.1f}" for kind, x in e.items()) or "—"


def _headline(summaries: list[dict]) -> str:
    base = summaries[0]["tok_per_s"] if summaries else 0.0
    moe = any(s.get("experts") for s in summaries)
    rows = []
    for s in summaries:
        speed = f"{s['tok_per_s'] / base:.2f}×" if base else "—"
        tau = "—" if s.get("accept_length") is None else f"{s['accept_length']:.2f}"
        rows.append(
            f"<tr><td>{escape(s['config'])}{_badge(s)}</td><td>{s['tok_per_s']:.1f}</td>"
            f"<td><b>{speed}</b></td><td>{tau}</td><td>{s['cycles']}</td>"
            f"<td>{s['tokens']}</td><td>{_pct(s['attributed'])}</td>"
            + (f"<td>{_experts_cell(s)}</td>" if moe else "") + "</tr>")
    return ("<table><tr><th>configuration</th><th>tok/s</th><th>speedup</th>"
            "<th>accept length τ</th><th>cycles</th><th>tokens</th><th>attributed</th>"
            + ("<th>experts / MoE layer</th>" if moe else "") + "</tr>"
            + "".join(rows) + "</table>")


def _stacked(summaries: list[dict]) -> str:
    row_h, gap, top = 26, 12, 6
    totals = [sum(p["mean_ms"] for p in s["phases"].values()) for s in summaries]
    scale = PLOT_W / max(max(totals, default=0.0), 1e-9)
    body = []
    for i, (s, total) in enumerate(zip(summaries, totals, strict=True)):
        y = top + i * (row_h + gap)
        body.append(_label(LABEL_W - 10, y + row_h / 2 + 4, _short(s["config"])))
        x = LABEL_W
        for name in sorted(s["phases"], key=_phase_key):
            mean, c = s["phases"][name]["mean_ms"], _colour(name)
            w = mean * scale
            body.append(_rect(x, y, w, row_h, c, f"{name}: {mean:.3f} ms mean"))
            if w > 40:
                body.append(_label(x + w / 2, y + row_h / 2 + 4, f"{mean:.2f}", "middle", 11,
                                   _text_colour(c)))
            x += w
        body.append(_label(x + 6, y + row_h / 2 + 4, f"{total:.2f} ms", "start", 12))
    return _svg(LABEL_W + PLOT_W + 90, top * 2 + len(summaries) * (row_h + gap), body)


def _timeline(configs: list[str], records: list[CycleRecord]) -> str:
    rows = {c: [r for r in records if r.config == c][-TIMELINE_CYCLES:] for c in configs}
    rows = {c: rs for c, rs in rows.items() if rs}
    if not rows:
        return '<p class="muted">No cycle records.</p>'
    span = max(rs[-1].start_ms + rs[-1].wall_ms - rs[0].start_ms for rs in rows.values())
    scale, row_h, gap, top = PLOT_W / max(span, 1e-9), 24, 10, 8
    body = []
    axis_y = top + len(rows) * (row_h + gap)
    step = _nice_step(span)
    for k in range(int(span / step) + 1):
        x = LABEL_W + k * step * scale
        body.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{axis_y}" stroke="#eef0f2"/>')
        body.append(_label(x, axis_y + 14, f"{k * step:g} ms", "middle", 11, "#656d76"))
    for i, (config, rs) in enumerate(rows.items()):
        y, t0 = top + i * (row_h + gap), rs[0].start_ms
        body.append(_label(LABEL_W - 10, y + row_h / 2 + 4, _short(config)))
        for j, r in enumerate(rs):
            acc = "" if r.accepted is None else f", accepted {r.accepted}"
            body.append(_rect(LABEL_W + (r.start_ms - t0) * scale, y - 2, r.wall_ms * scale,
                              row_h + 4, "#e9ecef" if j % 2 else "#f3f4f6",
                              f"cycle {r.index}: {r.wall_ms:.3f} ms, {r.tokens} tokens{acc}, "
                              f"other {r.other_ms:.3f} ms"))
            for name, start, dur in r.phases:
                body.append(_rect(LABEL_W + (start - t0) * scale, y, dur * scale, row_h,
                                  _colour(name), f"{name}: {dur:.3f} ms (cycle {r.index})"))
    return _svg(LABEL_W + PLOT_W + 40, axis_y + 24, body)


def _acceptance(summaries: list[dict], key: str = "acceptance_by_position") -> str:
    """Bars of one acceptance definition by draft position (`key`: the conditional
    acceptance_by_position, or acceptance_per_draft_by_position)."""
    have = [s for s in summaries if s.get(key)]
    if not have:
        return '<p class="muted">No configuration reports acceptance by position.</p>'
    k = max(len(s[key]) for s in have)
    group_w = PLOT_W / k
    bar_w = group_w * 0.8 / len(have)
    rotate = bar_w < 34  # narrow bars: value labels run upwards, so leave room above 100%
    plot_h, top, left = 200, 48 if rotate else 24, 48
    body = []
    for v in (0, 25, 50, 75, 100):
        y = top + plot_h * (1 - v / 100)
        body.append(f'<line x1="{left}" y1="{y:.2f}" x2="{left + PLOT_W}" y2="{y:.2f}" '
                    f'stroke="{"#8c959f" if v == 0 else "#eef0f2"}"/>')
        body.append(_label(left - 6, y + 4, f"{v}%", "end", 11, "#656d76"))
    for pos in range(k):
        gx = left + pos * group_w + group_w * 0.1
        body.append(_label(left + (pos + 0.5) * group_w, top + plot_h + 16, str(pos + 1),
                           "middle", 12))
        for j, s in enumerate(have):
            acc = s[key]
            if pos >= len(acc):
                continue
            x, h = gx + j * bar_w, plot_h * max(min(acc[pos], 1.0), 0.0)
            c = _CONFIG_COLOURS[summaries.index(s) % len(_CONFIG_COLOURS)]
            body.append(_rect(x, top + plot_h - h, bar_w * 0.92, h, c,
                              f"{s['config']}, position {pos + 1}: {_pct(acc[pos])}"))
            cx, ly = x + bar_w * 0.46, top + plot_h - h - 4
            rot = f' transform="rotate(-90 {cx:.2f} {ly:.2f})"' if rotate else ""
            anchor = "start" if rot else "middle"
            body.append(_label(cx + (3 if rot else 0), ly, _pct(acc[pos]), anchor, 10,
                               "#1f2328", rot))
    body.append(_label(left + PLOT_W / 2, top + plot_h + 34, "draft position", "middle", 12,
                       "#656d76"))
    legend = "".join(
        f'<span><span class="sw" style="background:'
        f'{_CONFIG_COLOURS[summaries.index(s) % len(_CONFIG_COLOURS)]}"></span>'
        f"{escape(s['config'])}{_badge(s)}</span>" for s in have)
    return f'<div class="legend">{legend}</div>' + _svg(left + PLOT_W + 20, top + plot_h + 44,
                                                         body)


def _rows(phases: dict, experts: dict[str, float] | None = None) -> str:
    """Phase rows; with a MoE target's `experts`, the experts per layer beside the target
    forward's rows (verify, verify_commit, decode)."""
    def cell(n: str) -> str:
        if not experts:
            return ""
        x = experts.get(EXPERT_ROWS.get(n, ""))
        return f"<td>{'—' if x is None else f'{x:.1f}'}</td>"

    return "".join(
        f"<tr><td>{_swatch(n)}</td><td>{_ms(p['mean_ms'])}</td><td>{_ms(p['p50_ms'])}</td>"
        f"<td>{_ms(p['p90_ms'])}</td><td>{_pct(p['share'])}</td>{cell(n)}</tr>"
        for n, p in sorted(phases.items(), key=lambda kv: _phase_key(kv[0])))


def _phase_table(s: dict) -> str:
    """One table per timing mode (graph replays by segment, eager cycles by phase), each
    with its cycle count, as format_summary prints them."""
    def head(experts: dict | None) -> str:
        return ("<tr><th>phase</th><th>mean ms</th><th>p50 ms</th><th>p90 ms</th>"
                "<th>share</th>" + ("<th>experts / layer</th>" if experts else "") + "</tr>")

    modes = s.get("modes") or {"phases": {"cycles": s["cycles"], "phases": s["phases"]}}

    def table(m: dict) -> str:
        e = m.get("experts", s.get("experts"))
        return f"<table>{head(e)}{_rows(m['phases'], e)}</table>"

    tables = "".join(
        (f'<p class="muted">{escape(MODE_TITLES[mode])}: {m["cycles"]} cycles</p>'
         if len(modes) > 1 or mode == "segments" else "")
        + table(m) for mode, m in modes.items())
    by_batch = s.get("by_batch") or {}
    if len(by_batch) > 1 or any(b > 1 for b in by_batch):
        tables += "".join(
            f'<p class="muted">batch size &le; {b}: {m["cycles"]} steps, '
            f'{m["cycle_ms"]:.3f} ms each, {m["tok_per_s"]:.1f} tok/s</p>'
            + table(m) for b, m in by_batch.items())
    return (f'<div><h2>{escape(s["config"])}{_badge(s)}</h2>{tables}'
            f'<p class="muted">{s["cycles"]} cycles · {s["wall_ms"]:.1f} ms wall · '
            f"{s['cycles_per_s']:.1f} cycles/s · {_pct(s['attributed'])} attributed</p></div>")


def _meta_line(meta: dict | None) -> str:
    """Model, dtype, device, dataset and date of the run, and what tok/s counts."""
    keys = ("model", "dtype", "device", "dataset", "num_prompts", "max_tokens", "date")
    parts = [f"{k.replace('_', ' ')}: {escape(str(meta[k]))}" for k in keys
             if meta and meta.get(k) is not None]
    parts.append("tok/s: decode tokens over decode-cycle time (prefill excluded)")
    return f'<div class="sub">{" · ".join(parts)}</div>'


def render_report(summaries: list[dict], records: list[CycleRecord],
                  title: str = "specscope profile", meta: dict | None = None) -> str:
    """The report as an HTML string (see `write_report`)."""
    configs = [s["config"] for s in summaries]
    configs += list(dict.fromkeys(r.config for r in records if r.config not in configs))
    names = {n for s in summaries for n in s["phases"]}
    names |= {n for r in records for n, _, _ in r.phases}
    legend = "".join(f"<span>{_swatch(n)}</span>" for n in sorted(names, key=_phase_key))
    legend = f'<div class="legend">{legend}</div>'
    cards = [
        ("Throughput", _headline(summaries)),
        ("Mean cycle time by phase (ms)", legend + _stacked(summaries)),
        (f"Timeline of the last {TIMELINE_CYCLES} cycles (hover for ms)",
         legend + _timeline(configs, records)),
        ("Acceptance by draft position, conditional: accepted given all earlier were",
         _acceptance(summaries)),
        ("Acceptance by draft position, per draft: accepted over all drafts (vLLM's)",
         _acceptance(summaries, "acceptance_per_draft_by_position")),
    ]
    html_cards = "".join(f'<section class="card"><h2>{escape(h)}</h2>{b}</section>'
                         for h, b in cards)
    tables = "".join(_phase_table(s) for s in summaries)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{escape(title)}</h1>{_meta_line(meta)}"
            f"<div class=\"sub\">{len(summaries)} configurations · "
            f"{len(records)} cycles recorded · baseline: "
            f"{escape(summaries[0]['config']) if summaries else '—'}</div>{html_cards}"
            f'<section class="card"><h2>Phases per configuration</h2>'
            f'<div class="grid">{tables}</div></section></body></html>\n')


def write_report(summaries: list[dict], records: list[CycleRecord], path: str | os.PathLike,
                 title: str = "specscope profile", meta: dict | None = None) -> Path:
    """Write the HTML report to `path` atomically; returns the path. meta: the run's model,
    dtype, device, dataset, date (profile.json's meta), named under the title."""
    return write_text_atomic(path, render_report(summaries, records, title, meta))

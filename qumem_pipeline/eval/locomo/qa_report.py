"""A self-contained HTML page for a LoCoMo QA report, for people who would rather look than read.

Plots are inline SVG written here (no plotting library, no script, nothing fetched): F1 per category
per strategy as grouped bars, BLEU-1 likewise, and - when a retrieval harness report is given -
evidence recall against the word budget, one line per unit kind. The page is one file; open it anywhere.
"""

import html
import os
from pathlib import Path

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
W, H, PAD_L, PAD_B, PAD_T = 720, 300, 48, 48, 16


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _legend(names, y: int) -> str:
    out = []
    for i, n in enumerate(names):
        x = PAD_L + (i % 4) * 165
        yy = y + (i // 4) * 18
        out.append(f'<rect x="{x}" y="{yy - 10}" width="12" height="12" fill="{PALETTE[i % len(PALETTE)]}"/>'
                   f'<text x="{x + 16}" y="{yy}" font-size="12">{_esc(n)}</text>')
    return "".join(out)


def _frame(names: list[str], title: str, ymax: float) -> tuple[list[str], float, float]:
    """The parts every chart starts with (svg header, title, y grid), and the plot's width and height."""
    height = H + 18 * ((len(names) + 3) // 4)  # room for the legend's rows
    plot_w, plot_h = W - PAD_L - 16, H - PAD_B - PAD_T
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" role="img" aria-label="{_esc(title)}">',
             f'<text x="{PAD_L}" y="12" font-size="13" font-weight="bold">{_esc(title)}</text>']
    for k in range(6):
        v = ymax * k / 5
        y = PAD_T + plot_h - plot_h * v / ymax
        parts.append(f'<line x1="{PAD_L}" x2="{PAD_L + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{v:.1f}</text>')
    return parts, plot_w, plot_h


def bar_chart(groups: list[str], series: dict[str, list[float | None]], title: str, ymax: float = 1.0) -> str:
    """Grouped bars: one group per x label, one bar per series; None draws nothing (n/a)."""
    names = list(series)
    parts, plot_w, plot_h = _frame(names, title, ymax)
    gw = plot_w / max(len(groups), 1)
    bw = gw * 0.8 / max(len(names), 1)
    for gi, g in enumerate(groups):
        gx = PAD_L + gi * gw + gw * 0.1
        for si, n in enumerate(names):
            v = series[n][gi]
            if v is None:
                continue
            h = plot_h * min(v, ymax) / ymax
            x, y = gx + si * bw, PAD_T + plot_h - h
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw * 0.92:.1f}" height="{h:.1f}" '
                         f'fill="{PALETTE[si % len(PALETTE)]}"><title>{_esc(n)} / {_esc(g)}: {v:.3f}</title></rect>')
        parts.append(f'<text x="{gx + gw * 0.4:.1f}" y="{PAD_T + plot_h + 16}" font-size="12" text-anchor="middle">{_esc(g)}</text>')
    parts.append(_legend(names, H - 8))
    parts.append("</svg>")
    return "".join(parts)


def line_chart(xs: list[int], series: dict[str, list[float | None]], title: str, ymax: float = 1.0) -> str:
    names = list(series)
    parts, plot_w, plot_h = _frame(names, title, ymax)

    def px(i: int) -> float:
        return PAD_L + (plot_w * i / max(len(xs) - 1, 1))

    for i, x in enumerate(xs):
        parts.append(f'<text x="{px(i):.1f}" y="{PAD_T + plot_h + 16}" font-size="12" text-anchor="middle">{x} words</text>')
    for si, n in enumerate(names):
        pts = [(px(i), PAD_T + plot_h - plot_h * min(v, ymax) / ymax, v) for i, v in enumerate(series[n]) if v is not None]
        if not pts:
            continue
        color = PALETTE[si % len(PALETTE)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in pts) + '"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"><title>{_esc(n)}: {v:.3f}</title></circle>'
                  for x, y, v in pts]
    parts.append(_legend(names, H - 8))
    parts.append("</svg>")
    return "".join(parts)


def _qa_table(report: dict) -> str:
    cats = ["1", "2", "3", "4"]
    names = {c: v.get("name") for s in report["qa"].values() for c, v in s["per_category"].items()}

    def f(v) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    head = ("<tr><th>strategy</th><th>F1 (cat 1-4)</th><th>BLEU-1</th>"
            + "".join(f"<th>F1 cat {c}<br><small>{_esc(names.get(c) or '')}</small></th>" for c in cats)
            + "<th>cat 5 abstain</th><th>n</th><th>mean context words</th></tr>")
    rows = []
    for s, v in report["qa"].items():
        pc = v["per_category"]
        rows.append(f"<tr><td>{_esc(s)}</td><td>{f(v['f1'])}</td><td>{f(v['bleu1'])}</td>"
                    + "".join(f"<td>{f(pc.get(c, {}).get('f1'))}</td>" for c in cats)
                    + f"<td>{f(v['adversarial']['abstain'])}</td><td>{v['n'] + v['adversarial']['n']}</td>"
                    + f"<td>{v['mean_context_words'] or 0:.0f}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def render_html(report: dict, retrieval_report: dict | None = None) -> str:
    qa = report["qa"]
    groups = ["1", "2", "3", "4"]
    labels = [f"cat {g}" for g in groups] + ["overall 1-4"]
    f1 = {s: [v["per_category"].get(g, {}).get("f1") for g in groups] + [v["f1"]] for s, v in qa.items()}
    bl = {s: [v["per_category"].get(g, {}).get("bleu1") for g in groups] + [v["bleu1"]] for s, v in qa.items()}
    ab = {s: [v["adversarial"]["abstain"]] for s, v in qa.items()}
    body = [
        f"<h1>LoCoMo answer quality</h1><p>{_esc(report.get('dataset'))}: {report['n_questions']} questions "
        f"(categories 1-4) + {report['n_questions_adversarial']} adversarial; model <b>{_esc(report.get('model'))}</b>; "
        f"seed {report.get('seed')}, {_esc(report.get('sample_per_category') or 'all')} per category; "
        f"top-k budget {report.get('words_budget')} words; wall time {report.get('wall_s')} s.</p>",
        _qa_table(report),
        "<p><small>" + _esc(report.get("scoring", "")) + "</small></p>",
        bar_chart(labels, f1, "Token F1 per category, per strategy"),
        bar_chart(labels, bl, "BLEU-1 per category, per strategy"),
        bar_chart(["cat 5 (adversarial)"], ab, "Category 5: share of answers that abstain (higher is better)"),
    ]
    if retrieval_report and retrieval_report.get("retrieval"):
        budgets = [int(b) for b in retrieval_report["budgets"]]
        blk = retrieval_report["retrieval"]
        series = {k: [v.get(str(b)) for b in budgets] for k, v in blk.items()
                  if isinstance(v, dict) and all(str(b) in v for b in budgets)}
        for s, v in (blk.get("strategies") or {}).items():
            if v:
                series[f"strategy {s}"] = [v.get(str(b)) for b in budgets]
        body.append(line_chart(budgets, series, "Evidence recall against word budget, per unit (categories 1-4)"))
    sk = report.get("skipped") or {}
    if sk:
        body.append("<h2>Skipped</h2><ul>" + "".join(f"<li><b>{_esc(k)}</b>: {_esc(v)}</li>" for k, v in sk.items()) + "</ul>")
    calls = report.get("llm_calls") or {}
    for key, title, cols in (
            ("by_strategy_this_run", "LLM calls behind this run's answers (replayed or sent)",
             ("calls", "errors", "salvaged", "prompt_tokens", "completion_tokens")),
            ("ledger_by_strategy", "LLM calls (ledger, every run)", ("calls", "prompt_tokens", "completion_tokens", "errors"))):
        rows = calls.get(key) or {}
        if rows:
            body.append(f"<h2>{_esc(title)}</h2><table><tr><th>strategy</th>"
                        + "".join(f"<th>{c.replace('_', ' ')}</th>" for c in cols) + "</tr>"
                        + "".join(f"<tr><td>{_esc(s)}</td>" + "".join(f"<td>{v.get(c, '')}</td>" for c in cols) + "</tr>"
                                  for s, v in rows.items())
                        + "</table>")
    style = ("body{font-family:sans-serif;max-width:780px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}svg{display:block;margin:1.5em 0}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>LoCoMo QA report</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def write_html(report: dict, path: str | os.PathLike, retrieval_report: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_text(render_html(report, retrieval_report), encoding="utf-8")
    os.replace(tmp, path)
    return path

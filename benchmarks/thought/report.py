"""The table and the plot of ``benchmarks/thought/patches.py``'s JSON (issue 13).

    python -m benchmarks.thought.report benchmarks/results/thought_patches.json \\
        --md table.md --plot benchmarks/results/thought_patches.png \\
        [--levers benchmarks/results/thought_patch_levers.json]

The stored runs (``benchmarks/results/``) are what ``docs/results/thought_patches.md`` shows.

The Markdown holds, per context, one line per patch with its held-out figures on fresh samples and
on hand-written questions, beside the unpatched model's, and the goal check of issue 13 (on fresh
samples: KL at most a quarter of the unpatched model's and top-1 at least 80%). The plot (needs
``pip install 'ctxc[plot]'``) shows held-out KL and top-1 against K, one line per method and R.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ctxc.core.vocabulary import DISTILL_METHOD, FIT_METHOD

KINDS = ("samples", "questions")


def load_rows(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """Rows of several runs; a row measured twice (the unpatched control of a follow-up run)
    is kept once, the first."""
    rows, fits, seen = [], [], set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data["rows"]:
            key = (r["context"], r["held_out"], r["method"], r["K"], r["R"], r.get("budget"))
            if key not in seen:
                seen.add(key)
                rows.append(r)
        fits += data.get("fits", [])
    return rows, fits


def label(row: dict) -> str:
    m = row["method"]
    if m == DISTILL_METHOD:
        return f"distill ({row['budget']}, {row['steps']} steps)"
    if m == "mean-exact":
        return f"mean of {row.get('exact_positions', '?')} exact patches"
    return m


def _key(row: dict) -> tuple:
    order = {"unpatched": 0, "mean-exact": 1, FIT_METHOD: 2, DISTILL_METHOD: 3}
    rank = {"8": 0, "64": 1, "full": 2}.get(str(row["R"]), -1)
    factor = float(row.get("budget", "0x").split("x")[0])  # distill's "1x fit", "10x fit"
    return (order[row["method"]], row["K"], rank, factor)


def table(rows: list[dict], context: str) -> list[str]:
    """Markdown lines for one context: a line per patch, both held-out kinds side by side."""
    mine = [r for r in rows if r["context"] == context]
    pairs: dict[tuple, dict] = {}
    for r in mine:
        pairs.setdefault((*_key(r), r["R"]), {})[r["held_out"]] = r
    out = [
        "| method | K | R | samples: KL | top-1 | matched | questions: KL | top-1 | matched | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(pairs):
        got = pairs[key]
        first = next(iter(got.values()))
        k = first["K"] or "-"
        out.append(f"| {label(first)} | {k} | {first['R']} | {_cells(got)} | {first['seconds']} |")
    return out


def _cells(got: dict) -> str:
    """KL, top-1 and matched tokens of each held-out kind, as table cells."""
    return " | ".join(
        f"{got[k]['kl']:.3f} | {got[k]['top1']:.1%} | {got[k]['matched']:.2f}"
        if k in got
        else "- | - | -"
        for k in KINDS
    )


def goal(rows: list[dict], context: str) -> str:
    """The issue's goal on fresh samples: the best patch's KL against a quarter of the control."""
    mine = [r for r in rows if r["context"] == context and r["held_out"] == "samples"]
    control = next(r for r in mine if r["method"] == "unpatched")
    patched = [r for r in mine if r["method"] != "unpatched"]
    if not patched:
        return f"{context}: no patch measured"
    best = min(patched, key=lambda r: r["kl"])
    met = best["kl"] <= control["kl"] / 4 and best["top1"] >= 0.8
    return (
        f"{context}: best on fresh samples {label(best)} K={best['K']} R={best['R']}: KL "
        f"{best['kl']:.3f} = {best['kl'] / control['kl']:.2f}x the unpatched {control['kl']:.3f} "
        f"(goal <= 0.25x), top-1 {best['top1']:.1%} (unpatched {control['top1']:.1%}; goal >= "
        f"80%): goal {'met' if met else 'not met'}"
    )


def fit_blocks(fits: list[dict], context: str) -> str:
    """A line on the per-block fit figures: effective rank and residual, first and last."""
    mine = [f for f in fits if f["context"] == context]
    if not mine:
        return ""
    last = max(mine, key=lambda f: (f["K"], str(f["R"]) == "full"))
    ranks = [b["effective_rank"] for b in last["blocks"]]
    resid = [b["residual_rms"] / max(b["target_rms"], 1e-30) for b in last["blocks"]]
    return (
        f"{context}, fit K={last['K']} R={last['R']}: effective rank of the per-position exact "
        f"input moves {min(ranks):.0f}-{max(ranks):.0f} across blocks; block output residual "
        f"after the fit {min(resid):.1%}-{max(resid):.1%} of the target's RMS"
    )


def levers(path: str) -> list[str]:
    """Markdown lines for ``benchmarks/thought/levers.py``'s JSON: a line per setting."""
    data = json.loads(Path(path).read_text())
    pairs: dict[str, dict] = {}
    for r in data["rows"]:
        pairs.setdefault(r.get("setting", "unpatched"), {})[r["held_out"]] = r
    a = data["args"]
    out = [
        f"{data['rows'][0]['context']}, K={a['samples']}, R={a['rank']}; held out: "
        f"{a['held']} fresh samples, {a['qs']} questions, {a['gen']} greedy tokens; every other "
        "lever at its default (ridge 1.0, scale ridge 0.1, BOS not fitted, input moves on).",
        "",
        "| setting | samples: KL | top-1 | matched | questions: KL | top-1 | matched | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setting, got in pairs.items():
        out.append(f"| {setting} | {_cells(got)} | {next(iter(got.values()))['seconds']} |")
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = list(dict.fromkeys(r["context"] for r in rows))
    fig, axes = plt.subplots(4, len(contexts), figsize=(4.2 * len(contexts), 12), squeeze=False)
    styles = {FIT_METHOD: "-", DISTILL_METHOD: "--"}
    for c, context in enumerate(contexts):
        for k, kind in enumerate(KINDS):
            mine = [r for r in rows if r["context"] == context and r["held_out"] == kind]
            for m, metric in enumerate(("kl", "top1")):
                ax = axes[2 * k + m, c]
                control = next(r for r in mine if r["method"] == "unpatched")
                ax.axhline(control[metric], color="black", lw=1, label="unpatched")
                _lines(ax, mine, metric, styles)
                ax.set_xscale("log", base=2)
                if metric == "kl":
                    ax.set_yscale("log")
                ax.set_title(f"{context}, held-out {kind}: {'KL' if metric == 'kl' else 'top-1'}")
                ax.set_xlabel("K (fit samples)")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _lines(ax, mine: list[dict], metric: str, styles: dict) -> None:
    groups: dict[str, list[dict]] = {}
    for r in mine:
        if r["method"] == "unpatched":
            continue
        name = r["method"] if r["method"] == "mean-exact" else f"{r['method']} R={r['R']}"
        if r["method"] == DISTILL_METHOD:
            name += f" {r['budget']}"
        groups.setdefault(name, []).append(r)
    for name, pts in groups.items():
        pts.sort(key=lambda r: r["K"])
        style = styles.get(name.split(" ")[0], ":")
        ax.plot([r["K"] for r in pts], [r[metric] for r in pts], style, marker="o", label=name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--md", default=None, help="write the Markdown here (default: print)")
    p.add_argument("--plot", default=None, help="write the plot here")
    p.add_argument("--levers", default=None, help="thought_patch_levers.py's JSON: its table")
    args = p.parse_args()
    rows, fits = load_rows(args.json)
    lines = []
    for context in dict.fromkeys(r["context"] for r in rows):
        lines += [f"### {context}", "", *table(rows, context), "", goal(rows, context)]
        extra = fit_blocks(fits, context)
        lines += ["", extra, ""] if extra else [""]
    if args.levers:
        lines += ["### levers", "", *levers(args.levers), ""]
    text = "\n".join(lines)
    if args.md:
        Path(args.md).write_text(text)
    else:
        print(text)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

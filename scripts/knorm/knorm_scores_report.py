"""Tables and heatmaps of the eviction-score grid: one row per score, one column per compression ratio.

Reads the ``results.json`` of ``hf-knorm niah --scores ...`` runs (several folders may be given, e.g. one per task run
in parallel) and writes, per task:

- a markdown table: accuracy (%) of every score at every ratio over the whole grid, the uncompressed row on top, and
  the same per context length at ``--focus`` (the target's ratio);
- a figure with one needle heatmap per score (rows) and ratio (columns): ``<figures>/scores_<task>.png``;
- the threshold rows (``--scores kvzap+...+thresholdT``, named ``t=<T> <entry>``), which have no ratio, in a table of
  their own: the mean share of the tokens each cache no longer held after its answers, and the accuracy per length.

Usage::

    python scripts/knorm/knorm_scores_report.py outputs/niah_scores/niah outputs/niah_scores/passkey \\
        --figures docs/figures/knorm --out outputs/niah_scores/scores.md
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from hf_knorm.evaluation.needle import accuracy_grid, mean_evicted
from hf_knorm.plots import plot_needle_heatmap_grid


def split_variant(name: str) -> tuple[float, str]:
    """``"r=0.5 kv_diff"`` -> (0.5, "kv_diff"); ``"r=0.5"`` -> (0.5, "key_norm"); ``"r=0"`` -> (0.0, "uncompressed")."""
    match = re.fullmatch(r"r=([0-9.]+)(?: (.+))?", name)
    if not match:
        raise ValueError(f"Not a score-grid row: {name!r} (expected 'r=<ratio>' or 'r=<ratio> <score entry>').")
    ratio = float(match.group(1))
    return ratio, "uncompressed" if ratio == 0 else (match.group(2) or "key_norm")


def percent(rows: list[dict]) -> str:
    return f"{100 * sum(r['correct'] for r in rows) / len(rows):.1f}" if rows else "-"


def is_threshold_row(name: str) -> bool:
    return name.startswith("t=")


def threshold_table(records: list[dict], task: str) -> str:
    """The threshold rows of ``task``: share evicted (mean over the cells) and accuracy per length; "" if none."""
    rows = [r for r in records if r["task"] == task and is_threshold_row(r["variant"])]
    if not rows:
        return ""
    lengths = sorted({r["length"] for r in rows})
    lines = [f"{task}, threshold rows (no ratio: each evicts what its threshold gives):", "",
             "| row | evicted | " + " | ".join(f"{n} tok" for n in lengths) + " | all |",
             "|---|" + "---:|" * (len(lengths) + 2)]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        selected = [r for r in rows if r["variant"] == variant]
        per_length = " | ".join(percent([r for r in selected if r["length"] == n]) for n in lengths)
        lines.append(f"| {variant} | {mean_evicted(selected)} | {per_length} | {percent(selected)} |")
    return "\n".join(lines)


def task_tables(records: list[dict], task: str, focus: float) -> str:
    rows = [r for r in records if r["task"] == task and not is_threshold_row(r["variant"])]
    by_row: dict[str, dict[float, list[dict]]] = {}
    for record in rows:
        ratio, score = split_variant(record["variant"])
        by_row.setdefault(score, {}).setdefault(ratio, []).append(record)
    ratios = sorted({ratio for cells in by_row.values() for ratio in cells if ratio > 0})
    lengths = sorted({r["length"] for r in rows})
    seeds = len({r["seed"] for r in rows})
    cells = len({(r["length"], r["depth"], r["seed"]) for r in rows})
    lines = [f"{task}: accuracy (%) over {cells} cells ({len(lengths)} lengths x depths x {seeds} seeds)", "",
             "| score | " + " | ".join(f"r={r:g}" for r in ratios) + " |", "|---|" + "---:|" * len(ratios)]
    base = percent(by_row.get("uncompressed", {}).get(0.0, []))
    lines.append("| uncompressed (r=0) | " + " | ".join(base for _ in ratios) + " |")
    for score, per_ratio in by_row.items():
        if score != "uncompressed":
            lines.append(f"| {score} | " + " | ".join(percent(per_ratio.get(r, [])) for r in ratios) + " |")
    lines += ["", f"{task} at r={focus:g}, per context length:", "",
              "| score | " + " | ".join(f"{n} tok" for n in lengths) + " | all |",
              "|---|" + "---:|" * (len(lengths) + 1)]
    for score, per_ratio in by_row.items():
        selected = per_ratio.get(0.0 if score == "uncompressed" else focus, [])
        if selected:
            lines.append(f"| {score} | " + " | ".join(percent([r for r in selected if r["length"] == n])
                                                       for n in lengths) + f" | {percent(selected)} |")
    thresholds = threshold_table(records, task)
    return "\n".join(lines) + (f"\n\n{thresholds}" if thresholds else "")


def task_figure(records: list[dict], task: str, path: Path) -> Path:
    panels: dict[str, dict[str, tuple]] = {}
    variants = dict.fromkeys(r["variant"] for r in records if r["task"] == task and not is_threshold_row(r["variant"]))
    # columns by ratio; rows in the order of their first column
    for variant in sorted(variants, key=lambda name: split_variant(name)[0]):
        ratio, score = split_variant(variant)
        if ratio > 0:  # a long entry's label is wrapped at its options, so that the rows' labels do not overlap
            label = score.replace("+", "\n+", score.count("+") - 1) if len(score) > 20 else score
            panels.setdefault(label, {})[f"r={ratio:g}"] = accuracy_grid(records, task, variant)
    rows = [r for r in records if r["task"] == task]
    seeds = len({r["seed"] for r in rows})
    uncompressed = percent([r for r in rows if r["variant"] == "r=0"])
    title = (f"{'Needle in a haystack' if task == 'niah' else 'Passkey'}, SmolLM2-135M-Instruct, {seeds} seed(s) per "
             f"cell\nrows: eviction score, columns: compression ratio (uncompressed: {uncompressed}%)")
    return plot_needle_heatmap_grid(panels, path, title=title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="output folders of hf-knorm niah (with results.json)")
    parser.add_argument("--focus", type=float, default=0.5, help="the ratio of the per-length table (default 0.5)")
    parser.add_argument("--figures", type=Path, default=Path("outputs/niah_scores"), help="folder of the figures")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    args = parser.parse_args()
    records = []
    for folder in args.folders:
        path = folder / "results.json"
        if not path.exists():
            raise SystemExit(f"{path} does not exist: give the --out folder of an hf-knorm niah run.")
        records += json.loads(path.read_text())
    parts = []
    for task in dict.fromkeys(r["task"] for r in records):
        parts.append(task_tables(records, task, args.focus))
        parts.append(f"\nfigure: {task_figure(records, task, args.figures / f'scores_{task}.png')}\n")
    text = "\n".join(parts)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

r"""The conversion's budget curve: what a longer recovery buys, per held-out domain and in the probe.

Issue "general conversion", item 6: time traded for quality along a measured curve. One ordinary ``hf-knorm convert
--budget B`` per ``--budgets`` entry (the recovery's length as a multiple of its 150 steps; the transfer is the same
in every run), one after the other (never two at once on 2 cores), each in its own folder (``budget2``) with the
flags after ``--``; then one row per budget: recovery steps and tokens, the wall time, the perplexity of every
held-out domain against the original model, the worst of them (the headline) and the probe; and, under it, each
run's worst domain at every evaluation of its recovery (a longer schedule passes the shorter one's step count at a
higher rate, so those points are not what the shorter budget ends at). Runs at the same seed and thread count share
their transfer exactly, so the rows differ by the recovery's length alone. A run whose ``convert.json`` exists is not
run again; ``--report`` only gathers the folders.

Usage (docs/research/2026-12-conversion.md, "Budget"):
    python research/2026-12/conversion_budget.py --out runs/budget --budgets 1,2 --seed 1
    python research/2026-12/conversion_budget.py --out runs/budget --budgets 1,2 --report
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversion_spread import convert, finished_run, split_flags, write_report  # noqa: E402  (sibling script)


def folder_name(budget: float) -> str:
    """``2.0`` -> ``budget2``, ``0.5`` -> ``budget0.5``."""
    return f"budget{budget:g}"


def worst_ratio_curve(summary: dict) -> list[list[float]]:
    """``[step, worst ratio]`` at every evaluation of the recovery: the largest ratio to the original model over the
    held-out domains evaluated at that step."""
    original = {name: record["original_perplexity"] for name, record in summary["evaluation"]["domains"].items()}
    curves = summary["stages"].get("recovery", {}).get("curves", {})
    by_step: dict[int, float] = {}
    for name, curve in curves.items():
        if name not in original:
            continue
        for step, _tokens, perplexity in curve:
            by_step[step] = max(by_step.get(step, 0.0), perplexity / original[name])
    return [[step, ratio] for step, ratio in sorted(by_step.items())]


def rows(out: Path, budgets: list[float]) -> list[dict]:
    """One row per finished run: its budget, recovery steps and tokens, the curve, and ``finished_run``'s figures."""
    table = []
    for budget in budgets:
        found = finished_run(out / folder_name(budget))
        if found is None:
            continue
        run, summary = found
        recovery = summary["stages"].get("recovery", {})
        table.append({"budget": budget, "recovery_steps": recovery.get("steps"),
                      "recovery_tokens": recovery.get("tokens"), "worst_curve": worst_ratio_curve(summary), **run})
    return table


def markdown(table: list[dict]) -> str:
    """The rows as a markdown table, then each run's worst domain over its recovery."""
    if not table:
        return "(no finished run)"
    names = list(table[0]["domains"])
    header = ["budget", "recovery steps (tokens)", "minutes", *names, "worst / original", "probe"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for row in table:
        cells = [f"{row['domains'][name]['perplexity']:.4g} ({row['domains'][name]['ratio']:.2f}x)" for name in names]
        probe = f"{row['probe']:.1%}" if row["probe"] is not None else "-"
        minutes = f"{row['seconds'] / 60:.1f}" if row["seconds"] else "-"
        lines.append(f"| {row['budget']:g} | {row['recovery_steps']} ({row['recovery_tokens']:,}) | {minutes} | "
                     + " | ".join(cells) + f" | {row['worst']:.2f}x | {probe} |")
    lines.append("")
    for row in table:
        points = ", ".join(f"{step}: {ratio:.3g}x" for step, ratio in row["worst_curve"])
        lines.append(f"- budget {row['budget']:g}, worst domain at each recovery evaluation: {points}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    own, flags = split_flags(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="folder of the runs (one sub-folder per budget)")
    parser.add_argument("--budgets", default="1,2", help="comma-separated multiples of the recovery (default: 1,2)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each run (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (default: 0)")
    parser.add_argument("--report", action="store_true", help="gather the finished runs only, train nothing")
    args = parser.parse_args(own)
    budgets = [float(budget) for budget in args.budgets.split(",") if budget.strip()]
    if not budgets or min(budgets) <= 0:
        parser.error(f"--budgets must be positive numbers, not {args.budgets!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for budget in budgets:
            convert(out / folder_name(budget), args.seed, args.threads, ["--budget", f"{budget:g}", *flags])
    table = rows(out, budgets)
    write_report(out / "budget", {"flags": flags, "runs": table}, markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

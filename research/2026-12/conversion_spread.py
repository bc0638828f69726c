r"""The spread of a conversion recipe: the same `hf-knorm convert` over seeds and thread counts, medians and ranges.

A recipe whose result depends on luck is not a recipe. This script runs one conversion per ``--runs`` entry
(``SEED:THREADS``; a different thread count changes the order of floating-point sums, a stand-in for another
machine), one after the other (never two at once on 2 cores), each an ordinary ``hf-knorm convert`` in its own folder
with the flags after ``--``, and reports for every held-out set and the ability probe: each run's figure, the median,
the range and the largest deviation from the median (the target: within 10%). A run whose ``convert.json`` exists is
not run again, so the script resumes; ``--report`` only gathers the folders.

Usage (docs/research/2026-12-conversion.md, "The general conversion": "Spread after the fix"):
    python research/2026-12/conversion_spread.py --out runs/spread-defaults --runs 0:2,1:2,0:1
    python research/2026-12/conversion_spread.py --out runs/spread-old --runs 0:2,1:2,0:1 -- --recovery-steps 50 \
        --dataset paul-graham --recovery-learning-rate 1e-3
    python research/2026-12/conversion_spread.py --out runs/spread-defaults --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_runs(text: str) -> list[tuple[int, int]]:
    """``"0:2,1:2,0:1"`` -> ``[(0, 2), (1, 2), (0, 1)]`` (seed, threads)."""
    runs = []
    for item in text.split(","):
        seed, _, threads = item.strip().partition(":")
        runs.append((int(seed), int(threads or os.cpu_count() or 1)))
    return runs


def run_folder(out: Path, seed: int, threads: int) -> Path:
    return out / f"seed{seed}_threads{threads}"


def convert(folder: Path, seed: int, threads: int, flags: list[str]) -> None:
    """One conversion in a subprocess with ``threads`` threads; its output in ``folder.log``, its time recorded."""
    if (folder / "convert.json").is_file():
        return
    if folder.exists():
        raise SystemExit(f"{folder} holds an unfinished run: remove it, or resume it by hand with --resume.")
    command = [sys.executable, "-m", "hf_knorm.cli", "convert", "--out", str(folder), "--seed", str(seed), *flags]
    environment = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    started = time.time()
    with open(f"{folder}.log", "w") as log:
        result = subprocess.run(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}); see {folder}.log")
    (folder / "wall_seconds.json").write_text(json.dumps({"seconds": time.time() - started, "threads": threads}))


def spread(values: list[float]) -> dict:
    """Median, range and the largest relative deviation from the median."""
    median = statistics.median(values)
    return {"values": values, "median": median, "min": min(values), "max": max(values),
            "max_deviation": max(abs(value - median) / median for value in values)}


def finished_run(folder: Path) -> tuple[dict, dict] | None:
    """A finished run's figures (held-out sets, worst ratio, probe, seconds, recovery gradient norms) and its whole
    ``convert.json``; ``None`` for a run that has not finished."""
    path = folder / "convert.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    wall = folder / "wall_seconds.json"
    figures = {
        "domains": {name: {"perplexity": record["perplexity"], "ratio": record["ratio_to_original"]}
                    for name, record in summary["evaluation"]["domains"].items()},
        "worst": summary["evaluation"]["ratio_to_original"],
        "probe": summary.get("probe", {}).get("agreement"),
        "seconds": json.loads(wall.read_text())["seconds"] if wall.is_file() else summary.get("seconds"),
        "grad_norms": summary["stages"].get("recovery", {}).get("grad_norms"),
    }
    return figures, summary


def gather(folders: list[Path]) -> dict:
    """Every finished run's figures, and their spread per held-out set (perplexity and ratio) and for the probe."""
    runs = {folder.name: found[0] for folder in folders if (found := finished_run(folder)) is not None}
    if not runs:
        return {"runs": {}}
    names = list(next(iter(runs.values()))["domains"])
    result = {"runs": runs, "spread": {
        name: spread([run["domains"][name]["perplexity"] for run in runs.values()]) for name in names}}
    result["spread"]["worst_ratio"] = spread([run["worst"] for run in runs.values()])
    probes = [run["probe"] for run in runs.values() if run["probe"] is not None]
    if probes:
        result["spread"]["probe_agreement"] = spread(probes)
    return result


def markdown(result: dict) -> str:
    """One row per run, then the median, range and largest deviation of every column."""
    runs = result["runs"]
    if not runs:
        return "(no finished run)"
    names = list(next(iter(runs.values()))["domains"])
    header = ["run", *names, "worst / original", "probe", "minutes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run_name, run in runs.items():
        cells = [f"{run['domains'][name]['perplexity']:.4g} ({run['domains'][name]['ratio']:.2f}x)" for name in names]
        probe = f"{run['probe']:.0%}" if run["probe"] is not None else "-"
        minutes = f"{run['seconds'] / 60:.1f}" if run["seconds"] else "-"
        lines.append(f"| {run_name} | " + " | ".join(cells) + f" | {run['worst']:.2f}x | {probe} | {minutes} |")
    spreads = result["spread"]
    cells = [f"{spreads[name]['median']:.4g} [{spreads[name]['min']:.4g}-{spreads[name]['max']:.4g}], "
             f"±{spreads[name]['max_deviation']:.0%}" for name in names]
    worst = spreads["worst_ratio"]
    probe = spreads.get("probe_agreement")
    lines.append("| median [range], largest deviation | " + " | ".join(cells)
                 + f" | {worst['median']:.2f}x [{worst['min']:.2f}-{worst['max']:.2f}] | "
                 + (f"{probe['median']:.0%} [{probe['min']:.0%}-{probe['max']:.0%}]" if probe else "-") + " | |")
    return "\n".join(lines)


def write_report(stem: Path, record: dict, table: str) -> None:
    """``stem.json`` (the figures) and ``stem.md`` (the table), and the table printed."""
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    stem.with_suffix(".md").write_text(table + "\n")
    print(table)


def split_flags(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """The script's own arguments, and the ``hf-knorm convert`` flags after ``--``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    return argv[:argv.index("--")], argv[argv.index("--") + 1:]


def main(argv: list[str] | None = None) -> int:
    own, flags = split_flags(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="folder of the runs (one sub-folder each)")
    parser.add_argument("--runs", default="0:2,1:2,0:1", help="comma-separated SEED:THREADS (default: 0:2,1:2,0:1)")
    parser.add_argument("--report", action="store_true", help="gather the finished runs only, train nothing")
    args = parser.parse_args(own)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = parse_runs(args.runs)
    if not args.report:
        for seed, threads in runs:
            convert(run_folder(out, seed, threads), seed, threads, flags)
    result = gather([run_folder(out, seed, threads) for seed, threads in runs])
    result["flags"] = flags
    write_report(out / "spread", result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

r"""Each normalization converted at the full default budget: held-out perplexity per domain, the probe, stability.

Issue "general conversion", item 5: the recipe measured for every normalization. One ordinary ``hf-knorm convert
--normalization NAME`` per ``--normalizations`` entry, one after the other (never two at once on 2 cores), each in
its own folder (``x/16`` -> ``x_16``) with the flags after ``--`` (none: each at its own defaults, the recovery rate
by its power); then one row per normalization: the recovery's learning rate (from the run's own ``convert.json``),
the perplexity of every held-out domain against the original model, the worst of them (the headline), the ability
probe, the largest gradient norm of the recovery before and after its step 100 (a spike early is recovered from; one
late is what derails a run) and the wall time. A run whose ``convert.json`` exists is not run again, so the script
resumes; ``--report`` only gathers the folders.

Usage (docs/research/2026-12-conversion.md, "Per normalization"):
    python research/2026-12/conversion_normalizations.py --out runs/normalizations
    python research/2026-12/conversion_normalizations.py --out runs/normalizations --normalizations x/1,x^3/1 --seed 1
    python research/2026-12/conversion_normalizations.py --out runs/normalizations --report
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversion_recovery import NORMALIZATIONS, folder_name  # noqa: E402  (sibling scripts)
from conversion_spread import convert, finished_run, split_flags, write_report  # noqa: E402

LATE_STEP = 100
"""Gradient norms up to this recovery step are the early, violent part; after it a run should have settled."""


def largest_gradient_norms(grad_norms: list[list[float]] | None) -> tuple[float | None, float | None]:
    """The largest recovery gradient norm up to :data:`LATE_STEP` and after it (``[step, norm]`` pairs)."""
    grad_norms = grad_norms or []
    early = [norm for step, norm in grad_norms if step <= LATE_STEP]
    late = [norm for step, norm in grad_norms if step > LATE_STEP]
    return (max(early) if early else None), (max(late) if late else None)


def rows(out: Path, normalizations: list[str]) -> list[dict]:
    """One row per finished run: its normalization, recovery rate and :func:`conversion_spread.finished_run`'s figures."""
    table = []
    for normalization in normalizations:
        found = finished_run(out / folder_name(normalization))
        if found is None:
            continue
        run, summary = found
        settings = summary["settings"]
        early, late = largest_gradient_norms(run["grad_norms"])
        table.append({"normalization": normalization, "recovery_learning_rate": settings["recovery_learning_rate"],
                      "early_grad_norm": early, "late_grad_norm": late, **run})
    return table


def markdown(table: list[dict]) -> str:
    """The rows as a markdown table; the probe is the share of the original's answers reproduced."""
    if not table:
        return "(no finished run)"
    names = list(table[0]["domains"])
    header = ["normalization", "recovery rate", *names, "worst / original", "probe",
              f"largest gradient norm, steps 1-{LATE_STEP} / after", "minutes"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for row in table:
        cells = [f"{row['domains'][name]['perplexity']:.4g} ({row['domains'][name]['ratio']:.2f}x)" for name in names]
        probe = f"{row['probe']:.1%}" if row["probe"] is not None else "-"
        norms = " / ".join("-" if norm is None else f"{norm:.3g}" for norm in (row["early_grad_norm"], row["late_grad_norm"]))
        minutes = f"{row['seconds'] / 60:.1f}" if row["seconds"] else "-"
        lines.append(f"| `{row['normalization']}` | {row['recovery_learning_rate']:g} | " + " | ".join(cells)
                     + f" | {row['worst']:.2f}x | {probe} | {norms} | {minutes} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    own, flags = split_flags(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="folder of the runs (one sub-folder per normalization)")
    parser.add_argument("--normalizations", default=",".join(NORMALIZATIONS),
                        help=f"comma-separated (default: {','.join(NORMALIZATIONS)})")
    parser.add_argument("--threads", type=int, default=2, help="threads of each run (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (default: 0)")
    parser.add_argument("--report", action="store_true", help="gather the finished runs only, train nothing")
    args = parser.parse_args(own)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    normalizations = [name.strip() for name in args.normalizations.split(",") if name.strip()]
    if not args.report:
        for normalization in normalizations:
            convert(out / folder_name(normalization), args.seed, args.threads,
                    ["--normalization", normalization, *flags])
    table = rows(out, normalizations)
    write_report(out / "normalizations", {"flags": flags, "runs": table}, markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

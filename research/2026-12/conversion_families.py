r"""Which of the field's families a pretrained model accepts: each converted on its own, without a softmax window.

Issue 67, item 5. One ordinary ``hf-knorm convert --normalization F --softmax-window 0`` per family and seed (the
default budget: 25 transfer steps, 150 LoRA recovery steps on 512-token blocks), one after the other (never two at
once on 2 cores), each in its own folder (``FOLDER_s{seed}``, :data:`FAMILIES`); then one row per run: the held-out
perplexity of every domain against the original model (512-token blocks, the training's; the worst is the
headline), the ability probe (agreement with the original's 40 greedy answers; with their first tokens; the cloze
answers right), the worst domain in 1,024-token blocks scored from position 256 (``beyond_window`` in
``convert.json``: with no window, perplexity past the training's length), the passkeys at 1,000 and 2,000 tokens
against the original's, and each run's ``||A||_F / sqrt(N)`` at the recovery's last logging step (the median over
layers; at most 1 for softmax); for a family with several seeds, the median and range of each figure; and one
figure, the recovery's per-layer ``||A||_F`` curves of every run (``NormLoggerCallback``'s ``norms.jsonl``). A run
whose ``convert.json`` exists is not run again, so the script resumes; ``--report`` only gathers the folders.

A family with learned values (a sink logit, SSMax's scale, a sigmoid's bias) gets them read from the converted
model's weights (:func:`learned_values`, ``learned_values.json``: the median and range over layers and heads): the
column that shows whether the conversion moved them (runs before 2026-12-07 did not: docs/results/conversion.md).

Each finished run's ``convert.json``, ``wall_seconds.json``, ``learned_values.json`` and ``recovery/norms.jsonl`` (a
few hundred KB, no weights) are copied into :data:`ARCHIVE` (or ``--archive``), committed, and a report reads a run
from there where ``--out`` lacks it: the seeds of one family can be run in different sessions, on machines that keep
nothing between them. The runs whose learned values stayed at their initial values (before 2026-12-07) are kept in
``frozen_values/`` beside them, read with ``--archive`` (docs/results/conversion.md, "The first runs").

Usage (docs/results/conversion.md, "The families a pretrained model accepts"):
    python research/2026-12/conversion_families.py --out runs/families
    python research/2026-12/conversion_families.py --out runs/families --families ssmax,sink_softmax --seed 1
    python research/2026-12/conversion_families.py --out runs/families --report --seeds 0,1,2
    python research/2026-12/conversion_families.py --out runs/families_frozen --report --families ssmax,sink_softmax \
        --seeds 1,2 --archive research/2026-12/data/conversion_families/frozen_values
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversion_spread import convert, finished_run, spread, write_report  # noqa: E402  (sibling script)

ARCHIVE = Path(__file__).resolve().parent / "data" / "conversion_families"
"""Where each finished run's figures and norm history are kept, committed (one folder per run, as in ``--out``)."""
LEARNED_VALUES = "learned_values.json"
ARCHIVED = ("convert.json", "wall_seconds.json", LEARNED_VALUES, "recovery/norms.jsonl")

FAMILIES = {
    "sigmoid_logn": "sigmoid(bias=-log n)",
    "sigmoid_learned": "sigmoid(bias=learned)",
    "sink_softmax": "softmax(sink=learned)",
    "softpick": "softpick",
    "ssmax": "ssmax(scale=learned)",
    "relu2": "relu(x)^2/n",
    "stick_breaking": "stick-breaking",
    "x3_16": "x^3/16",
}
"""Folder name -> the family's spelling (``hf-knorm --help``), in the issue's order."""


def run_folder(out: Path, name: str, seed: int, archive_folder: Path = ARCHIVE) -> Path:
    """The run's folder under ``out``, or its copy in ``archive_folder`` where ``out`` has no finished run."""
    folder = out / f"{name}_s{seed}"
    archived = archive_folder / folder.name
    return archived if not (folder / "convert.json").is_file() and (archived / "convert.json").is_file() else folder


def archive(folder: Path, archive_folder: Path = ARCHIVE) -> None:
    """Copy a finished run's :data:`ARCHIVED` files into ``archive_folder`` (nothing for an archived or unfinished
    run)."""
    if folder.parent == archive_folder or not (folder / "convert.json").is_file():
        return
    for name in ARCHIVED:
        if (folder / name).is_file():
            (archive_folder / folder.name / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, archive_folder / folder.name / name)


def learned_values(folder: Path) -> dict[str, dict[str, float]]:
    """``{name: {"median", "min", "max"}}`` of each learned value of the converted model in ``folder`` over its layers
    and heads (``sink``, ``scale``, ``bias``; ``{}`` for a family without one), read from its weights once and kept in
    :data:`LEARNED_VALUES` (an archived run has that file and no weights)."""
    kept = folder / LEARNED_VALUES
    if kept.is_file():
        return json.loads(kept.read_text())
    if not (folder / "model.safetensors").is_file():
        return {}
    import torch
    from safetensors.torch import load_file

    from hf_knorm.conversion.learned_values import is_family_value
    from hf_knorm.normalizations.base import PARAMETER_PREFIX

    by_name: dict[str, list[torch.Tensor]] = {}
    for key, tensor in load_file(str(folder / "model.safetensors")).items():
        if is_family_value(key):
            by_name.setdefault(key.rsplit(".", 1)[-1][len(PARAMETER_PREFIX):], []).append(tensor.float().flatten())
    values = {}
    for name, found in sorted(by_name.items()):
        every = torch.cat(found)
        values[name] = {"median": every.median().item(), "min": every.min().item(), "max": every.max().item()}
    kept.write_text(json.dumps(values, indent=1))
    return values


def recovery_norm(folder: Path) -> float | None:
    """The median over layers of ``||A||_F / sqrt(N)`` at the recovery's last logging step (``None``: no history)."""
    from hf_knorm.training.history import read_norm_history

    try:
        history = read_norm_history(folder / "recovery")
    except FileNotFoundError:
        return None
    return statistics.median(layer["attn_fro_sqrtn"] for layer in history[-1]["layers"]) if history else None


def rows(out: Path, names: list[str], seeds: list[int], archive_folder: Path = ARCHIVE) -> list[dict]:
    """One row per finished run: the family, the seed, :func:`conversion_spread.finished_run`'s figures, the
    beyond-window worst ratio, the passkeys and the recovery's last norm."""
    table = []
    for name in names:
        for seed in seeds:
            folder = run_folder(out, name, seed, archive_folder)
            found = finished_run(folder)
            if found is None:
                continue
            values = learned_values(folder)  # written into the folder first, so the archive keeps it
            archive(folder, archive_folder)
            run, summary = found
            beyond = summary.get("beyond_window", {})
            passkey = {who: beyond.get("retrieval", {}).get(who, {}).get("passkey", {}) for who in ("converted",
                                                                                                   "original")}
            probe = {key: value for key, value in summary.get("probe", {}).items() if key != "answers"}
            table.append({"family": FAMILIES[name], "seed": seed, "folder": str(folder), **run, "probe_detail": probe,
                          "beyond_worst": beyond.get("worst_ratio"), "passkey": passkey,
                          "recovery_attn_fro_sqrtn": recovery_norm(folder), "learned_values": values})
    return table


def markdown(table: list[dict]) -> str:
    """The rows as a markdown table (perplexities as ratios to the original's)."""
    if not table:
        return "(no finished run)"
    names = list(table[0]["domains"])
    lengths = sorted({length for row in table for length in row["passkey"]["converted"]}, key=int)
    header = ["family", "seed", *names, "worst", "probe (first token; cloze)", "1,024-token blocks, worst",
              f"passkey {', '.join(lengths)} (original)", "Frobenius norm of A / sqrt(N), end of recovery",
              "learned values at the end", "minutes"]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * (len(header) - 2)]
    for row in table:
        cells = [f"{row['domains'][name]['ratio']:.2f}x" for name in names]
        hits = lambda who: ", ".join(  # noqa: E731
            "/".join(map(str, row["passkey"][who].get(length, ["-", "-"]))) for length in lengths)
        detail = row["probe_detail"]
        probe = "-" if row["probe"] is None else (f"{row['probe']:.1%} ({detail['first_token_agreement']:.1%}; "
                                                  f"{detail['cloze_accuracy']:.0%})")
        beyond = "-" if row["beyond_worst"] is None else f"{row['beyond_worst']:.2f}x"
        norm = "-" if row["recovery_attn_fro_sqrtn"] is None else f"{row['recovery_attn_fro_sqrtn']:.3f}"
        minutes = "-" if not row["seconds"] else f"{row['seconds'] / 60:.1f}"
        learned = "; ".join(f"{name} {found['median']:.3g} [{found['min']:.3g} to {found['max']:.3g}]"
                            for name, found in row["learned_values"].items()) or "-"
        lines.append(f"| `{row['family']}` | {row['seed']} | " + " | ".join(cells)
                     + f" | {row['worst']:.2f}x | {probe} | {beyond} | {hits('converted')} ({hits('original')}) | "
                     f"{norm} | {learned} | {minutes} |")
    return "\n".join(lines)


def spread_markdown(table: list[dict]) -> str:
    """For each family with several seeds: the median [range] of the worst domain, the 1,024-token blocks' worst and
    the probe, and the passkeys found over all seeds (``""`` when no family has two)."""
    families: dict[str, list[dict]] = {}
    for row in table:
        families.setdefault(row["family"], []).append(row)
    lines = ["| family | seeds | worst | 1,024-token blocks, worst | probe | passkeys found (original) |",
             "|---|---:|---:|---:|---:|---:|"]
    for family, runs in families.items():
        if len(runs) < 2:
            continue
        cells = []
        for key, form in (("worst", "{:.2f}x"), ("beyond_worst", "{:.2f}x"), ("probe", "{:.1%}")):
            values = [run[key] for run in runs if run[key] is not None]
            found = spread(values) if values else None
            cells.append("-" if found is None else
                         f"{form.format(found['median'])} [{form.format(found['min'])}-{form.format(found['max'])}]")
        hits = {who: [sum(pair[0] for pair in run["passkey"][who].values()) for run in runs] for who in
                ("converted", "original")}
        total = {who: sum(sum(pair[1] for pair in run["passkey"][who].values()) for run in runs) for who in hits}
        cells.append(f"{sum(hits['converted'])}/{total['converted']} ({sum(hits['original'])}/{total['original']})")
        lines.append(f"| `{family}` | {', '.join(str(run['seed']) for run in runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def figure(table: list[dict], path: Path) -> Path | None:
    """The recovery's per-layer ``||A||_F`` of every run, one line each (seed 0 of each family where it has more)."""
    from hf_knorm.training.norm_figure import plot_norm_history

    chosen = {}
    for row in table:
        if (Path(row["folder"]) / "recovery" / "norms.jsonl").is_file():
            chosen.setdefault(row["family"], row)
    if not chosen:
        return None
    return plot_norm_history([Path(row["folder"]) / "recovery" for row in chosen.values()], path,
                             labels=[f"{family} (seed {row['seed']})" for family, row in chosen.items()],
                             title="||A||_F per layer during the recovery, each family converted without a window")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="folder of the runs (one sub-folder per family and seed)")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated folder names (default: {','.join(FAMILIES)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the runs to train (default: 0)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds to report (default: --seed)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each run (default: 2)")
    parser.add_argument("--report", action="store_true", help="gather the finished runs only, train nothing")
    parser.add_argument("--figure", default=None, help="the norms figure (default: OUT/recovery_norms.png)")
    parser.add_argument("--archive", default=str(ARCHIVE), type=Path,
                        help="where finished runs are archived and read back from where OUT lacks them\n"
                             "(default: research/2026-12/data/conversion_families; the runs whose learned values\n"
                             "never trained: its frozen_values folder)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [name.strip() for name in args.families.split(",") if name.strip()]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    if not args.report:
        for name in names:
            folder = run_folder(out, name, args.seed, args.archive)
            if folder.parent != args.archive:
                convert(folder, args.seed, args.threads, ["--normalization", FAMILIES[name], "--softmax-window", "0"])
                archive(folder, args.archive)
    seeds = [int(seed) for seed in (args.seeds or str(args.seed)).split(",")]
    table = rows(out, names, seeds, args.archive)
    figure(table, Path(args.figure) if args.figure else out / "recovery_norms.png")
    spreads = spread_markdown(table)
    write_report(out / "families", {"runs": table}, markdown(table) + (f"\n\n{spreads}" if spreads else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

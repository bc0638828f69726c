"""Benchmark: ``hf-knorm finetune`` of the default model in 2 processes against 1 process with the same global batch.

Two runs in a row, same settings and seed: (A) one process, ``--gradient-accumulation-steps 2``, all the machine's
threads; (B) ``torchrun --nproc-per-node 2``, one thread each (gloo on the CPU), each process half the global batch.
Reports each step's training loss in both (they should agree: the same blocks, the same global batch) and each
job's wall time (model loading and the held-out evaluations at the start and the end included, the same in both).

Usage:
    python scripts/training/bench_processes.py                     # 10 steps of 2 x 2 x 256 tokens, x^3/16
    python scripts/training/bench_processes.py --steps 20 --normalization softmax
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def finetune(out: Path, flags: list[str], processes: int, threads: int) -> dict:
    """Run the job; returns ``{"losses": {step: loss}, "seconds": wall time}`` (losses from its last checkpoint)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = (launcher if processes > 1 else [sys.executable]) + ["-m", "hf_knorm.cli", "finetune", "--out", str(out),
                                                                   *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"finetune in {processes} process(es) failed:\n{result.stderr[-3000:]}")
    checkpoint = max(out.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {"losses": {entry["step"]: entry["loss"] for entry in history if "loss" in entry}, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--normalization", default="x^3/16")
    parser.add_argument("--block-size", type=int, default=256)
    args = parser.parse_args()
    threads = os.cpu_count() or 2
    flags = ["--dataset", "paul-graham", "--normalization", args.normalization, "--block-size", str(args.block_size),
             "--max-steps", str(args.steps), "--logging-steps", "1", "--eval-steps", str(args.steps), "--eval-tokens",
             "512", "--save-steps", str(args.steps), "--batch-size", "2", "--report-to", "none"]
    with tempfile.TemporaryDirectory() as folder:
        one = finetune(Path(folder) / "one", [*flags, "--gradient-accumulation-steps", "2"], 1, threads)
        two = finetune(Path(folder) / "two", flags, 2, 1)
    print(f"hf-knorm finetune, default model, {args.normalization}, {args.steps} steps of 4 x {args.block_size} tokens "
          f"(global batch), {threads} CPU threads in all")
    print("| step | 1 process, accumulation 2: loss | 2 processes (torchrun, gloo): loss | relative difference |")
    print("|---|---:|---:|---:|")
    for step, loss in sorted(one["losses"].items()):
        print(f"| {step} | {loss:.8g} | {two['losses'][step]:.8g} | {abs(two['losses'][step] - loss) / loss:.1e} |")
    print(f"\nwall time (loading and the start and end evaluations included): 1 process {one['seconds']:.0f} s, "
          f"2 processes {two['seconds']:.0f} s ({one['seconds'] / two['seconds']:.2f}x the speed)")


if __name__ == "__main__":
    main()

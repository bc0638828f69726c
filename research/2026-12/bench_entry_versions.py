"""Benchmark: this checkout against an earlier commit where users call the attention: the default model patched with
each normalization, its forward on a left-padded batch (the mask Transformers builds from the tokenizer's
attention_mask) and ``generate`` (its own cache), timed in fresh processes, the two versions interleaved.

The earlier commit is checked out into a temporary ``git worktree`` (removed at the end); each repeat runs one process
per version, in alternating order, each importing its own ``hf_knorm`` and timing every normalization once after a
warm-up. Reported: the median over the repeats per version, with the range, and the ratio this / earlier (below 1:
this checkout is faster).

Usage:
    OMP_NUM_THREADS=2 python research/2026-12/bench_entry_versions.py --base 54d50c5 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # research/2026-12/ -> the repository
NORMALIZATIONS = ("softmax", "x^3/16", "x^3/16 + softmax window 64 + sinks 4", "x/1 + softmax window 64 + sinks 4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--normalizations", default=",".join(NORMALIZATIONS), help="';'-separated spellings")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the longer sequence of the forward's batch")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generate adds to a prompt of --tokens / 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    spellings = [s.strip() for s in args.normalizations.replace(",", ";").split(";") if s.strip()]
    if args.worker:
        print(json.dumps(_time_entries(spellings, args.tokens, args.new_tokens)))
        return
    with tempfile.TemporaryDirectory() as folder:
        earlier = Path(folder) / "earlier"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(earlier), args.base], cwd=ROOT, check=True)
        try:
            runs = {"earlier": [], "this": []}
            for repeat in range(args.repeats):
                order = [("earlier", earlier), ("this", ROOT)]
                for name, tree in order if repeat % 2 == 0 else order[::-1]:
                    runs[name].append(_worker(tree, args))
                    print(f"repeat {repeat + 1}/{args.repeats}: {name} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(earlier)], cwd=ROOT, check=True)
    _report(runs, args)


def _worker(tree: Path, args) -> dict:
    """One process importing ``tree``'s hf_knorm: ``{"<spelling> / forward": seconds, ...}``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--base", args.base, "--normalizations",
               ";".join(s for s in args.normalizations.replace(",", ";").split(";")), "--tokens", str(args.tokens),
               "--new-tokens", str(args.new_tokens)]
    environment = dict(os.environ, PYTHONPATH=str(tree))
    result = subprocess.run(command, cwd=tree, env=environment, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _time_entries(spellings: list[str], tokens: int, new_tokens: int) -> dict:
    import torch

    import hf_knorm
    from hf_knorm.assets.default_model import load_default_model
    from hf_knorm.assets.texts import paul_graham_essays

    model, tokenizer = load_default_model()
    model.eval()
    ids = tokenizer("\n\n".join(paul_graham_essays()[:3]), return_tensors="pt").input_ids[0, :tokens]
    batch, mask = torch.stack([ids, ids]), torch.ones(2, tokens, dtype=torch.long)
    mask[1, : tokens // 4] = 0  # left padding in the second row
    prompt = ids[None, : tokens // 2]
    entries = {
        "forward": lambda: model(input_ids=batch, attention_mask=mask),
        "generate": lambda: model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           pad_token_id=tokenizer.eos_token_id),
    }
    times = {}
    for spelling in spellings:
        hf_knorm.patch(model, spelling)
        with torch.no_grad():
            for entry, call in entries.items():
                call()  # warm-up
                start = time.perf_counter()
                call()
                times[f"{spelling} / {entry}"] = time.perf_counter() - start
        hf_knorm.unpatch(model)
    return times


def _report(runs: dict, args) -> None:
    print(f"{args.tokens}-token left-padded batch of 2 (forward); generate: {args.new_tokens} tokens after "
          f"{args.tokens // 2}; medians over {args.repeats} interleaved processes per version [range]\n")
    print(f"| normalization / entry | {args.base} | this checkout | ratio |")
    print("|---|---:|---:|---:|")
    for key in runs["this"][0]:
        earlier = [run[key] for run in runs["earlier"]]
        this = [run[key] for run in runs["this"]]
        cell = lambda values: f"{statistics.median(values):.2f} s [{min(values):.2f}-{max(values):.2f}]"  # noqa: E731
        print(f"| {key} | {cell(earlier)} | {cell(this)} | "
              f"{statistics.median(this) / statistics.median(earlier):.3f}x |")


if __name__ == "__main__":
    main()

"""Benchmark: the quadratic PyTorch kernel (``hf_knorm/attention/kernel.py``) of this checkout against the one of an
earlier commit, in the same process, on the same tensors.

The earlier kernel and its ``normalizations.py`` are read with ``git show REV:...`` into a temporary package, so no
checkout changes. ``x^3/16``, B = 1, 9 heads, head dim 64, fp32, causal: with no mask (the implicit causal mask) and
with an explicit ``(1, 1, N, N)`` bool mask; forward and forward+backward; medians of ``--repeats`` interleaved calls
after a warm-up, one torch thread. A ratio below 1 means this checkout is faster.

Usage:
    python research/2026-12/bench_kernel_versions.py --base 1b59e93 --lengths 4096,8192
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.normalizations import parse_normalization

ROOT = Path(__file__).resolve().parents[2]  # research/2026-12/ -> the repository


def earlier_kernel(revision: str, folder: Path):
    """``(chunked_attention, parse_normalization)`` of ``revision``, imported from ``folder``."""
    package = folder / "earlier_attention"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("kernel.py", "normalizations.py"):
        text = subprocess.run(["git", "show", f"{revision}:hf_knorm/attention/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (package / name).write_text(text)
    sys.path.insert(0, str(folder))
    kernel = importlib.import_module("earlier_attention.kernel")
    normalizations = importlib.import_module("earlier_attention.normalizations")
    return kernel.chunked_attention, normalizations.parse_normalization


def median_seconds(kernels: dict, length: int, masked: bool, backward: bool, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(1, 9, length, 64, generator=generator) * 0.5).requires_grad_(backward) for _ in range(3))
    mask = torch.ones(1, 1, length, length, dtype=torch.bool).tril() if masked else None
    times = {name: [] for name in kernels}
    for _ in range(repeats + 1):
        for name, (attention, normalization) in kernels.items():
            q.grad = k.grad = v.grad = None
            start = time.perf_counter()
            with torch.set_grad_enabled(backward):
                output, _ = attention(q, k, v, mask, normalization, causal=True)
                if backward:
                    output.sum().backward()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the earlier commit whose kernel to time against")
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        attention, parse = earlier_kernel(args.base, Path(folder))
        kernels = {args.base: (attention, parse("x^3/16")), "this checkout": (chunked_attention,
                                                                              parse_normalization("x^3/16"))}
        print(f"x^3/16, B=1, 9 heads, head_dim 64, fp32, causal, 1 thread, median of {args.repeats} after a warm-up")
        print(f"| N | mask | pass | {args.base} | this checkout | ratio |")
        print("|---|---|---|---|---|---|")
        for length in (int(n) for n in args.lengths.split(",")):
            for masked in (False, True):
                for backward in (False, True):
                    seconds = median_seconds(kernels, length, masked, backward, args.repeats)
                    old, new = seconds[args.base], seconds["this checkout"]
                    print(f"| {length} | {'explicit' if masked else 'implicit causal'} | "
                          f"{'fwd+bwd' if backward else 'fwd'} | {old:.3f} s | {new:.3f} s | {new / old:.3f}x |",
                          flush=True)


if __name__ == "__main__":
    main()

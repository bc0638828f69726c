"""Benchmark: ``x/1`` on the linear path against torch SDPA softmax and against the quadratic kernel, in one run.

The SmolLM2-135M attention layer: B=1, 9 query heads over 3 KV heads (GQA), head_dim 64, causal. For each sequence
length N, the forward pass without gradients (prefill) and forward+backward (training) of three implementations on the
same tensors: SDPA (``enable_gqa=True``), the plugin's quadratic kernel computing ``x/1`` (``kernel.py``) and the
linear path (``linear_kernel.py``). Times are medians of interleaved repeats (one repeat from 16k on), reported with
their ratio to SDPA: the issue's targets are about ratios and about the growth from 16k to 32k (linear: 2x; quadratic:
4x); ``--growth`` times the linear path alone, with repeats, up to 64k. ``--chunk-sizes`` first times the linear path's chunk sizes at one length; ``--crossover`` times the linear and
the quadratic paths on short prompts (where ``LINEAR_MIN_QUERIES`` comes from).

Usage:
    python scripts/attention/bench_linear_attention.py --lengths 1024,2048,4096,8192,16384,32768 --figure docs/figures/linear/layer.png
    python scripts/attention/bench_linear_attention.py --crossover 64,128,256,512,1024 --chunk-sizes 32,64,128,256
    python scripts/attention/bench_linear_attention.py --growth 8192,16384,32768,65536 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.attention.linear_kernel import linear_attention
from hf_knorm.normalizations import parse_normalization
from hf_knorm.plots import plot_scaling

X1 = parse_normalization("x/1")
IMPLEMENTATIONS = ("sdpa", "quadratic x/1", "linear x/1")
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def make_inputs(length: int, grad: bool, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, Q_HEADS, length, HEAD_DIM), (1, KV_HEADS, length, HEAD_DIM), (1, KV_HEADS, length, HEAD_DIM)]
    return [(torch.randn(shape, generator=generator, dtype=dtype) * 0.5).requires_grad_(grad) for shape in shapes]


def run_once(implementation: str, q, k, v, backward: bool, chunk_size: int | None = None) -> None:
    if implementation == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    elif implementation == "quadratic x/1":
        out, _ = chunked_attention(q, k, v, None, X1, causal=True)
    else:
        options = {} if chunk_size is None else {"chunk_size": chunk_size}
        out = linear_attention(q, k, v, None, X1, **options)
    if backward:
        out.sum().backward()


def median_seconds(length: int, backward: bool, repeats: int, implementations=IMPLEMENTATIONS,
                   chunk_sizes=(None,)) -> dict:
    """Median seconds per (implementation, chunk size); repeats interleaved across them to share the noise."""
    q, k, v = make_inputs(length, grad=backward)
    cases = [(name, chunk) for name in implementations for chunk in (chunk_sizes if name == "linear x/1" else (None,))]
    times = {case: [] for case in cases}
    warm_up = length < 16384 or implementations == ("linear x/1",)  # long quadratic cases: no warm-up round
    for _ in range(repeats + warm_up):
        for case in cases:
            q.grad = k.grad = v.grad = None
            start = time.perf_counter()
            with torch.set_grad_enabled(backward):
                run_once(*case[:1], q, k, v, backward, case[1])
            times[case].append(time.perf_counter() - start)
    return {case: statistics.median(values[warm_up:]) for case, values in times.items()}


def layer_table(lengths: list[int], repeats: int) -> list[dict]:
    print("| N | pass | SDPA | quadratic x/1 (ratio) | linear x/1 (ratio) | linear: quadratic |")
    print("|---|---|---|---|---|---|")
    rows = []
    for length in lengths:
        for backward in (False, True):
            times = median_seconds(length, backward, repeats if length < 16384 else 1)
            sdpa, quadratic, linear = (times[(name, None)] for name in IMPLEMENTATIONS)
            rows.append(dict(length=length, backward=backward, sdpa=sdpa, quadratic=quadratic, linear=linear))
            print(f"| {length} | {'fwd+bwd' if backward else 'fwd'} | {sdpa * 1e3:.0f} ms | {quadratic * 1e3:.0f} ms "
                  f"({quadratic / sdpa:.2f}x) | {linear * 1e3:.0f} ms ({linear / sdpa:.3f}x) | {linear / quadratic:.3f} |",
                  flush=True)
    return rows


def growth(rows: list[dict], small: int, large: int) -> None:
    """Print how each implementation's time grows from ``small`` to ``large`` tokens."""
    by = {(row["length"], row["backward"]): row for row in rows}
    for backward in (False, True):
        if (small, backward) in by and (large, backward) in by:
            cells = [f"{name} {by[(large, backward)][name] / by[(small, backward)][name]:.2f}x"
                     for name in ("sdpa", "quadratic", "linear")]
            print(f"growth {small} -> {large} ({'fwd+bwd' if backward else 'fwd'}): " + ", ".join(cells))


def plot(rows: list[dict], path: str) -> None:
    curves = {}
    for backward in (False, True):
        picked = [row for row in rows if row["backward"] == backward]
        lengths = [row["length"] for row in picked]
        curves[backward] = [(label, lengths, [row[key] for row in picked]) for key, label in
                            (("sdpa", "SDPA softmax"), ("quadratic", "x/1, quadratic kernel"), ("linear", "x/1, linear path"))]
    plot_scaling([("forward (prefill)", "seconds", curves[False]), ("forward + backward", "seconds", curves[True])],
                 path, xlabel="tokens N",
                 title=f"One SmolLM2-135M attention layer ({Q_HEADS} query / {KV_HEADS} KV heads, d={HEAD_DIM}), CPU fp32")
    print(f"figure: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="", help="N for the table, comma-separated")
    parser.add_argument("--crossover", default="", help="short N at which to time linear against quadratic (forward)")
    parser.add_argument("--growth", default="",
                        help="N at which to time the linear path alone (median of --repeats after a warm-up), for its "
                        "growth with N")
    parser.add_argument("--chunk-sizes", default="", help="linear-path chunk sizes to time at --chunk-length")
    parser.add_argument("--chunk-length", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared 2-core machine, multi-threaded ops wait on "
                        "descheduled threads and the timings measure the load, not the code)")
    parser.add_argument("--figure", help="draw time against N for the table")
    parser.add_argument("--json", help="also write the table's rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU fp32, B=1, {Q_HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, causal; torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, median of {args.repeats} (1 from 16k on)")
    if args.chunk_sizes:
        sizes = tuple(int(n) for n in args.chunk_sizes.split(","))
        for backward in (False, True):
            times = median_seconds(args.chunk_length, backward, args.repeats, ("linear x/1",), sizes)
            cells = ", ".join(f"C={chunk}: {seconds * 1e3:.0f} ms" for (_, chunk), seconds in times.items())
            print(f"chunk sizes at N={args.chunk_length} ({'fwd+bwd' if backward else 'fwd'}): {cells}")
    if args.crossover:
        for length in (int(n) for n in args.crossover.split(",")):
            times = median_seconds(length, False, max(args.repeats, 5), IMPLEMENTATIONS[1:])
            quadratic, linear = times[("quadratic x/1", None)], times[("linear x/1", None)]
            print(f"crossover N={length}: quadratic {quadratic * 1e3:.2f} ms, linear {linear * 1e3:.2f} ms "
                  f"(linear/quadratic {linear / quadratic:.2f})", flush=True)
    if args.growth:
        previous = None
        for length in (int(n) for n in args.growth.split(",")):
            seconds = [median_seconds(length, backward, args.repeats, ("linear x/1",))[("linear x/1", None)]
                       for backward in (False, True)]
            growth_cells = "" if previous is None else (
                f" (x{seconds[0] / previous[0]:.2f}, x{seconds[1] / previous[1]:.2f} from the previous N)")
            print(f"linear path N={length}: fwd {seconds[0] * 1e3:.0f} ms, fwd+bwd {seconds[1] * 1e3:.0f} ms"
                  f"{growth_cells}", flush=True)
            previous = seconds
    if args.lengths:
        rows = layer_table([int(n) for n in args.lengths.split(",")], args.repeats)
        growth(rows, 16384, 32768)
        if args.figure:
            plot(rows, args.figure)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()

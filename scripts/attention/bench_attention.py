"""Benchmark: the plugin's polynomial attention against torch SDPA softmax, on the same tensors, in the same run.

For each sequence length N: B=1, 9 heads, head_dim 64, causal. Measures forward time (no grad), forward+backward
time, and the peak memory each adds on top of its inputs (CPU: the process's peak resident set, reset before each
measurement and taken in a fresh subprocess per case, with glibc's mmap threshold fixed so that freed blocks go back
to the system at once; CUDA: ``torch.cuda.max_memory_allocated``). Times are medians
of interleaved repeats, reported with their ratio to SDPA, which is what the targets are about:

- peak memory linear in N, and at N = 8192 at most 2x SDPA's;
- forward time at N = 4096 within 2x of SDPA's.

Usage:
    python scripts/attention/bench_attention.py                          # CPU, fp32, N in 1024..8192
    python scripts/attention/bench_attention.py --device cuda --dtype bf16 --lengths 1024,4096,16384,32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.normalizations import parse_normalization

IMPLEMENTATIONS = ("sdpa", "x^3/16", "x^3/sqrtN")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(length: int, device: str, dtype: torch.dtype, grad: bool, heads: int = 9, dim: int = 64):
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (1, heads, length, dim)
    return [torch.randn(shape, generator=generator, device=device, dtype=dtype).requires_grad_(grad) for _ in range(3)]


def run_once(implementation: str, q, k, v, backward: bool) -> None:
    """One forward (and backward) pass."""
    if implementation == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out, _ = chunked_attention(q, k, v, None, parse_normalization(implementation), causal=True)
    if backward:
        out.sum().backward()


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_peak_memory(implementation: str, length: int, device: str, dtype: torch.dtype, backward: bool) -> int:
    """Bytes of peak memory the pass adds on top of its inputs."""
    q, k, v = make_inputs(length, device, dtype, grad=backward)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        run_once(implementation, q, k, v, backward)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - baseline
    baseline = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM to the current RSS
        handle.write("5")
    run_once(implementation, q, k, v, backward)
    return (_rss_kib("VmHWM") - baseline) * 1024


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_in_subprocess(implementation: str, length: int, device: str, dtype: str, backward: bool) -> int:
    """Run :func:`measure_peak_memory` in a fresh process, so earlier cases leave no high-water mark behind."""
    command = [sys.executable, __file__, "--threads", str(torch.get_num_threads()),
               "--measure-memory", json.dumps([implementation, length, device, dtype, backward])]
    # A fixed mmap threshold makes glibc return freed blocks at once, so the resident set tracks live tensors
    # instead of whatever the allocator keeps cached (the same rule for every implementation).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return int(result.stdout.strip().splitlines()[-1])


def median_times(length: int, device: str, dtype: torch.dtype, backward: bool, repeats: int) -> dict[str, float]:
    """Median seconds per implementation; repeats are interleaved across implementations to share the noise."""
    q, k, v = make_inputs(length, device, dtype, grad=backward)
    times = {name: [] for name in IMPLEMENTATIONS}
    for name in IMPLEMENTATIONS:  # warm-up
        run_once(name, q, k, v, backward)
    for _ in range(repeats):
        for name in IMPLEMENTATIONS:
            q.grad = k.grad = v.grad = None
            _synchronize(device)
            start = time.perf_counter()
            with torch.set_grad_enabled(backward):
                run_once(name, q, k, v, backward)
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared 2-core machine, multi-threaded ops wait on "
                        "descheduled threads and the timings measure the load, not the code)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--measure-memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_memory:
        torch.set_num_threads(args.threads)
        implementation, length, device, dtype, backward = json.loads(args.measure_memory)
        print(measure_peak_memory(implementation, length, device, DTYPES[dtype], backward))
        return

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(f"device={args.device} dtype={args.dtype} B=1 heads=9 head_dim=64 causal, torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, median of {args.repeats}")
    header = "| N | pass | SDPA time | x^3/16 time (ratio) | x^3/sqrtN time (ratio) | SDPA peak MiB | x^3/16 peak MiB (ratio) | x^3/sqrtN peak MiB (ratio) |"
    print(header)
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        for backward in (False, True):
            times = median_times(length, args.device, dtype, backward, args.repeats)
            memory = {name: memory_in_subprocess(name, length, args.device, args.dtype, backward) for name in IMPLEMENTATIONS}
            rows.append(dict(length=length, backward=backward, times=times, memory=memory))
            cells = [str(length), "fwd+bwd" if backward else "fwd", f"{times['sdpa'] * 1e3:.0f} ms"]
            cells += [f"{times[n] * 1e3:.0f} ms ({times[n] / times['sdpa']:.2f}x)" for n in IMPLEMENTATIONS[1:]]
            cells.append(f"{memory['sdpa'] / 2**20:.0f}")
            cells += [f"{memory[n] / 2**20:.0f} ({memory[n] / max(memory['sdpa'], 1):.2f}x)" for n in IMPLEMENTATIONS[1:]]
            print("| " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()

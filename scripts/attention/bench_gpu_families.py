"""Every family's fused path against SDPA flash, in one run: time, peak memory, compile warm-up and bf16 error.

Issue 64's measurement, a part of ``make device-check`` (``scripts/device_check.py`` calls :func:`rows`). Per layer
shape (SmolLM2-135M: 9 query / 3 KV heads, head dim 64; Llama-3-8B: 32 / 8, head dim 128), per length (4k, 16k, 32k on
CUDA; 256 on the CPU), batch 1, causal, bf16 on CUDA (fp32 on the CPU):

- **SDPA flash** (``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` under the flash backend on
  CUDA; PyTorch's default on the CPU): forward and forward+backward, the median of 3 after a warm-up; peak memory of
  the forward+backward.
- **each family** (the first example of each registered family and each learned one): the kernel the automatic
  choice gives a plain causal call (``backends.with_kernel``, the self-check included), run as the attention entry
  runs it (``backends.run_quadratic``, the mask as key padding, the learned values at their initial values with
  gradients): the first call's time, which holds the compile warm-up (Inductor compiling FlexAttention's kernels for
  the shape and family, Triton's JIT) and is reported apart; then the median of 3, forward and forward+backward, each
  as a ratio to SDPA in the same run, beside issue 64's target (at most 1.5x SDPA flash); and the peak memory (target:
  at most SDPA's + 10%). The chunked kernel (a family with no fused route) is timed at the first length only unless
  ``--chunked-all``: it takes 5-50x SDPA flash (docs/results/attention.md). Softmax runs SDPA in bf16 (its flash
  kernel, through ``sdpa.py``); softpick runs FlexAttention's two passes (``flex.py``); stick-breaking fla's kernel.
- **error** (the SmolLM2 shape, the first length; on bf16 inputs): the family's fused output, and on CUDA its
  gradients of q, k, v, against the chunked kernel in fp64 on the same (rounded) inputs, as the largest error over
  the largest fp64 value; SDPA flash's own softmax error the same way; the ratio is FlashAttention's criterion
  (target at most 2x).

On the CPU there is no fused GPU kernel to time: the families whose CUDA kernel is FlexAttention run its eager forward
(forward only: torch refuses its backward on the CPU) where torch runs it there (not softpick's two passes: torch
returns the row maximum they read on CUDA only), the Triton kernel's families are skipped (its interpreter is for
tests), and the others run what the CPU runs (SDPA, the chunked kernel): the table's mechanics, not GPU figures.

Usage:
    python scripts/attention/bench_gpu_families.py                     # CUDA: 2 shapes x 3 lengths
    python scripts/attention/bench_gpu_families.py --lengths 4096 --shapes smollm2 --families "sigmoid;softmax"
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hf_knorm.attention import backends, flex
from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.attention.masks import CallLayout, KeyPadding
from hf_knorm.attention.paths import Path
from hf_knorm.normalizations import parse_normalization, representative_spellings

CUDA = torch.cuda.is_available()
SHAPES = {"smollm2": ("SmolLM2-135M", 9, 3, 64), "llama3-8b": ("Llama-3-8B", 32, 8, 128)}
TARGET_TIME, TARGET_MEMORY, TARGET_ERROR = 1.5, 1.1, 2.0


def _sdpa(query, key, value):
    if CUDA:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _seconds(function) -> float:
    _sync()
    started = time.perf_counter()
    function()
    _sync()
    return time.perf_counter() - started


def _inputs(shape: str, length: int, dtype, seed: int = 0) -> list[torch.Tensor]:
    _, q_heads, kv_heads, dim = SHAPES[shape]
    generator = torch.Generator().manual_seed(seed)
    sizes = (1, q_heads, length, dim), (1, kv_heads, length, dim), (1, kv_heads, length, dim)
    device = "cuda" if CUDA else "cpu"
    return [torch.randn(size, generator=generator).to(device=device, dtype=dtype) for size in sizes]


def kernel_for(normalization, query) -> str:
    """The kernel this family's plain causal call takes here: the automatic choice on CUDA; on the CPU the first of
    the CUDA order that runs on a CPU ("flex": its eager forward, where torch runs it there; "triton" is skipped),
    else what the CPU runs."""
    path = Path(linear=False)
    length = query.shape[2]
    options = dict(dropout=0.0, return_weights=False, recording=False, compiling=False,
                   layout=CallLayout(None, None, True, length, length))
    if CUDA:
        return backends.with_kernel(path, query, normalization, **options).name
    order = backends.automatic_order(normalization)
    if order and (order[0] == "triton" or order[0] == "flex" and not flex.cpu_blocker(normalization)):
        return order[0]
    return backends.with_kernel(path, query, normalization, **options).name


def _attention(kernel: str, normalization, params):
    """``attention(q, k, v)`` through the kernel, as the attention entry calls it (a plain causal call: key padding
    of real keys, which FlexAttention and fla read as it is and the others as their implicit causal mask)."""
    path = Path(linear=False, kernel="" if kernel == "quadratic" else kernel)

    def attention(query, key, value):
        length = query.shape[2]
        padding = KeyPadding(torch.ones(1, length, dtype=torch.bool, device=query.device), length, causal=True)
        mask = padding if kernel in backends.KEY_PADDING_KERNELS else None
        return backends.run_quadratic(path, query, key, value, mask, normalization, causal=True, params=params)[0]

    return attention


def _learned(normalization, heads: int, device) -> dict:
    return {name: torch.full((heads,), float(init), device=device, requires_grad=True)
            for name, init in normalization.learnable().items()}


def _timed(attention, inputs, backward: bool) -> dict:
    """The first call (warm-up: compiling), the median of 3 more, and the peak memory (CUDA) of forward (no gradient)
    or forward+backward."""
    leaves = [tensor.detach().requires_grad_(backward) for tensor in inputs]

    def run():
        if backward:
            attention(*leaves).float().sum().backward()
        else:
            with torch.no_grad():
                attention(*leaves)

    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    first = _seconds(run)
    times = [_seconds(run) for _ in range(3)]
    peak = torch.cuda.max_memory_allocated() / 2**20 if CUDA else None
    return {"first": first, "median": statistics.median(times), "peak": peak}


def _error(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def errors(attention, normalization, inputs, params, gradients: bool) -> tuple[float, float | None]:
    """``(output error, largest gradient error or None)`` against the chunked kernel in fp64 on the same inputs."""
    leaves = [tensor.detach().requires_grad_(gradients) for tensor in inputs]
    exact = [tensor.detach().double().requires_grad_(gradients) for tensor in inputs]
    exact_params = {name: value.detach().double().requires_grad_(gradients) for name, value in params.items()}
    got = attention(*leaves)
    want, _ = chunked_attention(*exact, None, normalization, causal=True, params=exact_params)
    output_error = _error(got.detach(), want.detach())
    if not gradients:
        return output_error, None
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    upstream = upstream.to(want.device)
    got_grads = torch.autograd.grad((got.double() * upstream).sum(), leaves)
    want_grads = torch.autograd.grad((want * upstream).sum(), exact)
    return output_error, max(_error(g, w) for g, w in zip(got_grads, want_grads))


def sdpa_errors(inputs, gradients: bool) -> tuple[float, float | None]:
    """SDPA flash's own bf16 softmax error against fp64 softmax on the same inputs (the criterion's unit)."""
    return errors(lambda query, key, value: _sdpa(query, key, value).transpose(1, 2), parse_normalization("softmax"),
                  inputs, {}, gradients)


def rows(lengths: list[int], shapes: list[str], spellings: list[str], chunked_all: bool = False,
         error_length: int | None = None) -> list[str]:
    """The table's rows (printed as they come)."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    dtype_name = "bf16" if CUDA else "fp32"
    lines = []

    def emit(line: str):
        lines.append(line)
        print(line, flush=True)

    baseline_name = "SDPA flash" if CUDA else "SDPA (CPU)"
    for shape in shapes:
        label, q_heads, kv_heads, dim = SHAPES[shape]
        for index, length in enumerate(lengths):
            inputs = _inputs(shape, length, dtype)
            sdpa = {name: _timed(_sdpa, inputs, backward) for name, backward in (("fwd", False), ("bwd", True))}
            emit(f"| fused {label} N={length} baseline {baseline_name} ({dtype_name}) | forward "
                 f"{1e3 * sdpa['fwd']['median']:.2f} ms, forward+backward {1e3 * sdpa['bwd']['median']:.2f} ms"
                 f"{_peak(sdpa['bwd']['peak'])} |")
            for spelling in spellings:
                normalization = parse_normalization(spelling)
                kernel = kernel_for(normalization, inputs[0])
                name = f"| fused {label} N={length} {spelling} ({kernel}, {dtype_name})"
                if kernel == "triton" and not CUDA:
                    emit(f"{name} | skipped: no CUDA device (Triton's interpreter runs the kernel in the tests, far "
                         "too slowly to time) |")
                    continue
                if kernel == "quadratic" and index > 0 and not chunked_all:
                    emit(f"{name} | skipped: the chunked kernel (no fused route) is timed at the first length only "
                         "(--chunked-all) |")
                    continue
                params = _learned(normalization, q_heads, inputs[0].device)
                attention = _attention(kernel, normalization, params)
                forward = _timed(attention, inputs, backward=False)
                if kernel == "flex" and not CUDA:
                    backward = None
                else:
                    backward = _timed(attention, inputs, backward=True)
                emit(f"{name} | {_figures(forward, backward, sdpa)} |")
    error_length = error_length or lengths[0]
    shape = shapes[0]
    inputs = _inputs(shape, error_length, torch.bfloat16, seed=2)
    if not CUDA:
        inputs = [tensor.float() for tensor in inputs]  # bf16-rounded values, computed in fp32 on the CPU
    reference = sdpa_errors(inputs, gradients=True)
    label = SHAPES[shape][0]
    emit(f"| fused error {label} N={error_length} baseline {baseline_name} softmax (bf16 inputs) | output "
         f"{reference[0]:.2e}, gradients {reference[1]:.2e} of the largest fp64 value |")
    for spelling in spellings:
        normalization = parse_normalization(spelling)
        kernel = kernel_for(normalization, inputs[0])
        name = f"| fused error {label} N={error_length} {spelling} ({kernel}, bf16 inputs)"
        if kernel == "triton" and not CUDA:
            emit(f"{name} | skipped: no CUDA device |")
            continue
        params = _learned(normalization, SHAPES[shape][1], inputs[0].device)
        gradients = CUDA or kernel != "flex"
        output_error, gradient_error = errors(_attention(kernel, normalization, params), normalization, inputs,
                                              params, gradients)
        ratio = output_error / max(reference[0], 1e-30)
        text = f"output {output_error:.2e} ({ratio:.2f}x SDPA's{_target(ratio, TARGET_ERROR)})"
        if gradient_error is None:
            text += ", gradients: not on the CPU (torch refuses FlexAttention's backward there)"
        else:
            gradient_ratio = gradient_error / max(reference[1], 1e-30)
            text += f", gradients {gradient_error:.2e} ({gradient_ratio:.2f}x{_target(gradient_ratio, TARGET_ERROR)})"
        emit(f"{name} | {text} |")
    return lines


def _peak(peak: float | None) -> str:
    return "" if peak is None else f", peak {peak:.0f} MiB"


def _target(ratio: float, target: float) -> str:
    return f"; target <= {target}x: {'met' if ratio <= target else 'MISSED'}" if CUDA else ""


def _figures(forward: dict, backward: dict | None, sdpa: dict) -> str:
    ratio = forward["median"] / sdpa["fwd"]["median"]
    text = (f"forward {1e3 * forward['median']:.2f} ms ({ratio:.2f}x SDPA{_target(ratio, TARGET_TIME)}; first call "
            f"{1e3 * forward['first']:.0f} ms)")
    if backward is None:
        return text + ", forward+backward: not on the CPU (torch refuses FlexAttention's backward there)"
    ratio = backward["median"] / sdpa["bwd"]["median"]
    text += (f", forward+backward {1e3 * backward['median']:.2f} ms ({ratio:.2f}x{_target(ratio, TARGET_TIME)}; "
             f"first call {1e3 * backward['first']:.0f} ms)")
    if backward["peak"] is not None:
        memory = backward["peak"] / sdpa["bwd"]["peak"]
        text += f", peak {backward['peak']:.0f} MiB ({memory:.2f}x{_target(memory, TARGET_MEMORY)})"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=None, help="comma-separated (default: 4096,16384,32768 on CUDA, 256 on "
                                                        "the CPU)")
    parser.add_argument("--shapes", default="smollm2,llama3-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--families", default=None, help="';'-separated spellings (default: the first example of "
                                                         "each family and each learned one)")
    parser.add_argument("--chunked-all", action="store_true", help="time the chunked kernel at every length")
    args = parser.parse_args()
    lengths = [int(n) for n in (args.lengths or ("4096,16384,32768" if CUDA else "256")).split(",")]
    spellings = args.families.split(";") if args.families else representative_spellings()
    device = torch.cuda.get_device_name() if CUDA else "CPU (no CUDA device: no fused GPU kernel, figures fp32)"
    print(f"device: {device}; torch {torch.__version__}\n\n| fused path | result |\n|---|---|")
    rows(lengths, args.shapes.split(","), spellings, chunked_all=args.chunked_all)


if __name__ == "__main__":
    main()

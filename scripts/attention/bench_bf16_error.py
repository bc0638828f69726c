"""Accuracy: each normalization's attention in bf16 (and fp32) against the fp64 reference, at SmolLM2's layer shape.

Causal self-attention of one layer shaped like SmolLM2-135M's (9 query heads over 3 KV heads, head dim 64), batch 1,
N tokens (default 4096), inputs drawn once (seed 0, std 1 queries/keys scaled like a trained layer's logits), then
rounded to bf16: the fp64 reference (``hf_knorm.attention.reference``) runs on the same rounded inputs, so the error
is the kernel's own in that dtype. Reported: the largest absolute error of the output relative to the output's
largest value, and the mean absolute error relative to the mean absolute value, for the quadratic kernel and (p = 1)
the linear one. The kernels compute scores and their normalization in fp32 whatever the input dtype; the output is
rounded to the input dtype at the end.

Usage:
    python scripts/attention/bench_bf16_error.py --tokens 4096
"""

from __future__ import annotations

import argparse

import torch

from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.attention.linear_kernel import is_linear, linear_attention
from hf_knorm.normalizations import parse_normalization
from hf_knorm.attention.reference import reference_attention

NORMALIZATIONS = ("softmax", "x/1", "x/16", "x^3/1", "x^3/16", "x^3/sqrtN")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, 9, args.tokens, 64), (1, 3, args.tokens, 64), (1, 3, args.tokens, 64)]
    raw = [torch.randn(shape, generator=generator) for shape in shapes]
    print(f"SmolLM2-shaped layer (9 query / 3 KV heads, head dim 64), N = {args.tokens}, causal, torch "
          f"{torch.__version__}")
    print("| normalization | kernel | bf16: max error / max abs | bf16: mean error / mean abs | "
          "fp32: max error / max abs |")
    print("|---|---|---:|---:|---:|")
    for spelling in NORMALIZATIONS:
        normalization = parse_normalization(spelling)
        kernels = {"quadratic": lambda q, k, v: chunked_attention(q, k, v, None, normalization, causal=True)[0]}
        if is_linear(normalization):
            kernels["linear"] = lambda q, k, v: linear_attention(q, k, v, None, normalization)
        errors = {}
        for dtype in (torch.bfloat16, torch.float32):
            inputs = [tensor.to(dtype) for tensor in raw]
            expected, _ = reference_attention(*[tensor.double() for tensor in inputs], None, normalization,
                                              causal=True)
            for name, kernel in kernels.items():
                with torch.no_grad():
                    output = kernel(*inputs).double()
                error = (output - expected).abs()
                errors[name, dtype] = (float(error.max() / expected.abs().max()),
                                       float(error.mean() / expected.abs().mean()))
            del expected
        for name in kernels:
            bf16, fp32 = errors[name, torch.bfloat16], errors[name, torch.float32]
            print(f"| {spelling} | {name} | {bf16[0]:.2e} | {bf16[1]:.2e} | {fp32[0]:.2e} |", flush=True)


if __name__ == "__main__":
    main()

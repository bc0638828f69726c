"""Benchmark: ``x/1`` where users call it, a patched model's forward and forward+backward, against the same model under
SDPA, with peak memory; and the attention kernels alone on the same lengths, in the same run.

Models:
- ``layer``: one SmolLM2-135M-shaped Llama decoder layer built with ``AutoModelForCausalLM`` from a config (hidden 576,
  9 query / 3 KV heads, head dim 64, MLP 1536, SmolLM2's vocabulary), random weights;
- ``default``: the real default model (SmolLM2-135M-Instruct, 30 layers; forward only).

Passes (what is timed, the same call on both sides):
- ``fwd``: a prefill, ``model(input_ids, attention_mask, use_cache=False, logits_to_keep=1)`` under ``no_grad`` (the
  call ``generate`` makes first: the logits of the last position);
- ``fwd+bwd``: the decoder's forward and backward, ``model.model(...).last_hidden_state`` -> ``.square().mean()`` ->
  ``backward()`` (the LM head and loss, the same cost on both sides at every length, are left out so that the
  attention's share shows).

Each (implementation, N, pass) runs in its own process: the peak resident memory it adds above the model and the
inputs (``VmHWM`` reset after they are built; the first call included) is its own. Times are the minimum of ``--repeats`` calls after the
first (the first, a warm-up, is also reported). Every ``x/1`` case checks with ``attention_paths()`` that every layer
took the linear path (the compiled ones are tested to: ``tests/attention/test_compile.py``). ``--floor`` also times the model with an attention that computes nothing (zeros): its ratio
to SDPA is the least any attention can reach inside this model (the projections, MLP and norms cost the same on
every side). ``--compare-compiled`` times the patched decoder under ``torch.compile`` against eager. ``--batch 2 --left-pad 100`` times a left-padded batch; ``--normalization x/sqrtN`` the paper's
rule. The kernels alone: ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` against
``linear_attention`` on the same layer's shapes, forward, in the parent process.

Usage:
    python scripts/attention/bench_model_linear.py --model layer --lengths 1024,4096,16384,32768,65536 --sdpa-max 32768
    python scripts/attention/bench_model_linear.py --model layer --lengths 16384 --batch 2 --left-pad 100 --normalization x/sqrtN
    python scripts/attention/bench_model_linear.py --model default --lengths 8192,32768 --passes fwd --sdpa-max 8192
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

NO_ATTENTION = "bench_no_attention"
LAYER_CONFIG = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=131072,
                    rope_theta=100000.0, tie_word_embeddings=True)


def build_model(which: str, implementation: str, normalization: str):
    import transformers

    import hf_knorm

    if which == "layer":
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**LAYER_CONFIG)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    else:
        from hf_knorm.assets.default_model import load_default_model

        model, _ = load_default_model(attn_implementation="sdpa")
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, 131072)
    if implementation == NO_ATTENTION:
        transformers.AttentionInterface.register(NO_ATTENTION, no_attention)
        model.set_attn_implementation(NO_ATTENTION)
    elif implementation != "sdpa":
        hf_knorm.patch(model, normalization)
    return model


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention that computes nothing (zeros ``(B, q, H_q, D)``): the model's time without its attention."""
    batch, heads, length, dim = query.shape
    return query.new_zeros(batch, length, heads, value.shape[-1]), None


def inputs_for(length: int, batch: int, left_pad: int, vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if left_pad:
        attention_mask[0, :left_pad] = 0  # the first row left-padded
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def call(model, inputs: dict, backward: bool) -> None:
    if backward:
        hidden = model.model(**inputs, use_cache=False).last_hidden_state
        hidden.square().mean().backward()
    else:
        with torch.no_grad():
            model(**inputs, use_cache=False, logits_to_keep=1)


def worker(args) -> None:
    """One (implementation, N, pass) in this process: prints a JSON line."""
    from hf_knorm.attention.paths import attention_paths

    torch.set_num_threads(args.threads)
    model = build_model(args.model, args.implementation, args.normalization)
    model.train(args.backward)
    if args.compile:
        model.model = torch.compile(model.model)  # the decoder: what both passes call (the first call compiles)
    inputs = inputs_for(args.length, args.batch, args.left_pad, model.config.vocab_size)
    baseline = reset_peak_memory()
    seconds, checked = [], args.implementation == "x/1" and not args.compile  # (a path log in compiled code recompiles)
    for repeat in range(args.repeats + 1):
        model.zero_grad(set_to_none=True)
        with attention_paths() if checked else contextlib.nullcontext({}) as paths:
            start = time.perf_counter()
            call(model, inputs, args.backward)
            seconds.append(time.perf_counter() - start)
        if checked and (paths.get("quadratic") or not paths.get("linear")):
            raise SystemExit(f"{paths['quadratic']} attention calls took the quadratic kernel: {dict(paths)}")
    peak = memory_kb("VmHWM") - baseline
    print(json.dumps(dict(first=seconds[0], best=min(seconds[1:]) if args.repeats else seconds[0],
                          peak_mb=peak / 1024, paths=dict(paths))), flush=True)


def memory_kb(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak since the last reset) of this process, in kB."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1])


def reset_peak_memory() -> int:
    """Reset this process's peak resident memory to what it holds now (Linux: ``5`` into ``/proc/self/clear_refs``);
    returns that, in kB."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return memory_kb("VmRSS")


def run_case(args, implementation: str, length: int, backward: bool) -> dict:
    command = [sys.executable, __file__, "--worker", "--model", args.model, "--implementation", implementation,
               "--normalization", args.normalization, "--length", str(length), "--batch", str(args.batch),
               "--left-pad", str(args.left_pad), "--threads", str(args.threads),
               "--repeats", str(args.repeats if length < args.single_from else 0)] + (["--backward"] if backward else [])
    if implementation.endswith(" compiled"):
        command[command.index("--implementation") + 1] = implementation.removesuffix(" compiled")
        command += ["--compile", "--repeats", str(max(args.repeats, 1))]  # the first call compiles: never timed alone
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{implementation} N={length}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def kernel_seconds(length: int, repeats: int) -> dict:
    """The attention kernels alone, forward, the layer's shapes: minimum of ``repeats`` after a warm-up."""
    from hf_knorm.attention.linear_kernel import linear_attention
    from hf_knorm.normalizations import parse_normalization

    x1 = parse_normalization("x/1")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, 64, generator=generator) * 0.5 for heads in (9, 3, 3))
    calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             "x/1": lambda: linear_attention(q, k, v, None, x1)}
    best = {}
    with torch.no_grad():
        for name, fn in calls.items():
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            best[name] = min(times[1:])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("layer", "default"), default="layer")
    parser.add_argument("--lengths", default="1024,4096,16384,32768")
    parser.add_argument("--passes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both, comma-separated")
    parser.add_argument("--normalization", default="x/1", help="the p = 1 normalization to patch (x/1, x/sqrtN, ...)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--left-pad", type=int, default=0, help="left-pad the first row by this many tokens")
    parser.add_argument("--sdpa-max", type=int, default=32768, help="longest N timed under SDPA (quadratic time)")
    parser.add_argument("--single-from", type=int, default=32768, help="one call (no repeat) from this N on")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared 2-core machine more threads measure the load)")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernels-alone table")
    parser.add_argument("--floor", action="store_true",
                        help="also time the model with an attention that computes nothing: the floor of any ratio")
    parser.add_argument("--compare-compiled", action="store_true",
                        help="also time the patched model under torch.compile (the decoder compiled; its first call, "
                        "which compiles, is not timed) against eager")
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--implementation", default="x/1", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    passes = [name.strip() for name in args.passes.split(",")]
    print(f"{args.model} model, {args.normalization} against SDPA, batch {args.batch}, left pad {args.left_pad}; "
          f"torch {torch.__version__}, {args.threads} thread(s); min of {args.repeats} after a warm-up "
          f"(one call from {args.single_from} on)")
    print("| N | pass | SDPA | SDPA peak | " + args.normalization + " | ratio | " + args.normalization + " peak | "
          "no attention (ratio) | compiled " + args.normalization + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for length in lengths:
        for name in passes:
            backward = name == "fwd+bwd"
            linear = run_case(args, "x/1", length, backward)
            sdpa = run_case(args, "sdpa", length, backward) if length <= args.sdpa_max else None
            floor = run_case(args, NO_ATTENTION, length, backward) if args.floor else None
            compiled = run_case(args, "x/1 compiled", length, backward) if args.compare_compiled else None
            rows.append(dict(length=length, passes=name, linear=linear, sdpa=sdpa, no_attention=floor,
                             compiled=compiled))
            sdpa_cells = (f"{sdpa['best']:.2f} s | {sdpa['peak_mb']:.0f} MB" if sdpa else "- | -")
            ratio = f"{linear['best'] / sdpa['best']:.3f}x" if sdpa else "-"
            floor_cell = "-" if not floor else f"{floor['best']:.2f} s" + (
                f" ({floor['best'] / sdpa['best']:.3f}x)" if sdpa else "")
            compiled_cell = "-" if not compiled else (
                f"{compiled['best']:.2f} s ({compiled['best'] / linear['best']:.2f}x eager)")
            print(f"| {length} | {name} | {sdpa_cells} | {linear['best']:.2f} s | {ratio} | "
                  f"{linear['peak_mb']:.0f} MB | {floor_cell} | {compiled_cell} |", flush=True)
    for name in passes:
        by = {row["length"]: row for row in rows if row["passes"] == name}
        steps = [(a, b) for a, b in zip(lengths, lengths[1:]) if b == 2 * a]
        cells = [f"{a // 1024}k->{b // 1024}k {by[b]['linear']['best'] / by[a]['linear']['best']:.2f}x time, "
                 f"{by[b]['linear']['peak_mb'] / max(by[a]['linear']['peak_mb'], 1e-9):.2f}x peak" for a, b in steps]
        if cells:
            print(f"{args.normalization} growth ({name}): " + "; ".join(cells))
    if not args.no_kernels and args.model == "layer":
        print("\nkernels alone, forward, B=1 (min of 3 after a warm-up):")
        print("| N | SDPA kernel | linear_attention | ratio |")
        print("|---|---|---|---|")
        for length in lengths:
            if length > args.sdpa_max:
                continue
            best = kernel_seconds(length, 3 if length < args.single_from else 1)
            rows.append(dict(length=length, passes="kernel fwd", kernel=best))
            print(f"| {length} | {best['sdpa']:.3f} s | {best['x/1']:.3f} s | {best['x/1'] / best['sdpa']:.3f}x |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()

"""Benchmark: the plugin's attention under torch.compile, against eager mode and against compiled SDPA, in one run.

The model is one decoder layer of the default model's shape (SmolLM2-135M-Instruct's config with one layer: hidden
576, 9 query heads over 3 key-value heads, head_dim 64; random weights; the base model, without the LM head that
would dominate short sequences), batch 1, causal, fp32. Four variants share
the weights: Transformers' SDPA eager and compiled, the plugin's attention (``--normalization``, default x^3/16) eager
and compiled (``torch.compile``, inductor, ``dynamic=False``, compiled afresh per length). For each length: the
median of interleaved repeats of the forward pass (no grad) and of forward+backward, after a warm-up call that
compiles. Ratios: compiled against eager (the plugin's), and the plugin compiled against SDPA compiled.

Usage:
    python scripts/attention/bench_compile.py                                   # N in 1024..8192, fp32, one thread
    python scripts/attention/bench_compile.py --lengths 1024,2048 --normalization x/1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoConfig, AutoModel

import hf_knorm
from hf_knorm.assets.default_model import default_model_dir

VARIANTS = ("sdpa eager", "sdpa compiled", "plugin eager", "plugin compiled")


def one_layer_models(normalization: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An SDPA model and a patched copy with the same weights: the default model's shape, one layer."""
    config = AutoConfig.from_pretrained(default_model_dir())
    config.num_hidden_layers = 1
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    sdpa = AutoModel.from_config(config).train()
    plugin = AutoModel.from_config(config).train()
    plugin.load_state_dict(sdpa.state_dict())
    hf_knorm.patch(plugin, normalization=normalization)
    return sdpa, plugin


def run_once(model, ids: torch.Tensor, backward: bool) -> None:
    if backward:
        model(input_ids=ids).last_hidden_state.sum().backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(input_ids=ids)


def median_times(models: dict, ids: torch.Tensor, backward: bool, repeats: int) -> dict[str, float]:
    """Median seconds per variant; the first call of each (compiling) is not timed, repeats are interleaved."""
    for model in models.values():
        run_once(model, ids, backward)
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            run_once(model, ids, backward)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--normalization", default="x^3/16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared 2-core machine the timings would measure the load)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sdpa, plugin = one_layer_models(args.normalization)
    print(f"one SmolLM2-shaped decoder layer (9/3 heads, head_dim 64), B=1, causal, fp32, torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, plugin = {args.normalization}, median of {args.repeats}")
    print("| N | pass | SDPA eager | SDPA compiled | plugin eager | plugin compiled | compiled / eager (plugin) "
          "| plugin compiled / SDPA compiled |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        ids = torch.randint(0, sdpa.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        for backward in (False, True):
            torch._dynamo.reset()  # a fresh compilation per length and pass, with static shapes
            models = {"sdpa eager": sdpa, "sdpa compiled": torch.compile(sdpa, dynamic=False),
                      "plugin eager": plugin, "plugin compiled": torch.compile(plugin, dynamic=False, fullgraph=True)}
            times = median_times(models, ids, backward, args.repeats)
            rows.append(dict(length=length, backward=backward, seconds=times))
            cells = [str(length), "fwd+bwd" if backward else "fwd"]
            cells += [f"{times[name] * 1e3:.0f} ms" for name in VARIANTS]
            cells.append(f"{times['plugin compiled'] / times['plugin eager']:.2f}x")
            cells.append(f"{times['plugin compiled'] / times['sdpa compiled']:.2f}x")
            print("| " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()

"""Every family in a patched model against the same model under SDPA: a training step and ``generate`` per token.

Issue 64's model-level measurement, part 8 of ``make device-check`` (``scripts/device_check.py`` runs this script in
its own process and prints its rows in the one table). The model: Transformers' ``LlamaForCausalLM`` from a
``LlamaConfig`` alone (random weights, seed 0; no download), 4 layers, hidden 2048, 32 query / 8 KV heads of dim 64
(``hidden / heads``, as Llama 3.2 1B has it), MLP 8192, vocabulary 32,000 (Llama 2's: a smaller head than Llama 3's
128k, so that the logits do not dominate a 4-layer model's time), bf16 weights on CUDA. In one run, the model under
SDPA (Transformers' ``sdpa``: flash for a causal batch of 1) first, then the same weights patched with each family
(the first example of each registered family and each learned one; ``hf_knorm.patch``, the automatic kernel choice):

- **training step** at 4,096 tokens (batch 1): forward with labels, backward, an AdamW step (fused on CUDA); the first
  step apart (it holds the compile warm-up: FlexAttention's Inductor compile, Triton's JIT, fla's autotuning), then
  the median of ``--steps`` (3); the peak memory of the steps;
- **generate** after a 4,096-token prompt: greedy, ``max_new_tokens`` 1 and ``1 + G`` (``G`` = ``--new-tokens``, 32;
  ``min_new_tokens`` the same, so no EOS ends it early); per token ``(t(1 + G) - t(1)) / G``, each time the median of
  ``--repeats`` (2) after one warm-up call of each (reported apart: the prefill's and the decoding's first calls);
- the plugin's paths that ran (``attention_paths``: ``fla``, ``flex``, ``sdpa``, ``triton``, ``quadratic``), and each
  ratio to SDPA's beside issue 64's targets (training step and per token at most 1.2x SDPA's).

Budget: without compile warm-ups a family takes about 5 s here on an H100 (estimated, not measured: ~40 ms per
training step of a 0.3B model at 4k tokens, ~10 ms per decoded token of 4 layers, a 4k prefill per ``generate``
call); a FlexAttention family adds its compiles (forward+backward, prefill, decoding; not measured yet). So the part
stops starting families after ``--budget-s`` (150 s on CUDA): each family left is a row saying it was skipped for the
budget, and ``--families`` picks the ones to run.

On the CPU (and with ``--smoke``) the same steps run on a tiny model of the same structure (hidden 64, 4 / 2 heads of
dim 16, MLP 128, vocabulary 256, 64 tokens, 4 new tokens, fp32, one repeat): the table's mechanics end to end, not
figures (the GPU kernels need CUDA; the CPU runs SDPA and the chunked kernel).

Usage:
    python scripts/attention/bench_gpu_model.py                       # CUDA: every family, 4k tokens
    python scripts/attention/bench_gpu_model.py --families "stick-breaking;sigmoid(bias=-log n)" --budget-s 600
    python scripts/attention/bench_gpu_model.py --smoke                # tiny, any device
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass

import torch

CUDA = torch.cuda.is_available()
TARGET = 1.2


@dataclass(frozen=True)
class Sizes:
    """The model and the run: hidden size, query / KV heads, MLP width, vocabulary, tokens per training step and per
    prompt, generated tokens, timed repeats (training steps, ``generate`` pairs)."""

    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tokens: int
    new_tokens: int
    steps: int
    repeats: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return (f"4-layer Llama (hidden {self.hidden}, {self.heads}/{self.kv_heads} heads, dim "
                f"{self.hidden // self.heads}), {self.tokens} tokens, {str(self.dtype).removeprefix('torch.')}")


FULL = Sizes(hidden=2048, heads=32, kv_heads=8, mlp=8192, vocab=32000, tokens=4096, new_tokens=32, steps=3, repeats=2,
             dtype=torch.bfloat16)
SMOKE = Sizes(hidden=64, heads=4, kv_heads=2, mlp=128, vocab=256, tokens=64, new_tokens=4, steps=1, repeats=1,
              dtype=torch.float32)


def build(sizes: Sizes, spelling: str | None, device: str):
    """The model (random weights, seed 0, the same for every family), patched with ``spelling`` (SDPA when
    ``None``)."""
    import transformers

    import hf_knorm

    config = transformers.LlamaConfig(
        hidden_size=sizes.hidden, num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
        intermediate_size=sizes.mlp, num_hidden_layers=4, vocab_size=sizes.vocab, max_position_embeddings=2 * 8192,
        rope_theta=500000.0, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: seconds less per family on a GPU
        model = transformers.LlamaForCausalLM(config)
    model = model.to(sizes.dtype)
    model.generation_config.pad_token_id = 0
    return hf_knorm.patch(model, spelling) if spelling else model


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _seconds(function) -> float:
    _sync()
    started = time.perf_counter()
    function()
    _sync()
    return time.perf_counter() - started


def measure(model, sizes: Sizes, device: str) -> dict:
    """The training step's and ``generate``'s figures for ``model`` (module docstring), and the paths that ran."""
    from hf_knorm.attention.paths import attention_paths

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, sizes.vocab, (1, sizes.tokens), generator=generator).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=CUDA or None)
    model.train()

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with attention_paths() as paths:
        first_step = _seconds(step)
    steps = [_seconds(step) for _ in range(sizes.steps)]
    peak = torch.cuda.max_memory_allocated() / 2**20 if CUDA else None
    del optimizer
    model.eval()
    mask = torch.ones_like(ids)

    def generate(count: int):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=count, min_new_tokens=count,
                           do_sample=False)

    with attention_paths() as generate_paths:
        first_calls = _seconds(lambda: generate(1)) + _seconds(lambda: generate(1 + sizes.new_tokens))
    short = statistics.median(_seconds(lambda: generate(1)) for _ in range(sizes.repeats))
    long = statistics.median(_seconds(lambda: generate(1 + sizes.new_tokens)) for _ in range(sizes.repeats))
    return {"step": statistics.median(steps), "first_step": first_step, "peak": peak,
            "per_token": max(long - short, 0.0) / sizes.new_tokens, "first_calls": first_calls,
            "paths": ",".join(sorted(paths)) or "-", "generate_paths": ",".join(sorted(generate_paths)) or "-"}


def _target(ratio: float) -> str:
    return f"; target <= {TARGET}x: {'met' if ratio <= TARGET else 'MISSED'}" if CUDA else ""


def row(name: str, figures: dict, baseline: dict | None) -> str:
    """One table row: the baseline's absolute figures, or a family's with its ratios to the baseline's."""
    peak = "" if figures["peak"] is None else f", peak {figures['peak']:.0f} MiB"
    if baseline is None:
        return (f"| {name} | training step {1e3 * figures['step']:.1f} ms (first step {1e3 * figures['first_step']:.0f}"
                f" ms){peak}; generate {1e3 * figures['per_token']:.2f} ms per token (first calls "
                f"{1e3 * figures['first_calls']:.0f} ms) |")
    step = figures["step"] / baseline["step"]
    token = figures["per_token"] / max(baseline["per_token"], 1e-9)
    if figures["peak"] is not None:
        peak += f" ({figures['peak'] / baseline['peak']:.2f}x)"
    return (f"| {name} (paths: training {figures['paths']}, generate {figures['generate_paths']}) | training step "
            f"{1e3 * figures['step']:.1f} ms ({step:.2f}x SDPA{_target(step)}; first step "
            f"{1e3 * figures['first_step']:.0f} ms){peak}; generate {1e3 * figures['per_token']:.2f} ms per token "
            f"({token:.2f}x{_target(token)}; first calls {1e3 * figures['first_calls']:.0f} ms) |")


def rows(sizes: Sizes, spellings: list[str], budget_s: float | None) -> list[str]:
    """The table's rows, printed as they come: SDPA's, then one per family (or why it was skipped)."""
    device = "cuda" if CUDA else "cpu"
    started = time.perf_counter()
    lines = []

    def emit(line: str):
        lines.append(line)
        print(line, flush=True)

    baseline = None
    for spelling in [None, *spellings]:
        name = f"model {sizes.label}, " + (spelling or "baseline SDPA" + (" (flash)" if CUDA else ""))
        spent = time.perf_counter() - started
        if spelling is not None and budget_s is not None and spent > budget_s:
            emit(f"| {name} | skipped: the part's budget of {budget_s:.0f} s is spent ({spent:.0f} s; --budget-s, "
                 "--families) |")
            continue
        model = build(sizes, spelling, device)
        figures = measure(model, sizes, device)
        emit(row(name, figures, baseline))
        baseline = baseline or figures
        del model
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
    return lines


def main() -> None:
    from hf_knorm.normalizations import representative_spellings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiny model (the default without CUDA)")
    parser.add_argument("--families", default=None, help="';'-separated spellings (default: the first example of "
                                                         "each family and each learned one)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no family after this many seconds of the part (default: 150 on CUDA, none on "
                             "the CPU)")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke or not CUDA else FULL
    spellings = args.families.split(";") if args.families else representative_spellings()
    budget = args.budget_s if args.budget_s is not None else (150.0 if CUDA else None)
    device = torch.cuda.get_device_name() if CUDA else "CPU (no CUDA device: the tiny model, fp32; no GPU kernel)"
    print(f"device: {device}; torch {torch.__version__}\n\n| run | result |\n|---|---|")
    rows(sizes, spellings, budget)


if __name__ == "__main__":
    main()

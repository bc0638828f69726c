"""A GPU kernel proves itself on the device before it computes a call: checked against the PyTorch kernel, once.

``backends.py`` asks :func:`verdict` before it hands a call to the Triton kernel (``triton_kernel.py``), to
flash-linear-attention (``fla_linear.py``; its stick-breaking kernel, ``fla_stick_breaking.py``) or to FlexAttention
(``flex.py``, compiled by Inductor on CUDA). The first time a key comes up in a process, the kernel runs on small
shapes on that device and is compared with the PyTorch kernel (``kernel.py``, ``linear_kernel.py``) computing in fp64
on the same device, from the same (rounded) inputs: outputs and the gradients of query, key and value. The verdict
(``""`` = passed, otherwise why not) is kept per key, so each key is checked once per process; a lock makes a second
thread wait for the first one's check rather than run its own.

The key is what changes the code a kernel runs: the device (``cuda:0``, ``cuda:1`` may be different GPUs), the
input dtype (bf16 multiplies bf16 operands, fp16 TF32 ones, fp32 IEEE ones in the Triton kernel), the kernel, the
normalization's family (:func:`family_of`: its element-wise form, the power ``p``, a rectification and the row rule,
compiled into the Triton kernel; the constant ``c`` is a runtime scalar; for FlexAttention its declared form with each
value by its kind, :func:`flex_form_of`) and the head dimension (the tile width).

What runs, at the production block sizes (``triton_kernel.BLOCK_M x BLOCK_N`` = 64 x 64) and the caller's head
dimension, 2 items, 4 query heads over 2 KV heads, random inputs from a generator of its own (the global random
state is left as it was), gradients on (also under ``torch.no_grad`` / ``inference_mode``), autocast off:

- Triton: (a) no mask with ``causal`` (the implicit top-left causal mask; 100 queries and keys: a full and a ragged
  block) and (b) an explicit mask (70 queries after an 80-key cache, bottom-right causal, 20 padded keys in item 1)
  with an additive bias and a softcap: between them every branch of the three kernels (forward, dK/dV, dQ).
- FlexAttention: (a) the implicit top-left causal mask (100 queries and keys), (b) key padding (150 queries after a
  60-key cache, 40 padded keys in item 1) with a softcap, (c) an explicit sliding-window mask (50 keys) with an
  additive bias; the family's learned values (near their initial values) get their gradients compared too.
- fla: (a) a prefill (70 queries after a 20-key cache, 10 padded keys in item 1; chunked kernel) returning its state,
  with gradients, and (b) one decoded token from that state (recurrent kernel): output, state and count. For a family
  declaring ``stick_break``, its stick-breaking kernel: (a) the implicit causal mask (70 queries and keys: a full and a
  ragged block of its 64 rows) and (b) key padding (30 padded keys on the left of item 1, 10 on the right of item 0:
  packed sequences of ``cu_seqlens``, the padded rows after a real key on the chunked kernel), outputs and
  gradients.

Tolerance, relative to the largest value of the fp64 result: ``1e-4`` where the kernel multiplies fp32 operands in
IEEE precision (Triton and FlexAttention, fp32 inputs); ``2e-2`` where it multiplies bf16 or TF32 operands (bf16 and fp16 inputs; fla
on fp32 inputs, whose ``tl.dot`` takes Triton's default TF32) — the tolerances of ``tests/attention/``. A kernel
that raises (cannot be imported, fails to compile, cannot launch) fails its check with the exception as the reason.

On a CPU under Triton's interpreter (``TRITON_INTERPRET=1``; the tests, through ``backends._device_type``) the
Triton check runs as it does on a GPU, bf16 operands included (``triton_interpreter.py``); fla's kernels need a
GPU and fail their check there (their autotuner benchmarks through a GPU driver; the tests give fla's stick-breaking
kernels one configuration, and run them under the interpreter), and so does FlexAttention's (torch refuses its
backward on the CPU; its tests lift that refusal).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .kernel import chunked_attention
from .linear_kernel import linear_attention
from .masks import KeyPadding
from ..normalizations import Normalization

KERNELS = ("triton", "fla", "flex")
_LOCK = threading.Lock()
_VERDICTS: dict[tuple, str] = {}  # key (see key_of) -> "" (passed) or why the kernel failed


def family_of(normalization: Normalization) -> str:
    """What of ``normalization`` a kernel's code depends on (its :attr:`~hf_knorm.normalizations.Normalization.kernel_key`:
    ``"x^3/c"``, ``"x/sqrtN"``, ``"relu(x)^2/n"``, or the family), whatever its constant and its softmax window (the
    GPU kernels compute a windowed model's family part; the window's softmax runs on the PyTorch kernel)."""
    return normalization.without_window.kernel_key


def key_of(kernel: str, device: torch.device, dtype: torch.dtype, normalization: Normalization,
           head_dim: int) -> tuple:
    """``(device, dtype, kernel, family, head_dim)``: what one check proves (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    family = flex_form_of(normalization) if kernel == "flex" else family_of(normalization)
    return str(device), str(dtype).removeprefix("torch."), kernel, family, int(head_dim)


def flex_form_of(normalization: Normalization) -> str:
    """What FlexAttention's compiled code depends on: the declared form with each value by its kind (a number, per
    row, learned), since the ``score_mod`` reads numbers as constants and learned values as captured tensors: e.g.
    ``"sigmoid: logsigmoid(s + learned)"``, ``"ssmax: softmax(s * number log n)"``."""
    base = normalization.without_window
    form = base.log_weights
    if form is not None:
        shift = "" if form.shift is None else f" + {_kind(form.shift)}"
        if form.activation == "logsigmoid":
            text = f"logsigmoid(s{shift})"
        else:
            text = f"{form.power} log {'relu' if form.rectified else 'abs'}(s{shift})"
        rule = {"constant": "", "n": " - log n", "sqrtN": " - log n / 2"}[form.row_rule]
        return f"{base.family}: {text}{rule}"
    ratio = base.log_weight_ratio
    if ratio is not None:
        return f"{base.family}: {ratio.form} ratio + number floor"
    logits = base.softmax_logits
    scale = "" if logits.log_n_scale is None else f" * {_kind(logits.log_n_scale)} log n"
    sink = "" if logits.sink is None else f" + {_kind(logits.sink)} sink"
    return f"{base.family}: softmax(s{scale}){sink}"


def _kind(value) -> str:
    if isinstance(value, str):
        return value.replace(" ", "")
    return "number" if isinstance(value, (int, float)) else "learned"


def verdict(kernel: str, device: torch.device, dtype: torch.dtype, normalization: Normalization,
            head_dim: int) -> str:
    """``""`` when ``kernel`` computes ``normalization``'s family in ``dtype`` on ``device`` as the PyTorch kernel
    does, otherwise why not; the check runs on the first call for its key (:func:`key_of`) only."""
    if kernel not in KERNELS:
        raise ValueError(f"The self-check knows the kernels {', '.join(KERNELS)}, not {kernel!r}.")
    key = key_of(kernel, device, dtype, normalization, head_dim)
    with _LOCK:
        if key not in _VERDICTS:
            _VERDICTS[key] = run_check(kernel, torch.device(key[0]), dtype, normalization.without_window, head_dim)
        return _VERDICTS[key]


def verdicts() -> dict[tuple, str]:
    """Every check this process has run: key -> ``""`` (passed) or the reason it failed."""
    with _LOCK:
        return dict(_VERDICTS)


def run_check(kernel: str, device: torch.device, dtype: torch.dtype, normalization: Normalization,
              head_dim: int) -> str:
    """Run ``kernel``'s check now (not cached): ``""`` or the first failure, e.g. ``"case (b), dk: largest error
    0.41 of the largest value (tolerance 0.02)"``, or the exception the kernel raised."""
    check = {"triton": _check_triton, "fla": _check_fla, "flex": _check_flex}[kernel]
    quiet = torch.autocast(device.type, enabled=False) if device.type in ("cuda", "cpu") else contextlib.nullcontext()
    try:
        with torch.inference_mode(False), torch.enable_grad(), quiet:
            return check(device, dtype, normalization, head_dim)
    except Exception as error:  # noqa: BLE001 - any failure of the kernel is the verdict, with its reason
        message = " ".join(str(error).split())[:300].rstrip(".")
        return f"it raised {type(error).__name__}: {message}"


def tolerance(kernel: str, dtype: torch.dtype) -> float:
    """The largest error allowed, relative to the largest fp64 value (module docstring)."""
    return 1e-4 if kernel in ("triton", "flex") and dtype == torch.float32 else 2e-2


def _inputs(device, dtype, q_len, kv_len, head_dim, seed):
    """``(query (2, 4, q, D), key (2, 2, kv, D), value (2, 2, kv, D))`` in ``dtype`` with gradients, and their fp64
    copies (leaves too): made on the CPU from a generator of their own, then moved."""
    generator = torch.Generator().manual_seed(seed)
    shapes = (2, 4, q_len, head_dim), (2, 2, kv_len, head_dim), (2, 2, kv_len, head_dim)
    made = [torch.randn(shape, generator=generator).to(device=device, dtype=dtype) for shape in shapes]
    return ([t.clone().requires_grad_() for t in made], [t.double().requires_grad_() for t in made])


def _upstream(like: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(like.device)


def _compare(got: torch.Tensor, want: torch.Tensor, what: str, limit: float) -> str:
    """``""`` when ``got`` is within ``limit`` of ``want``'s largest value, else a sentence saying by how much."""
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)}, the PyTorch kernel's is {tuple(want.shape)}"
    got = got.double()
    if not torch.isfinite(got).all():
        return f"{what}: not finite ({int((~torch.isfinite(got)).sum())} entries)"
    scale = want.abs().max().item() or 1.0
    error = (got - want).abs().max().item() / scale
    if not error <= limit:
        return f"{what}: largest error {error:.3g} of the largest value (tolerance {limit:g})"
    return ""


def _outputs_and_gradients(case, got, want, got_leaves, want_leaves, limit, seed) -> str:
    upstream = _upstream(want, seed)
    got_grads = torch.autograd.grad((got.double() * upstream).sum(), got_leaves)
    want_grads = torch.autograd.grad((want * upstream).sum(), want_leaves)
    names = ["q", "k", "v"] + [f"(learned value {index})" for index in range(len(got_leaves) - 3)]
    checks = [(got, want, "output")] + [(g, w, f"d{name}") for name, g, w in zip(names, got_grads, want_grads)]
    for tensor, reference, what in checks:
        failure = _compare(tensor, reference, f"case ({case}), {what}", limit)
        if failure:
            return failure
    return ""


def _check_triton(device, dtype, normalization, head_dim) -> str:
    from . import triton_kernel  # imports triton: a failing import is the check's verdict

    limit = tolerance("triton", dtype)
    # (a) the implicit top-left causal mask: 100 queries and keys
    leaves, exact = _inputs(device, dtype, 100, 100, head_dim, seed=0)
    got = triton_kernel.triton_attention(*leaves, None, normalization, causal=True)
    want, _ = chunked_attention(*exact, None, normalization, causal=True)
    failure = _outputs_and_gradients("a", got, want, leaves, exact, limit, seed=1)
    if failure:
        return failure
    # (b) an explicit mask: a cache of 80 keys, 20 padded keys in item 1; a bias and a softcap
    leaves, exact = _inputs(device, dtype, 70, 150, head_dim, seed=2)
    rows = torch.arange(70, device=device)[:, None] + 80
    allowed = (torch.arange(150, device=device)[None, :] <= rows).expand(2, 1, 70, 150).clone()
    allowed[1, :, :, :20] = False
    noise = torch.randn(allowed.shape, generator=torch.Generator().manual_seed(3)).to(device)
    bias = torch.where(allowed, 0.3 * noise, 0.0)
    got = triton_kernel.triton_attention(*leaves, allowed, normalization, bias=bias, softcap=5.0)
    want, _ = chunked_attention(*exact, allowed, normalization, bias=bias.double(), softcap=5.0)
    return _outputs_and_gradients("b", got, want, leaves, exact, limit, seed=4)


def _learned(normalization, device, dtype, seed) -> tuple[dict, dict]:
    """The family's learnable values, ``(4,)`` each near their initial value, in ``dtype`` and in fp64 (leaves)."""
    generator = torch.Generator().manual_seed(seed)
    made = {name: init + 0.1 * torch.randn(4, generator=generator) for name, init in normalization.learnable().items()}
    return ({name: value.to(device=device, dtype=dtype).requires_grad_() for name, value in made.items()},
            {name: value.to(device=device, dtype=torch.float64).requires_grad_() for name, value in made.items()})


def _check_flex(device, dtype, normalization, head_dim) -> str:
    from . import flex  # torch's FlexAttention, compiled on CUDA: a failing compile is the check's verdict

    limit = tolerance("flex", dtype)
    params, exact_params = _learned(normalization, device, torch.float32, seed=8)
    # (a) the implicit top-left causal mask: 100 queries and keys (a full and a ragged block of 128 after trimming)
    leaves, exact = _inputs(device, dtype, 100, 100, head_dim, seed=0)
    got = flex.flex_route_attention(*leaves, None, normalization, causal=True, params=params)
    want, _ = chunked_attention(*exact, None, normalization, causal=True, params=exact_params)
    failure = _outputs_and_gradients("a", got, want, [*leaves, *params.values()],
                                     [*exact, *exact_params.values()], limit, seed=1)
    if failure:
        return failure
    # (b) key padding: 150 queries after a 60-key cache, 40 padded keys in item 1; a softcap
    leaves, exact = _inputs(device, dtype, 150, 210, head_dim, seed=2)
    key_valid = torch.ones(2, 210, dtype=torch.bool, device=device)
    key_valid[1, :40] = False
    padding = KeyPadding(key_valid, 150, causal=True)
    got = flex.flex_route_attention(*leaves, padding, normalization, softcap=5.0, params=params)
    want, _ = chunked_attention(*exact, padding.dense(), normalization, softcap=5.0, params=exact_params)
    failure = _outputs_and_gradients("b", got, want, [*leaves, *params.values()],
                                     [*exact, *exact_params.values()], limit, seed=4)
    if failure:
        return failure
    # (c) an explicit mask: a sliding window of 50 keys over 130 queries, and an additive bias
    leaves, exact = _inputs(device, dtype, 130, 130, head_dim, seed=5)
    rows = torch.arange(130, device=device)[:, None]
    keys = torch.arange(130, device=device)[None, :]
    allowed = ((keys <= rows) & (keys > rows - 50)).expand(2, 1, 130, 130)
    noise = torch.randn(allowed.shape, generator=torch.Generator().manual_seed(6)).to(device)
    bias = torch.where(allowed, 0.3 * noise, 0.0)
    got = flex.flex_route_attention(*leaves, allowed, normalization, bias=bias, params=params)
    want, _ = chunked_attention(*exact, allowed, normalization, bias=bias.double(), params=exact_params)
    return _outputs_and_gradients("c", got, want, [*leaves, *params.values()], [*exact, *exact_params.values()],
                                  limit, seed=7)


def _check_fla(device, dtype, normalization, head_dim) -> str:
    if normalization.stick_break is not None:
        return _check_fla_stick_breaking(device, dtype, normalization, head_dim)
    from . import fla_linear

    kernels = fla_linear.fla_kernels()  # imports fla: a failing import is the check's verdict
    limit = tolerance("fla", dtype)
    # (a) a prefill after a 20-key cache, 10 padded keys in item 1, returning the state
    leaves, exact = _inputs(device, dtype, 70, 90, head_dim, seed=5)
    key_valid = torch.ones(2, 90, dtype=torch.bool, device=device)
    key_valid[1, :10] = False
    got, got_state, got_count = fla_linear.fla_linear_attention(*leaves, key_valid, normalization,
                                                                return_state=True, kernels=kernels)
    want, state, count = linear_attention(*exact, key_valid, normalization, return_state=True)
    failure = (_outputs_and_gradients("a", got, want, leaves, exact, limit, seed=6)
               or _compare(got_state, state, "case (a), state", limit)
               or _compare(got_count, count.double(), "case (a), count", 0.0))
    if failure:
        return failure
    # (b) one decoded token from that state
    step, step_exact = _inputs(device, dtype, 1, 1, head_dim, seed=7)
    with torch.no_grad():
        got, got_state, _ = fla_linear.fla_linear_attention(
            *step, None, normalization, initial_state=got_state, initial_count=got_count, return_state=True,
            kernels=kernels)
        want, state, _ = linear_attention(*step_exact, None, normalization, initial_state=state, initial_count=count,
                                          return_state=True)
    return _compare(got, want, "case (b), output", limit) or _compare(got_state, state, "case (b), state", limit)


def _check_fla_stick_breaking(device, dtype, normalization, head_dim) -> str:
    from . import fla_stick_breaking

    kernel = fla_stick_breaking.fla_stickbreaking_kernel()  # imports fla: a failing import is the check's verdict
    limit = tolerance("fla", dtype)
    # (a) the implicit causal mask: 70 queries and keys
    leaves, exact = _inputs(device, dtype, 70, 70, head_dim, seed=9)
    got = fla_stick_breaking.fla_stick_breaking_attention(*leaves, None, normalization, kernel=kernel)
    want, _ = chunked_attention(*exact, None, normalization, causal=True)
    failure = _outputs_and_gradients("a", got, want, leaves, exact, limit, seed=10)
    if failure:
        return failure
    # (b) key padding: 30 padded keys on the left of item 1, 10 on the right of item 0 (packed sequences)
    leaves, exact = _inputs(device, dtype, 70, 70, head_dim, seed=11)
    key_valid = torch.ones(2, 70, dtype=torch.bool, device=device)
    key_valid[1, :30] = False
    key_valid[0, -10:] = False
    padding = KeyPadding(key_valid, 70, causal=True)
    got = fla_stick_breaking.fla_stick_breaking_attention(*leaves, padding, normalization, kernel=kernel)
    want, _ = chunked_attention(*exact, padding.dense(), normalization, causal=True)
    return _outputs_and_gradients("b", got, want, leaves, exact, limit, seed=12)

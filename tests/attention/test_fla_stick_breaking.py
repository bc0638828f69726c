"""Stick-breaking through flash-linear-attention's Triton kernel (``hf_knorm/attention/fla_stick_breaking.py``).

fla's stick-breaking kernels run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, which
``tests/conftest.py`` sets without CUDA) once their autotuner has one configuration (:func:`interpreted`: with
several it benchmarks them through a GPU driver, and there is none). So the real forward and backward kernels are
checked here, in fp32 (the interpreter multiplies IEEE fp32 values), against the project's chunked kernel in fp64:
outputs and the gradients of q, k and v, to ``1e-4`` of the largest value (with CUDA: on the GPU, to the self-check's
``2e-2``, fla's ``tl.dot`` taking TF32 for fp32 inputs). bf16 inputs are checked once, to the self-check's ``2e-2``,
with fla's kernels taught the bf16 product for that test (the interpreter multiplies bf16 tiles as raw bits:
``triton_interpreter.py``; measured there: 6.6e-3 on the output, at most 9.4e-3 on the gradients).

Before any kernel runs, the family's declaration is checked against fla's own definition: fla's plain reference with
``attend_current=True`` equals the family's weights (and ``attend_current=False`` does not).
"""

import os

import pytest
import torch

pytest.importorskip("fla", reason="fla-core is not installed (pip install 'hf_knorm[gpu]')")
pytestmark = pytest.mark.device  # make device runs fla's kernels on a GPU

from fla.ops.stickbreaking_attn import naive_stickbreaking_attn  # noqa: E402

from hf_knorm.attention import backends, fla_stick_breaking, self_check  # noqa: E402
from hf_knorm.attention.fla_stick_breaking import fla_stick_breaking_attention  # noqa: E402
from hf_knorm.attention.kernel import chunked_attention  # noqa: E402
from hf_knorm.attention.masks import CallLayout, KeyPadding  # noqa: E402
from hf_knorm.attention.paths import Path  # noqa: E402
from hf_knorm.normalizations import parse_normalization  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
STICK = parse_normalization("stick-breaking")
TOLERANCE = 2e-2 if CUDA else 1e-4


@pytest.fixture
def interpreted(monkeypatch):
    """fla's three stick-breaking kernels with one autotune configuration each (on the CPU: under the interpreter)."""
    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", (
        "no CUDA device and TRITON_INTERPRET is not set: run the tests through pytest from the repository (tests/"
        "conftest.py sets it before triton loads)")
    import fla.ops.stickbreaking_attn.parallel as parallel

    if not CUDA:
        for kernel in (parallel.parallel_stickbreaking_attn_fwd_kernel,
                       parallel.parallel_stickbreaking_attn_bwd_kernel_dq,
                       parallel.parallel_stickbreaking_attn_bwd_kernel_dkv):
            monkeypatch.setattr(kernel.fn, "configs", kernel.fn.configs[:1])  # Heuristics -> Autotuner


def _inputs(length, batch=2, q_heads=2, kv_heads=1, dim=16, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    shapes = (batch, q_heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim)
    return [torch.randn(shape, generator=generator, dtype=dtype).to(DEVICE) for shape in shapes]


def _close(got, want, what, tolerance=TOLERANCE):
    scale = want.abs().max().item() or 1.0
    assert torch.isfinite(got).all(), what
    error = (got.double() - want).abs().max().item() / scale
    assert error <= tolerance, f"{what}: largest error {error:.3g} of the largest value"


def test_the_family_is_fla_with_the_current_key_attended():
    """fla's plain reference (``naive_stickbreaking_attn``) with ``attend_current=True`` is the family on a causal
    mask (its own key counted, as Transformers' causal masks have it); ``False`` is not; and the declared
    :class:`StickBreak` reference is the family's weights on any mask."""
    query, key, value = (t.cpu().double() for t in _inputs(23))
    ours, _ = chunked_attention(query, key, value, None, STICK, scaling=0.4, causal=True)
    layout = lambda t: t.transpose(1, 2)  # noqa: E731
    theirs, _ = naive_stickbreaking_attn(layout(query), layout(key), layout(value), scale=0.4, attend_current=True)
    _close(theirs, ours, "attend_current=True", 1e-12)
    other, _ = naive_stickbreaking_attn(layout(query), layout(key), layout(value), scale=0.4, attend_current=False)
    assert (other - ours).abs().max() > 1e-2
    assert STICK.stick_break.own_key
    scores = 3 * torch.randn(2, 3, 7, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    allowed = torch.rand(2, 1, 7, 9, generator=torch.Generator().manual_seed(2)) > 0.3
    _close(STICK.stick_break.reference(scores, allowed), STICK.weights(scores, allowed), "declared form", 1e-12)


def _left_padding(length, padded=(0, 30)):
    key_valid = torch.ones(len(padded), length, dtype=torch.bool, device=DEVICE)
    for item, count in enumerate(padded):
        key_valid[item, :count] = False
    return KeyPadding(key_valid, length, causal=True)


def _right_and_inner_padding(length):
    """Item 0: 12 padded keys on the right; item 1: 3 on the left and a hole of 5 at 20-24."""
    key_valid = torch.ones(2, length, dtype=torch.bool, device=DEVICE)
    key_valid[0, -12:] = False
    key_valid[1, :3] = False
    key_valid[1, 20:25] = False
    return KeyPadding(key_valid, length, causal=True)


MASKS = {
    "causal": lambda length: None,
    "left padding": _left_padding,
    "right and inner padding": _right_and_inner_padding,
    "an item all padding": lambda length: _left_padding(length, padded=(length, 5)),
}


@pytest.mark.parametrize("case", list(MASKS))
def test_outputs_and_gradients_equal_the_chunked_kernel(interpreted, case):
    """70 tokens (a full and a ragged block of the forward's 64 rows, three of the backward's 32), GQA 2 over 1,
    fp32, against the chunked kernel in fp64: padded query rows before every real key give 0 as there, those after a
    real key (right, inner padding) attend the real keys before them, as there."""
    length = 70
    mask = MASKS[case](length)
    inputs = _inputs(length)
    leaves = [t.clone().requires_grad_() for t in inputs]
    exact = [t.double().requires_grad_() for t in inputs]
    got = fla_stick_breaking_attention(*leaves, mask, STICK, scaling=0.3)
    dense = mask.dense() if isinstance(mask, KeyPadding) else mask
    want, _ = chunked_attention(*exact, dense, STICK, scaling=0.3, causal=True)
    assert got.shape == want.shape == (2, length, 2, 16) and got.dtype == torch.float32
    _close(got, want, "output")
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    got_grads = torch.autograd.grad((got.double() * upstream).sum(), leaves)
    want_grads = torch.autograd.grad((want * upstream).sum(), exact)
    for name, grad, reference in zip("qkv", got_grads, want_grads):
        _close(grad, reference, f"d{name}")


def test_bf16_inputs_are_within_the_self_checks_tolerance(interpreted, monkeypatch):
    """bf16 operands with fp32 accumulation: on the CPU, fla's kernels taught the bf16 product for this test
    (``triton_interpreter.teach_bf16_dot``; the interpreter otherwise multiplies bf16 tiles as raw bits), within the
    self-check's ``2e-2`` of the largest fp64 value (the interpreter truncates where a GPU rounds)."""
    if not CUDA:
        import fla.ops.stickbreaking_attn.parallel as parallel

        from hf_knorm.attention.triton_interpreter import teach_bf16_dot

        kernels = [kernel.fn.fn for kernel in (parallel.parallel_stickbreaking_attn_fwd_kernel,
                                               parallel.parallel_stickbreaking_attn_bwd_kernel_dq,
                                               parallel.parallel_stickbreaking_attn_bwd_kernel_dkv)]
        for kernel in kernels:
            monkeypatch.setattr(kernel, "run", kernel.run)  # the taught launch is undone after the test
        teach_bf16_dot(*kernels)
    inputs = [t.to(torch.bfloat16) for t in _inputs(70, seed=4)]
    leaves = [t.clone().requires_grad_() for t in inputs]
    exact = [t.double().requires_grad_() for t in inputs]
    got = fla_stick_breaking_attention(*leaves, _left_padding(70), STICK)
    want, _ = chunked_attention(*exact, _left_padding(70).dense(), STICK, causal=True)
    assert got.dtype == torch.bfloat16
    limit = self_check.tolerance("fla", torch.bfloat16)
    _close(got, want, "output", limit)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    for name, grad, reference in zip("qkv", torch.autograd.grad((got.double() * upstream).sum(), leaves),
                                     torch.autograd.grad((want * upstream).sum(), exact)):
        _close(grad, reference, f"d{name}", limit)


def test_a_batch_without_a_real_key_gives_zeros():
    query, key, value = (t.cpu() for t in _inputs(9))
    padding = KeyPadding(torch.zeros(2, 9, dtype=torch.bool), 9, causal=True)
    got = fla_stick_breaking_attention(query, key, value, padding, STICK, kernel=_never)
    want, _ = chunked_attention(query, key, value, padding.dense(), STICK)
    assert torch.equal(got, torch.zeros(2, 9, 2, 16)) and torch.equal(want, got)


@pytest.mark.parametrize("padding", [_left_padding(12, padded=(0, 5)), _right_and_inner_padding(12)],
                         ids=["left", "right and inner"])
def test_an_explicit_padded_mask_reads_as_its_key_padding(padding):
    """The bool ``(B, 1, T, T)`` mask of padded keys gives the kernel the same packed sequences as its key padding
    (``paths.causal_key_validity``), so the kernel runs of the test above hold for it."""
    reason, key_valid = fla_stick_breaking.key_validity(padding.dense(), 12, 12)
    assert reason == "" and torch.equal(key_valid, padding.key_valid)
    assert fla_stick_breaking.key_validity(KeyPadding(padding.key_valid, 12, causal=True), 12, 12)[1] is not None
    assert fla_stick_breaking.key_validity(torch.ones(1, 1, 12, 12, dtype=torch.bool).tril(), 12, 12) == ("", None)


def _never(*args, **options):
    raise AssertionError("the kernel must not run on a refused call")


def _window(length):
    rows, keys = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return ((keys <= rows) & (keys > rows - 4)).expand(2, 1, length, length)


REFUSALS = [
    (dict(mask=_window), "the mask is not causal with padded keys"),
    (dict(mask=lambda length: KeyPadding(torch.ones(2, length, dtype=torch.bool), length, causal=False)),
     "bidirectional attention"),
    (dict(causal=False), "bidirectional attention"),
    (dict(q_len=1), "1 queries against 9 keys"),
    (dict(softcap=5.0), "a softcap on the scores"),
    (dict(bias=True), "an additive attention bias"),
    (dict(dtype=torch.float64), "fp32, bf16 or fp16 inputs, not torch.float64"),
    (dict(spelling="x^3/16"), r"stick-breaking weights \(Normalization.stick_break\), not x\^3/16"),
    (dict(dim=512), "head dimensions up to 256"),
]


@pytest.mark.parametrize(("case", "reason"), REFUSALS, ids=[reason[:24] for _, reason in REFUSALS])
def test_a_call_it_does_not_compute_is_refused_with_the_reason(case, reason):
    length = 9
    query, key, value = (t.cpu() for t in _inputs(length, dim=case.get("dim", 16), dtype=case.get("dtype",
                                                                                                  torch.float32)))
    query = query[:, :, -case.get("q_len", length):]
    mask = case.get("mask", lambda n: None)(length)
    bias = torch.zeros(2, 1, query.shape[2], length) if case.get("bias") else None
    with pytest.raises(ValueError, match=reason):
        fla_stick_breaking_attention(query, key, value, mask, parse_normalization(case.get("spelling",
                                                                                           "stick-breaking")),
                                     causal=case.get("causal", True), softcap=case.get("softcap"), bias=bias,
                                     kernel=_never)


def _chosen(layout, spelling="stick-breaking", dtype=torch.bfloat16, **options):
    query = torch.zeros(2, 4, layout.q_len if layout else 9, 16, dtype=dtype)
    settings = dict(dropout=0.0, return_weights=False, recording=False, compiling=False, layout=layout)
    return backends.with_kernel(Path(linear=False), query, parse_normalization(spelling), **{**settings, **options})


def test_the_dispatcher_chooses_fla_for_the_calls_it_computes(stub_cuda, monkeypatch):
    """With the self-check passed: a plain causal call and a padded one take fla; a sliding window, decoding, a
    window's part, dropout, returned weights, a softcap stay on the chunked kernel; forced, fla raises with the
    reason."""
    asked = []
    monkeypatch.setattr(backends, "verdict", lambda *key: asked.append(key) or "")
    plain = CallLayout(None, None, True, 9, 9)
    assert _chosen(plain).kernel == "fla"
    assert _chosen(CallLayout(_left_padding(9, (0, 3)), None, True, 9, 9)).kernel == "fla"
    assert _chosen(CallLayout(_right_and_inner_padding(9).dense(), None, True, 9, 9)).kernel == "fla"
    assert [key[0] for key in asked] == ["fla"] * 3
    assert backends.automatic_order(STICK) == ["fla"]
    refused = {"sliding window": (CallLayout(_window(9), None, True, 9, 9), {}),
               "decoding": (CallLayout(None, None, True, 1, 9), {}),
               "a window's part": (None, {}),
               "dropout": (plain, dict(dropout=0.1)),
               "weights": (plain, dict(return_weights=True)),
               "softcap": (plain, dict(softcap=5.0))}
    for layout, options in refused.values():
        assert _chosen(layout, **options).kernel == ""
    with backends.kernels(quadratic="fla"):
        assert _chosen(plain).kernel == "fla"
        with pytest.raises(ValueError, match="forces flash-linear-attention, which cannot compute this call: the "
                                             "mask is not causal with padded keys"):
            _chosen(refused["sliding window"][0])
        with pytest.raises(ValueError, match="it computes stick-breaking only: Normalization.stick_break"):
            _chosen(plain, "x^3/16")
    with backends.kernels(quadratic="pytorch"):
        assert _chosen(plain).kernel == ""


def test_fp32_takes_fla_only_where_tf32_is_asked_for(stub_cuda, monkeypatch):
    """fla's products take TF32 for fp32 inputs on a GPU: the automatic choice keeps fp32 calls on the chunked kernel
    while PyTorch's fp32 matmuls are at "highest" precision (its default), and takes fla at "high" or when forced."""
    monkeypatch.setattr(backends, "verdict", lambda *key: "")
    plain = CallLayout(None, None, True, 9, 9)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert _chosen(plain, dtype=torch.float32).kernel == ""
        assert _chosen(plain, dtype=torch.float16).kernel == "fla"
        with backends.kernels(quadratic="fla"):
            assert _chosen(plain, dtype=torch.float32).kernel == "fla"
        torch.set_float32_matmul_precision("high")
        assert _chosen(plain, dtype=torch.float32).kernel == "fla"
    finally:
        torch.set_float32_matmul_precision(precision)


def test_on_the_cpu_stick_breaking_stays_on_the_chunked_kernel(monkeypatch):
    monkeypatch.setattr(backends, "verdict", lambda *key: pytest.fail("no GPU kernel is checked on the CPU"))
    assert _chosen(CallLayout(None, None, True, 9, 9)).kernel == ""


def test_the_self_check_passes_and_catches_a_broken_kernel(interpreted, stub_cuda, monkeypatch):
    """The check the dispatcher runs before fla's first stick-breaking call (the real kernel, interpreted on the
    CPU), then a kernel whose key gradients are off by 5% (fla's plain reference, which is quick, with its key
    gradient scaled): caught, and the call stays on the chunked kernel, with a warning."""
    assert self_check.run_check("fla", torch.device(DEVICE), torch.float32, STICK, 16) == ""

    def broken(q, k, v, **options):
        k = k * 1.05 - (k * 0.05).detach()  # the same values, 5% more gradient
        return naive_stickbreaking_attn(q, k, v, **options)

    monkeypatch.setattr(fla_stick_breaking, "fla_stickbreaking_kernel", lambda: broken)
    failure = self_check.run_check("fla", torch.device(DEVICE), torch.float32, STICK, 16)
    assert failure.startswith("case (a), dk: largest error"), failure
    monkeypatch.setattr(self_check, "_VERDICTS", {})
    with pytest.warns(UserWarning, match="flash-linear-attention failed its self-check"):
        assert _chosen(CallLayout(None, None, True, 9, 9)).kernel == ""


def test_a_patched_model_runs_fla_for_its_prefill_and_the_chunked_kernel_for_decoding(interpreted, stub_cuda,
                                                                                        monkeypatch):
    """Through the plugin: a tiny Llama patched with stick-breaking, a batch with an item padded on the left and one
    on the right: its logits and every parameter's gradient; greedy decoding of the left-padded batch (fla for the
    prefill, the chunked kernel for each decoded token): equal to the PyTorch kernel's."""
    import hf_knorm
    from hf_knorm.attention.paths import attention_paths
    from tiny_models import assert_same_step, logits_and_grads, tiny_model

    monkeypatch.setattr(backends, "verdict", lambda *key: "")
    monkeypatch.setattr(backends, "tf32_blocker", lambda kind, dtype, forced: "")  # fp32, as where TF32 is asked for
    model = hf_knorm.patch(tiny_model("llama"), "stick-breaking").to(DEVICE)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    both = mask.clone()
    both[0, -2:] = 0
    with attention_paths() as paths:
        got = logits_and_grads(model, dict(input_ids=ids, attention_mask=both))
    assert set(paths) == {"fla"}
    with hf_knorm.kernels(quadratic="pytorch"):
        want = logits_and_grads(model, dict(input_ids=ids, attention_mask=both))
    assert_same_step(got, want, logits_atol=1e-4 * want[0].abs().max().item(), grads_relative=1e-4)
    inputs = dict(input_ids=ids, attention_mask=mask)
    with torch.no_grad(), attention_paths() as paths:
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert set(paths) == {"fla", "quadratic"}
    with torch.no_grad(), hf_knorm.kernels(quadratic="pytorch"):
        expected = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, expected)

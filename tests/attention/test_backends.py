"""Which kernel runs a call (``backends.py``): the rules on CUDA and on the CPU, the override, its errors, and the
self-check a GPU kernel passes before it computes anything (``self_check.py``).

The CUDA choices are checked with the device seam set to "cuda" (the tensors stay on the CPU). The rules' tests stub
the self-check out; the self-check's tests run it: the Triton kernel under Triton's interpreter (as on a GPU, bf16
operands included), fla's kernels through fla's own plain reference (its kernels need a GPU), and broken kernels,
which must be caught.
"""

import logging
import sys
import threading
import time
import warnings

import pytest
import torch

import hf_knorm
from hf_knorm.attention import backends, self_check
from hf_knorm.normalizations import parse_normalization
from hf_knorm.attention.masks import CallLayout
from hf_knorm.attention.paths import Path
from hf_knorm.extras import MissingExtraError

QUADRATIC, LINEAR = Path(linear=False, reason="x^3/16 is not linear"), Path(linear=True)
PLAIN = dict(dropout=0.0, return_weights=False, recording=False, compiling=False)


@pytest.fixture
def fresh(monkeypatch):
    """No verdict and no warning from an earlier test (the caches are per process)."""
    monkeypatch.setattr(self_check, "_VERDICTS", {})
    monkeypatch.setattr(backends, "_REPORTED", set())
    backends._CHOSEN.set({"quadratic": "auto", "linear": "auto"})


@pytest.fixture
def on_cuda(monkeypatch, fresh):
    monkeypatch.setattr(backends, "_device_type", lambda tensor: "cuda")
    monkeypatch.setattr(backends, "_importable", lambda module: True)


@pytest.fixture
def proven(monkeypatch, on_cuda):
    """Every kernel passes its self-check (the rules' tests): the verdicts asked for are kept in the list returned."""
    asked = []
    monkeypatch.setattr(backends, "verdict", lambda *key: asked.append(key) or "")
    return asked


@pytest.fixture
def fla_on_the_cpu(monkeypatch):
    """fla's plain reference in place of its kernels (which need a GPU)."""
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn

    from hf_knorm.attention import fla_linear

    monkeypatch.setattr(fla_linear, "fla_kernels", lambda: (naive_recurrent_linear_attn, naive_recurrent_linear_attn))
    return naive_recurrent_linear_attn


PLAIN_CAUSAL = CallLayout(None, None, True, 3, 3)
"""A plain causal call of 3 queries and keys, no mask (what a whole-call route reads)."""


def _name(path, spelling="x^3/16", dtype=torch.bfloat16, head_dim=4, **options):
    query = torch.zeros(1, 2, 3, head_dim, dtype=dtype)
    return backends.with_kernel(path, query, parse_normalization(spelling),
                                **{**PLAIN, "layout": PLAIN_CAUSAL, **options}).name


@pytest.fixture
def tf32_asked():
    """``torch.set_float32_matmul_precision("high")`` for the test: TF32 asked for, so fla takes fp32 calls."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


def test_on_cuda_the_gpu_kernels_take_what_they_compute(proven, tf32_asked):
    assert _name(QUADRATIC) == "triton"
    assert _name(QUADRATIC, dtype=torch.float16) == "triton"
    assert _name(LINEAR, "x/1") == "fla"
    assert _name(LINEAR, "x/sqrtN", dtype=torch.float32) == "fla"
    assert [(kernel, dtype) for kernel, _, dtype, *_ in proven] == [
        ("triton", torch.bfloat16), ("triton", torch.float16), ("fla", torch.bfloat16), ("fla", torch.float32)]


def test_fp32_reaches_fla_only_where_tf32_is_asked_for(proven):
    """fla's products take TF32 on a GPU: under the default 'highest' fp32 matmul precision an fp32 call stays on
    the PyTorch kernel (fp32 stays fp32), on both paths; forced, fla takes it."""
    assert torch.get_float32_matmul_precision() == "highest"
    assert _name(LINEAR, "x/1", dtype=torch.float32) == "linear"
    assert _name(QUADRATIC, "stick-breaking", dtype=torch.float32) == "quadratic"
    assert _name(LINEAR, "x/1", dtype=torch.bfloat16) == "fla"
    with backends.kernels(linear="fla", quadratic="fla"):
        assert _name(LINEAR, "x/1", dtype=torch.float32) == "fla"
        assert _name(QUADRATIC, "stick-breaking", dtype=torch.float32) == "fla"


@pytest.mark.parametrize("case", [dict(spelling="softmax", dropout=0.1), dict(dtype=torch.float64),
                                  dict(dropout=0.1), dict(return_weights=True), dict(recording=True),
                                  dict(compiling=True)],
                         ids=["softmax-dropout", "fp64", "dropout", "weights", "recording", "compiling"])
def test_on_cuda_the_rest_stays_on_the_pytorch_kernel(proven, case):
    assert _name(QUADRATIC, **case) == "quadratic"
    assert not proven  # nothing to check: the kernel is not asked


@pytest.mark.parametrize(("spelling", "automatic"), [("softmax", "sdpa"), ("ssmax(scale=learned)", "flex"),
                                                     ("softmax(sink=0)", "flex")])
def test_the_softmax_families_take_sdpa_or_flex_unless_forced_to_the_pytorch_kernel(proven, spelling, automatic):
    assert _name(QUADRATIC, spelling) == automatic
    assert _name(QUADRATIC, spelling, softcap=5.0) == "flex"  # SDPA has no softcap; FlexAttention's score_mod does
    assert [kernel for kernel, *_ in proven] == ["flex"] * (1 + (automatic == "flex"))  # SDPA: no self-check
    with backends.kernels(quadratic="pytorch"):
        assert _name(QUADRATIC, spelling) == "quadratic"
    with backends.kernels(quadratic="sdpa"):
        assert _name(QUADRATIC, spelling) == "sdpa"
        with pytest.raises(ValueError, match="forces SDPA, which cannot compute this call: a softcap on the scores"):
            _name(QUADRATIC, spelling, softcap=5.0)
    with backends.kernels(quadratic="flex"):
        assert _name(QUADRATIC, spelling, softcap=5.0) == "flex"
    assert _name(QUADRATIC, spelling, softcap=5.0) == "flex"  # the automatic choice again, outside the blocks
    assert _name(QUADRATIC, spelling, softcap=5.0, dropout=0.1) == "quadratic"


# The kernel each family takes (the first example of each registered family and each learned one): on CUDA (the
# device seam) and on the CPU. The order is issue 64's, to be confirmed by the device measurement (backends.py).
FAMILY_KERNELS = [
    ("softmax", "sdpa", "sdpa"),
    ("ssmax(scale=learned)", "flex", "sdpa"),
    ("ssmax(scale=0.144)", "flex", "sdpa"),
    ("softmax(sink=learned)", "flex", "sdpa"),
    ("sigmoid(bias=-log n)", "flex", "quadratic"),
    ("sigmoid(bias=learned)", "flex", "quadratic"),
    ("sigmoid(bias=-6.93)", "flex", "quadratic"),
    ("relu(x)/n", "triton", "quadratic"),
    ("relu(x)^2/n", "triton", "quadratic"),
    ("relu(x)^3/16", "triton", "quadratic"),
    ("x^2/16", "triton", "quadratic"),
    ("x^3/16", "triton", "quadratic"),
    ("softpick", "flex", "quadratic"),
    ("stick-breaking", "fla", "quadratic"),
]


@pytest.mark.parametrize(("spelling", "on_cuda", "on_cpu"), FAMILY_KERNELS, ids=[row[0] for row in FAMILY_KERNELS])
def test_each_family_takes_its_kernel_on_cuda_and_on_the_cpu(fresh, monkeypatch, spelling, on_cuda, on_cpu):
    assert _name(QUADRATIC, spelling, dtype=torch.float32) == on_cpu
    monkeypatch.setattr(backends, "_device_type", lambda tensor: "cuda")
    monkeypatch.setattr(backends, "_importable", lambda module: True)
    monkeypatch.setattr(backends, "verdict", lambda *key: "")
    assert _name(QUADRATIC, spelling) == on_cuda
    assert _name(QUADRATIC, spelling, return_weights=True) in ("quadratic", "sdpa")[: 1 + (on_cpu == "sdpa")]


def test_every_registered_family_is_in_the_table():
    from hf_knorm.normalizations.registry import FAMILIES, representative_spellings

    assert {parse_normalization(spelling).family for spelling, *_ in FAMILY_KERNELS} == set(FAMILIES)
    assert set(representative_spellings()) <= {spelling for spelling, *_ in FAMILY_KERNELS}


def test_flex_forced_on_a_family_without_its_route_says_why(proven):
    with backends.kernels(quadratic="flex"):
        for spelling in ("stick-breaking", "x^3/16"):
            with pytest.raises(ValueError, match="forces FlexAttention, which cannot compute this call: .*"
                                                 "Normalization.log_weights"):
                _name(QUADRATIC, spelling)
        assert _name(QUADRATIC, "relu(x)^2/n") == "flex"  # a rectified power has a logarithm: forced, it runs
        assert _name(QUADRATIC, "softpick", softcap=5.0) == "flex"  # a ratio of two: forced, it runs
        with pytest.raises(ValueError, match="forces FlexAttention, which cannot compute this call: attention dropout"):
            _name(QUADRATIC, "sigmoid", dropout=0.1)


@pytest.mark.parametrize("case", [dict(dtype=torch.float64), dict(recording=True), dict(compiling=True)],
                         ids=["fp64", "recording", "compiling"])
def test_on_cuda_the_linear_calls_fla_does_not_compute_stay_on_the_pytorch_kernel(proven, case):
    assert _name(LINEAR, "x/1", **case) == "linear"


def test_on_cuda_without_the_packages_the_pytorch_kernels_run(proven, monkeypatch):
    monkeypatch.setattr(backends, "_importable", lambda module: False)
    assert _name(QUADRATIC) == "quadratic"
    assert _name(LINEAR, "x/1") == "linear"
    assert not proven


def test_on_the_cpu_the_pytorch_kernels_run(fresh):
    assert _name(QUADRATIC) == "quadratic"
    assert _name(LINEAR, "x/16") == "linear"


def test_kernels_override_inside_their_block_and_refuse(proven, monkeypatch):
    with backends.kernels(quadratic="pytorch", linear="pytorch") as chosen:
        assert chosen == {"quadratic": "pytorch", "linear": "pytorch"}
        assert _name(QUADRATIC) == "quadratic" and _name(LINEAR, "x/1") == "linear"
        with backends.kernels(linear="auto") as inner:
            assert inner == {"quadratic": "pytorch", "linear": "auto"}
        assert backends.chosen_kernels() == {"quadratic": "pytorch", "linear": "pytorch"}  # the outer block's, restored
    assert backends.chosen_kernels() == {"quadratic": "auto", "linear": "auto"}
    with pytest.raises(ValueError, match="one of auto, pytorch, sdpa, triton, flex"):
        with backends.kernels(quadratic="flash"):
            pass
    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'hf_knorm\[gpu\]'"):
        with backends.kernels(quadratic="triton"):
            pass
    monkeypatch.setitem(sys.modules, "fla", None)
    with pytest.raises(MissingExtraError,
                       match=r"needs fla-core, which is not installed: pip install 'hf_knorm\[gpu\]'"):
        with backends.kernels(linear="fla"):
            pass
    assert backends.chosen_kernels() == {"quadratic": "auto", "linear": "auto"}  # a refused choice changes nothing


def test_use_kernels_still_works_for_one_release_and_says_what_replaces_it(fresh):
    with pytest.warns(DeprecationWarning, match="with hf_knorm.kernels"):
        assert hf_knorm.use_kernels(quadratic="pytorch")["quadratic"] == "pytorch"
    assert backends.chosen_kernels()["quadratic"] == "pytorch"


def test_a_forced_gpu_kernel_refuses_cpu_tensors(fresh, monkeypatch):
    backends._CHOSEN.set({"quadratic": "triton", "linear": "fla"})
    with pytest.raises(ValueError, match="it runs on CUDA tensors, and this call's are on cpu"):
        _name(QUADRATIC)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        _name(LINEAR, "x/1")


@pytest.mark.parametrize(("path", "case", "reason"), [
    (QUADRATIC, dict(spelling="softmax"), "softmax"),
    (QUADRATIC, dict(dtype=torch.float64), "it takes fp32, bf16 or fp16 inputs, not torch.float64"),
    (QUADRATIC, dict(dropout=0.1), "attention dropout"),
    (QUADRATIC, dict(return_weights=True), "the attention weights were requested"),
    (QUADRATIC, dict(recording=True), "the attention norms are recorded"),
    (QUADRATIC, dict(compiling=True), r"the call is traced by torch.compile \(compiled code runs the PyTorch kernels"),
    (LINEAR, dict(spelling="x/1", recording=True), "the attention norms are recorded"),
    (LINEAR, dict(spelling="x/1", dtype=torch.float64), "it takes fp32, bf16 or fp16 inputs, not torch.float64"),
], ids=["softmax", "fp64", "dropout", "weights", "recording", "compiling", "fla-recording", "fla-fp64"])
def test_a_forced_kernel_says_why_it_cannot_compute_a_call(proven, monkeypatch, path, case, reason):
    """Forcing a kernel is a promise that it computes the calls: one it cannot compute raises with the reason,
    rather than going to the PyTorch kernel unnoticed (compiled code included: a ``kernels`` block sets a tap, so the
    traced call reads the forced choice)."""
    kernel = "flash-linear-attention" if path.linear else "the Triton kernel"
    with backends.kernels(quadratic="triton", linear="fla"):
        with pytest.raises(ValueError, match=rf"forces {kernel}, which cannot compute this call: {reason}"):
            _name(path, **case)


def _broken(function, factor=1.05):
    """``function`` with its output off by ``factor`` (5%: far beyond every tolerance, small enough to look
    plausible)."""
    def broken(*args, **options):
        result = function(*args, **options)
        return (result[0] * factor, *result[1:]) if isinstance(result, tuple) else result * factor
    return broken


def test_the_triton_kernel_proves_itself_once_per_key(on_cuda, monkeypatch):
    """The real check, under Triton's interpreter: it passes, runs once for a key, again for another dtype."""
    runs = []
    run_check = self_check.run_check
    monkeypatch.setattr(self_check, "run_check", lambda *args: runs.append(args[:3]) or run_check(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a passing check warns about nothing
        assert _name(QUADRATIC, "x^3/16", head_dim=16) == "triton"
        assert _name(QUADRATIC, "x^3/1", head_dim=16) == "triton"  # same family (x^3/c): checked already
        assert _name(QUADRATIC, "x^3/16", dtype=torch.float32, head_dim=16) == "triton"
    assert runs == [("triton", torch.device("cpu"), torch.bfloat16), ("triton", torch.device("cpu"), torch.float32)]
    assert self_check.verdicts() == {("cpu", "bfloat16", "triton", "x^3/c", 16): "",
                                     ("cpu", "float32", "triton", "x^3/c", 16): ""}


def test_a_broken_triton_kernel_falls_back_with_one_warning_and_raises_when_forced(on_cuda, monkeypatch, caplog):
    from hf_knorm.attention import triton_kernel

    monkeypatch.setattr(triton_kernel, "triton_attention", _broken(triton_kernel.triton_attention))
    caplog.set_level(logging.DEBUG, logger="hf_knorm.attention")
    with pytest.warns(UserWarning, match=r"the Triton kernel failed its self-check against the PyTorch kernel on cpu "
                                         r"\(torch.float32, x\^3/c, head dim 16\): case \(a\), output: largest error "
                                         r"0.05 of the largest value \(tolerance 0.0001\)"):
        assert _name(QUADRATIC, dtype=torch.float32, head_dim=16) == "quadratic"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert _name(QUADRATIC, dtype=torch.float32, head_dim=16) == "quadratic"
    assert "quadratic kernel (PyTorch): the Triton kernel failed its self-check: case (a), output" in caplog.text
    backends._CHOSEN.set({"quadratic": "triton", "linear": "auto"})
    with pytest.raises(RuntimeError, match=r"forces the Triton kernel, and the Triton kernel failed its self-check.*"
                                           r"case \(a\), output: largest error 0.05"):
        _name(QUADRATIC, dtype=torch.float32, head_dim=16)


def test_a_triton_kernel_with_wrong_gradients_is_caught(on_cuda, monkeypatch):
    """Right outputs, a wrong dK (case (b): the explicit mask, bias and softcap): the check reads the gradients."""
    from hf_knorm.attention import triton_kernel

    real = triton_kernel.triton_attention

    class HalfKeyGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, key):
            return key.view_as(key)

        @staticmethod
        def backward(ctx, grad):
            return grad * 0.5

    def broken(query, key, value, allowed, *args, **options):
        return real(query, HalfKeyGrad.apply(key) if allowed is not None else key, value, allowed, *args, **options)

    monkeypatch.setattr(triton_kernel, "triton_attention", broken)
    with pytest.warns(UserWarning, match=r"case \(b\), dk: largest error"):
        assert _name(QUADRATIC, dtype=torch.float32, head_dim=16) == "quadratic"


def test_fla_proves_itself_and_a_broken_fla_is_caught(on_cuda, monkeypatch, fla_on_the_cpu, tf32_asked):
    """fla's check with fla's plain reference as its kernels passes; a recurrent kernel that drops the state it
    continues from (decoding) fails case (b)."""
    assert _name(LINEAR, "x/sqrtN", dtype=torch.float32, head_dim=16) == "fla"
    assert _name(LINEAR, "x/16", dtype=torch.bfloat16, head_dim=16) == "fla"
    from hf_knorm.attention import fla_linear

    def forgetful(*args, initial_state=None, **options):
        return fla_on_the_cpu(*args, initial_state=None, **options)

    monkeypatch.setattr(fla_linear, "fla_kernels", lambda: (fla_on_the_cpu, forgetful))
    monkeypatch.setattr(self_check, "_VERDICTS", {})
    with pytest.warns(UserWarning, match=r"flash-linear-attention failed its self-check.*case \(b\), output"):
        assert _name(LINEAR, "x/16", dtype=torch.float32, head_dim=16) == "linear"


def test_a_kernel_that_cannot_be_imported_or_run_is_reported_once_and_the_pytorch_kernel_runs(on_cuda, monkeypatch,
                                                                                               tf32_asked):
    """fla installed, but its kernels' module fails to import; then importable, but its Triton finds no GPU driver
    (fla's real kernels on a CPU)."""
    monkeypatch.setitem(sys.modules, "fla.ops.linear_attn", None)
    with pytest.warns(UserWarning, match=r"flash-linear-attention failed its self-check.*it raised "
                                         r"ModuleNotFoundError: import of fla.ops.linear_attn halted"):
        assert _name(LINEAR, "x/1", dtype=torch.float32, head_dim=16) == "linear"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _name(LINEAR, "x/1", dtype=torch.float32, head_dim=16) == "linear"
    monkeypatch.delitem(sys.modules, "fla.ops.linear_attn")
    with pytest.warns(UserWarning, match=r"flash-linear-attention failed its self-check.*it raised RuntimeError"):
        assert _name(LINEAR, "x/1", dtype=torch.bfloat16, head_dim=16) == "linear"


def test_the_check_runs_under_no_grad_and_leaves_the_random_state_alone(fresh, fla_on_the_cpu):
    """Generation runs under ``no_grad`` / ``inference_mode``; the check still differentiates, and draws its inputs
    from a generator of its own."""
    state = torch.get_rng_state()
    with torch.inference_mode():
        assert self_check.verdict("fla", torch.device("cpu"), torch.float32, parse_normalization("x/1"), 8) == ""
    with torch.no_grad():
        assert self_check.verdict("fla", torch.device("cpu"), torch.float16, parse_normalization("x/1"), 8) == ""
    assert torch.equal(torch.get_rng_state(), state)


def test_two_threads_share_one_check(fresh, monkeypatch):
    runs = []

    def slow(*args):
        runs.append(args)
        time.sleep(0.2)
        return ""

    monkeypatch.setattr(self_check, "run_check", slow)
    ask = lambda: self_check.verdict("triton", torch.device("cpu"), torch.float32,  # noqa: E731
                                     parse_normalization("x^3/16"), 64)
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(runs) == 1


def test_the_key_is_what_changes_the_kernels_code():
    key = lambda spelling, **o: self_check.key_of(  # noqa: E731
        o.get("kernel", "triton"), torch.device("cpu"), o.get("dtype", torch.bfloat16), parse_normalization(spelling),
        o.get("head_dim", 64))
    assert key("x^3/16") == key("x^3/1") == key("x^3/16 + softmax window 64 + sinks 4") == (
        "cpu", "bfloat16", "triton", "x^3/c", 64)
    assert len({key("x^3/16"), key("x^3/sqrtN"), key("x^2/16"), key("x^3/16", dtype=torch.float16),
                key("x^3/16", head_dim=128), key("x^3/16", kernel="fla")}) == 6
    assert key("x/16", kernel="fla")[3] == "x/c" and key("x/sqrtN")[3] == "x/sqrtN"

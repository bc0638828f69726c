"""The attention under autocast computes what it computes in fp32: the scores, the normalization and the sums in
fp32, forward and backward, for the kernels called directly and for every attention call of a patched model.

The bound. Every comparison is the largest difference over the largest entry of the fp32 result (of the same
inputs, without autocast). The attention now turns autocast off, so the two are the same computation: the tests
allow ``2^-16`` (1.5e-5) of the largest entry, fp32 summation-order room; measured: 0 in every test. The code
before, whose ``q.float() @ k.float().T`` autocast ran as a bf16 product, failed every test here by 2.2e-3 to 2.2e-2
of the largest entry (the softmax and x/1 ones least, x^3/16 most): 140 to 1,400 times the bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import tiny_model  # noqa: E402

import hf_knorm  # noqa: E402
from hf_knorm.attention.compiled import compiled_attention  # noqa: E402
from hf_knorm.attention.interface import ATTENTION_NAME, hf_knorm_attention  # noqa: E402
from hf_knorm.attention.kernel import chunked_attention  # noqa: E402
from hf_knorm.attention.linear_kernel import linear_attention  # noqa: E402
from hf_knorm.normalizations import parse_normalization  # noqa: E402
from hf_knorm.attention.paths import attention_paths  # noqa: E402

BOUND = 2.0**-16
"""Largest difference allowed, relative to the largest entry of the fp32 result (see the module docstring)."""


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _tensors(q_len=48, kv_len=48, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: (torch.randn(*shape, generator=generator) * 1.5).to(dtype).requires_grad_()  # noqa: E731
    return make(2, 4, q_len, 16), make(2, 2, kv_len, 16), make(2, 2, kv_len, 16)


def _kernel(name: str):
    """``name`` -> a function of ``(q, k, v)`` returning the output of that kernel entry (causal)."""
    if name == "linear x/1":
        return lambda q, k, v: linear_attention(q, k, v, None, parse_normalization("x/1"))
    normalization = parse_normalization(name.split()[-1])
    if name.startswith("op"):  # the compiled custom op, called eagerly (its autograd is the registered one)
        return lambda q, k, v: compiled_attention(q, k, v, None, None, normalization, scaling=None, softcap=None,
                                                  causal=True)
    return lambda q, k, v: chunked_attention(q, k, v, None, normalization, causal=True, chunk_elements=2000)[0]


KERNELS = ["chunked softmax", "chunked x^3/16", "linear x/1", "op softmax", "op x^3/16"]
HAND_WRITTEN_BACKWARD = ["chunked softmax", "chunked x^3/16", "op softmax", "op x^3/16"]


def _output_and_grads(function, tensors, upstream, autocast_forward: bool, autocast_backward: bool):
    inputs = [t.detach().requires_grad_() for t in tensors]
    with _autocast() if autocast_forward else torch.autocast("cpu", enabled=False):
        output = function(*inputs)
    with _autocast() if autocast_backward else torch.autocast("cpu", enabled=False):
        grads = torch.autograd.grad(output, inputs, upstream.to(output.dtype))
    return output, grads


@pytest.mark.parametrize("name", KERNELS)
def test_a_kernel_under_autocast_computes_its_fp32_result(name):
    function, tensors = _kernel(name), _tensors()
    upstream = torch.randn(2, 48, 4, 16, generator=torch.Generator().manual_seed(1))
    want, want_grads = _output_and_grads(function, tensors, upstream, False, False)
    got, grads = _output_and_grads(function, tensors, upstream, True, False)  # backward outside, as the Trainer does
    assert got.dtype == torch.float32  # the query's dtype
    assert _relative(got, want) <= BOUND
    for letter, grad, want_grad in zip("qkv", grads, want_grads):
        assert _relative(grad, want_grad) <= BOUND, f"d{letter}"


@pytest.mark.parametrize("name", HAND_WRITTEN_BACKWARD)
def test_a_hand_written_backward_called_under_autocast_computes_in_fp32(name):
    """A backward runs under its caller's autocast state: the chunked kernel's autograd Function and the custom op's
    backward turn it off themselves."""
    function, tensors = _kernel(name), _tensors()
    upstream = torch.randn(2, 48, 4, 16, generator=torch.Generator().manual_seed(1))
    _, want_grads = _output_and_grads(function, tensors, upstream, False, False)
    _, grads = _output_and_grads(function, tensors, upstream, True, True)
    for letter, grad, want_grad in zip("qkv", grads, want_grads):
        assert _relative(grad, want_grad) <= BOUND, f"d{letter}"


@pytest.mark.parametrize("name", KERNELS)
def test_bf16_inputs_give_a_bf16_output_computed_in_fp32(name):
    function, tensors = _kernel(name), _tensors(dtype=torch.bfloat16)
    want = function(*tensors)
    with _autocast():
        got = function(*tensors)
    assert got.dtype == want.dtype == torch.bfloat16
    assert _relative(got, want) <= BOUND


NORMALIZATIONS = {  # the normalization and how many tokens take the path named
    "softmax": (40, "sdpa"),  # PyTorch's SDPA (hf_knorm/attention/sdpa.py)
    "x^3/16": (40, "quadratic"),
    "x/1": (130, "linear"),  # 128 queries or more: the linear kernel
    "x^3/16 + softmax window 8 + sinks 2": (40, "quadratic"),
}


@pytest.mark.parametrize("normalization", list(NORMALIZATIONS))
def test_every_attention_call_of_a_model_under_autocast_is_its_fp32_result(normalization):
    """A training step of a patched tiny Llama under bf16 autocast (backward outside it, as the Trainer does): each
    attention call's output and its gradients with respect to the bf16 query, key and value are those of the same
    call computed without autocast, on the same inputs and the same upstream gradient."""
    length, path = NORMALIZATIONS[normalization]
    model = hf_knorm.patch(tiny_model("llama"), normalization)
    calls = []

    def recording(module, query, key, value, attention_mask, *args, **kwargs):
        for tensor in (query, key, value):
            tensor.retain_grad()
        output, weights = hf_knorm_attention(module, query, key, value, attention_mask, *args, **kwargs)
        output.retain_grad()
        calls.append((module, query, key, value, attention_mask, args, kwargs, output))
        return output, weights

    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0))
    AttentionInterface.register(ATTENTION_NAME, recording)
    try:
        with attention_paths() as paths, _autocast():
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        AttentionInterface.register(ATTENTION_NAME, hf_knorm_attention)
    loss.backward()
    assert paths[path] == len(calls) == 2
    for module, query, key, value, mask, args, kwargs, output in calls:
        assert value.dtype == torch.bfloat16 and output.dtype == query.dtype  # autocast's v_proj; the query's dtype
        inputs = [t.detach().requires_grad_() for t in (query, key, value)]
        want, _ = hf_knorm_attention(module, *inputs, mask, *args, **kwargs)
        want_grads = torch.autograd.grad(want, inputs, output.grad)
        assert _relative(output, want) <= BOUND
        for letter, got, want_grad in zip("qkv", (query.grad, key.grad, value.grad), want_grads):
            assert _relative(got, want_grad) <= BOUND, f"d{letter}"

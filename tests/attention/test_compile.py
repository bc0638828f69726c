"""torch.compile: a patched model compiles with no graph break (``fullgraph=True``) and computes
what it computes in eager mode, through the custom op (training, inference) or the traced kernels (with a tap set);
the taps (norm recording) still work in a compiled model.

Tolerances (fp32): logits within 1e-5 absolute of eager; each parameter's gradient within 1e-4 of its largest entry.
Measured on four of the cases: logits at most 2.8e-6 apart, gradients 5.3e-6 of their largest entry (the compiled
kernels' summation order).
Each case compiles the model forward and backward: 10-60 s on this machine's CPU with inductor, so inductor compiles each
kind of graph once (SDPA, the custom op with and without a learned value, here; the traced linear kernel inside the
band route, tests/attention/test_window_compile.py), and the other cases (the other ``x^p/c``, sliding windows,
softcaps, the taps' recompilation) run ``aot_eager``: Dynamo's capture (no graph break) and AOTAutograd's forward and
backward on the same ops, without the code generation that costs the time.
"""

import pytest
import torch

import hf_knorm
from hf_knorm.attention import paths
from hf_knorm.attention.compiled import attention_op
from hf_knorm.normalizations import PAPER_NORMALIZATIONS
from hf_knorm.attention.paths import attention_paths
from hf_knorm.attention.taps import taps_set

from tiny_models import assert_same_step, logits_and_grads, tiny_inputs, tiny_model


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _padded_inputs(model_type: str, length: int) -> dict[str, torch.Tensor]:
    inputs = tiny_inputs(model_type, length=length)
    inputs["attention_mask"][0, :3] = 0  # left padding in the first row
    return inputs




# x/1 at 130 tokens: eager and compiled take the linear path (the mask is key padding: its form says it is causal).
INDUCTOR = {"softmax", "x^3/16"}
"""The paper's normalizations compiled by inductor: SDPA and the custom op (the traced linear kernel: in
tests/attention/test_window_compile.py, inside the band route)."""
CASES = [("llama", spelling, 130 if spelling == "x/1" else 12, "inductor" if spelling in INDUCTOR else "aot_eager")
         for spelling in PAPER_NORMALIZATIONS]
CASES += [
    ("mistral", "x^3/sqrtN", 12, "aot_eager"),  # a sliding window shorter than the sequence
    ("gemma2", "x/16", 12, "aot_eager"),  # softcapped scores
    ("llama", "sigmoid(bias=learned)", 12, "inductor"),  # a learned value: its gradient from the op's backward
]


@pytest.mark.parametrize(("model_type", "spelling", "length", "backend"), CASES)
def test_compiled_model_matches_eager_without_graph_breaks(model_type, spelling, length, backend):
    model = tiny_model(model_type).train()
    hf_knorm.patch(model, normalization=spelling)
    inputs = _padded_inputs(model_type, length)
    with attention_paths() as paths:
        eager_logits, eager_grads = logits_and_grads(model, inputs)
    eager_path = "linear" if (spelling == "x/1" and length >= 128) else "sdpa" if spelling == "softmax" else "quadratic"
    assert paths[eager_path] > 0
    assert not taps_set()

    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break is an error
    assert_same_step(logits_and_grads(compiled, inputs), (eager_logits, eager_grads), logits_atol=1e-5,
                     grads_relative=1e-4)


def test_norm_recording_in_a_compiled_model_matches_eager():
    """With a recorder set, the compiled model is recompiled with the tap reads (graph breaks) and the traced kernels:
    the norms, the logits and the gradients are the eager ones. ``aot_eager``: the recompilation is Dynamo's, and
    inductor compiles the same op above."""
    model = tiny_model("llama").train()
    hf_knorm.patch(model, normalization="x^3/16")
    inputs = _padded_inputs("llama", 12)
    with hf_knorm.record_norms(model) as eager:
        eager_logits, eager_grads = logits_and_grads(model, inputs)
    compiled = torch.compile(model, backend="aot_eager")
    logits_and_grads(compiled, inputs)  # compiled without the taps: the custom op
    with hf_knorm.record_norms(model) as recorder:  # a tap set: recompiled
        logits, grads = logits_and_grads(compiled, inputs)
    assert not taps_set()
    torch.testing.assert_close(logits, eager_logits, rtol=0, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=0, atol=1e-4 * eager_grads[name].abs().max().item())
    for got, want in zip(recorder.layers, eager.layers, strict=True):
        torch.testing.assert_close(got.attention_frobenius(), want.attention_frobenius(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.key_channel_norms(), want.key_channel_norms(), rtol=1e-6, atol=0)
        torch.testing.assert_close(got.value_channel_norms(), want.value_channel_norms(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("train", [True, False], ids=["forward-backward", "inference"])
def test_compiled_x1_traces_the_linear_kernel_with_no_n_by_n_tensor(train):
    """A left-padded batch of 130 tokens: the compiled graph (fullgraph) holds the linear kernel, not the custom op,
    and no tensor with two axes of the sequence's length (no mask, no scores); logits and gradients are eager's.
    The graph runs as Dynamo captured it (inductor compiles the linear kernel in test_window_compile.py)."""

    length = 130
    model = tiny_model("llama").train(train)
    hf_knorm.patch(model, normalization="x/1")
    inputs = _padded_inputs("llama", length)
    eager_logits, eager_grads = logits_and_grads(model, inputs)
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(model, backend=recording, fullgraph=True)
    if train:
        logits, grads = logits_and_grads(compiled, inputs)
    else:
        with torch.no_grad():
            logits, grads = compiled(**inputs).logits, {}
    (graph,) = graphs
    targets = {str(node.target) for node in graph.graph.nodes}
    assert not any("hf_knorm" in target for target in targets), sorted(targets)
    shapes = [tuple(node.meta["example_value"].shape) for node in graph.graph.nodes
              if isinstance(node.meta.get("example_value"), torch.Tensor)]
    assert not [shape for shape in shapes if list(shape).count(length) >= 2], "an N x N tensor in the graph"
    assert_same_step((logits, grads), (eager_logits, eager_grads), logits_atol=1e-5, grads_relative=1e-4)


@pytest.mark.parametrize("spelling", ["softmax", "x^3/16", "x/1", "sigmoid(bias=learned)", "ssmax(scale=learned)"])
def test_the_custom_op_passes_opcheck(spelling, monkeypatch):
    """torch.library.opcheck: the fake implementation's shapes, the schema, the autograd registration."""
    monkeypatch.setattr(paths, "LINEAR_MIN_QUERIES", 1)  # x/1 without gradients: the linear kernel on 6 queries
    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    query, key, value = make(2, 4, 6, 8).requires_grad_(), make(2, 2, 6, 8).requires_grad_(), make(2, 2, 6, 8)
    allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    allowed[0, :, :, :2] = False
    normalization = hf_knorm.parse_normalization(spelling)
    values = [torch.linspace(-1.0, 0.5, 4, dtype=torch.float64).requires_grad_() for _ in normalization.learnable()]
    for linear_ok, args, learned in ((False, (query, key, value.requires_grad_()), values),
                                     (True, (query.detach(), key.detach(), value.detach()), [v.detach() for v in values])):
        torch.library.opcheck(attention_op, (*args, allowed, None, learned, normalization.name, 0.35, None, True,
                                             linear_ok))


@pytest.mark.parametrize("spelling", ["softmax", "x^3/sqrtN"])
@pytest.mark.parametrize("masked", [True, False], ids=["bool-mask", "implicit-causal-keys-cut"])
def test_the_ops_kernels_give_the_training_paths_values(spelling, masked):
    """chunked_forward / chunked_backward (what the op runs) against chunked_attention under autograd, fp64."""
    from hf_knorm.attention.kernel import chunked_attention, chunked_backward, chunked_forward

    generator = torch.Generator().manual_seed(1)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    query, key, value = make(2, 4, 5, 8).requires_grad_(), make(2, 2, 7, 8).requires_grad_(), make(2, 2, 7, 8)
    value.requires_grad_()
    allowed = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril(diagonal=2) if masked else None
    normalization = hf_knorm.parse_normalization(spelling)
    options = dict(scaling=0.3, causal=True)
    reference, _ = chunked_attention(query, key, value, allowed, normalization, **options)
    upstream = make(*reference.shape)
    expected = torch.autograd.grad(reference, (query, key, value), upstream)
    with torch.no_grad():
        output = chunked_forward(query, key, value, allowed, normalization, **options)
        grads = chunked_backward(upstream, query, key, value, output, allowed, normalization, **options)
    torch.testing.assert_close(output, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

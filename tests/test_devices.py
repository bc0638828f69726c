"""The core set on every device: CUDA where there is one (skipped otherwise), and the CPU in bf16.

Run alone with ``pytest -m device``. Tolerances are bf16's: outputs compared with an fp32 computation of the same
(bf16-rounded) inputs within 2e-2 of their largest value; fp32 on CUDA within 1e-4 (TF32 off).
"""

import pytest
import torch
from tiny_models import tiny_inputs, tiny_model
from transformers import DynamicCache

import hf_knorm
from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.attention.linear_kernel import is_linear, linear_attention
from hf_knorm.normalizations import parse_normalization, representative_spellings
from hf_knorm.attention.reference import reference_attention
from hf_knorm.compat import cache_kwargs, output_cache
from hf_knorm.recording.record_norms import record_norms

pytestmark = pytest.mark.device

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
SETUPS = [
    pytest.param(("cpu", torch.bfloat16), id="cpu-bf16"),
    pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=CUDA),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=CUDA),
]


def _tolerance(dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 1e-4


MODEL_BF16_TOLERANCE = 5e-2
"""A whole bf16 model (every weight and activation rounded, not only the attention's inputs) against fp32: measured at
on the CPU in bf16, relu(x)/n 2.7e-2 of the largest logit, x^3/16 above 2e-2, every other family below 2e-2."""


def _close(actual, expected, dtype, what="", tolerance=None):
    scale = expected.abs().max().clamp_min(1e-6)
    error = (actual.float() - expected.float()).abs().max() / scale
    assert error < (tolerance or _tolerance(dtype)), f"{what}: relative error {error:.2e}"


@pytest.fixture(autouse=True)
def _no_tf32():
    if torch.cuda.is_available():
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
        torch.backends.cuda.matmul.allow_tf32 = previous
    else:
        yield


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("spelling", ["softmax", "x/1", "x^3/16", "x^3/sqrtN"])
def test_kernels_forward_and_backward_against_the_reference(setup, spelling):
    device, dtype = setup
    normalization = parse_normalization(spelling)
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 6, 300, 16), (2, 2, 300, 16), (2, 2, 300, 16)]
    inputs = [(torch.randn(shape, generator=generator) * 0.5).to(device, dtype).requires_grad_() for shape in shapes]
    exact = [tensor.detach().float().requires_grad_() for tensor in inputs]
    expected, _ = reference_attention(*exact, None, normalization, causal=True)
    grad = torch.randn(expected.shape, generator=generator).to(device)
    expected_grads = torch.autograd.grad((expected * grad).sum(), exact)
    kernels = {"quadratic": lambda q, k, v: chunked_attention(q, k, v, None, normalization, causal=True)[0]}
    if is_linear(normalization):
        kernels["linear"] = lambda q, k, v: linear_attention(q, k, v, None, normalization)
    for name, kernel in kernels.items():
        output = kernel(*inputs)
        assert output.device.type == device and output.dtype == dtype
        _close(output, expected, dtype, f"{name} output")
        for letter, got, want in zip("qkv", torch.autograd.grad((output.float() * grad).sum(), inputs),
                                     expected_grads):
            _close(got, want, dtype, f"{name} d{letter}")


@pytest.mark.parametrize("setup", SETUPS)
def test_patched_softmax_equals_native_attention(setup):
    device, dtype = setup
    native = tiny_model("llama", dtype=dtype).to(device)
    patched = hf_knorm.patch(tiny_model("llama", dtype=dtype).to(device), "softmax")
    inputs = {key: value.to(device) for key, value in tiny_inputs("llama").items()}
    with torch.no_grad():
        _close(patched(**inputs).logits, native(**inputs).logits, dtype, "logits")


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("spelling", ["x/1", "x^3/16"])
def test_generation_on_the_device(setup, spelling):
    """x/1 decodes with its state, x^3/16 with a K/V cache; the logits of every decoding step are the full forward's
    over the generated sequence (no cache at all: a reference independent of either cache, teacher-forced so that
    a near tie in bf16 cannot make the two compare different sequences)."""
    device, dtype = setup
    model = hf_knorm.patch(tiny_model("llama", dtype=dtype).to(device), spelling)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                   pad_token_id=0)
    out = model.generate(input_ids=ids, return_dict_in_generate=True, output_logits=True, **options)
    assert out.sequences.device.type == device
    kind = hf_knorm.RecurrentStateCache if spelling == "x/1" else DynamicCache
    assert isinstance(output_cache(out), kind)
    with torch.no_grad():
        full = model(input_ids=out.sequences, attention_mask=torch.ones_like(out.sequences)).logits
    steps = torch.stack(out.logits, dim=1)  # (B, 6, V): what each decoding step chose its token from
    _close(steps, full[:, ids.shape[1] - 1: -1], dtype, "decoding steps' logits")
    if spelling == "x^3/16":  # KNorm at ratio 0 keeps everything: the same tokens as the DynamicCache
        expected = model.generate(input_ids=ids, **options, **cache_kwargs(DynamicCache()))
        knorm = hf_knorm.KNormCache(0.0, config=model.config)
        assert model.generate(input_ids=ids, **options, **cache_kwargs(knorm)).tolist() == expected.tolist()


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("spelling", representative_spellings())
def test_every_family_on_the_device_against_fp32_on_the_cpu(setup, spelling):
    """Each family patched into the same tiny model: a padded batch's logits on the device within the setup's
    tolerance of fp32 on the CPU, finite gradients for every learnable value, and KV-cache decoding equal to the full
    forward on the device."""
    device, dtype = setup
    inputs = tiny_inputs("llama")
    inputs["attention_mask"][0, :3] = 0
    real = inputs["attention_mask"].bool()
    reference = hf_knorm.patch(tiny_model("llama"), spelling)
    model = hf_knorm.patch(tiny_model("llama", dtype=dtype).to(device), spelling)
    with torch.no_grad():
        expected = reference(**inputs).logits
    logits = model(**{key: value.to(device) for key, value in inputs.items()}).logits
    assert logits.device.type == device and logits.dtype == dtype
    _close(logits.cpu()[real], expected[real], dtype, f"{spelling} logits",
           MODEL_BF16_TOLERANCE if dtype == torch.bfloat16 else None)
    logits.float()[real.to(device)].square().mean().backward()
    learned = [parameter for name, parameter in model.named_parameters() if "hf_knorm_" in name]
    assert len(learned) == ("learned" in spelling) * model.config.num_hidden_layers
    assert all(parameter.grad is not None and torch.isfinite(parameter.grad).all() for parameter in learned)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0)).to(device)
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4, min_new_tokens=4,
                   pad_token_id=0)
    out = model.generate(input_ids=ids, return_dict_in_generate=True, output_logits=True, **options)
    with torch.no_grad():
        full = model(input_ids=out.sequences, attention_mask=torch.ones_like(out.sequences)).logits
    _close(torch.stack(out.logits, dim=1), full[:, ids.shape[1] - 1: -1], dtype, f"{spelling} decoding steps")


@pytest.mark.parametrize("setup", SETUPS)
def test_recorded_norms_on_the_device_equal_fp32_on_the_cpu(setup):
    device, dtype = setup
    inputs = tiny_inputs("llama")
    values = {}
    for label, where, precision in (("device", device, dtype), ("reference", "cpu", torch.float32)):
        model = hf_knorm.patch(tiny_model("llama", dtype=precision).to(where), "x^3/16")
        with torch.no_grad(), record_norms(model) as recorder:
            model(**{key: value.to(where) for key, value in inputs.items()})
        values[label] = recorder.layers
    for got, want in zip(values["device"], values["reference"]):
        _close(got.attention_frobenius(), want.attention_frobenius(), dtype, "attention norms")
        _close(got.key_channel_norms(), want.key_channel_norms(), dtype, "key norms")

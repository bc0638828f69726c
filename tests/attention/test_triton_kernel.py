"""The Triton kernel of ``x^p/c`` against the plain reference: outputs and gradients, every case it serves.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before triton is first imported: ``triton.jit`` reads it when it decorates), on the CPU; with
CUDA they run compiled, on the GPU. Small shapes with 16 x 16 blocks, so every case crosses several query and key
blocks and ragged edges (37 rows); the half-precision cases also at the production blocks (64 x 64, 100 rows). The
interpreter runs the code a GPU runs, bf16 operands included (``triton_interpreter.py`` teaches it bf16 products;
``test_bf16_multiplies_bf16_operands_at_the_production_blocks`` shows they reach ``tl.dot``).

Tolerances: fp32 inputs, ``rtol = atol = 1e-4`` relative to the largest reference value (measured errors ~1e-6 under
the interpreter; TF32 is not used for fp32 inputs); bf16 and fp16 inputs against the reference in fp64 on the same
rounded inputs, ``2e-2`` of the largest value (the output is rounded to 8 or 11 bits; the sums are fp32).
"""

import contextlib
import threading

import pytest
import torch

triton_kernel = pytest.importorskip("hf_knorm.attention.triton_kernel",
                                    reason="triton is not installed (pip install 'hf_knorm[gpu]')")

from hf_knorm.normalizations import parse_normalization  # noqa: E402
from hf_knorm.attention.reference import reference_attention  # noqa: E402

import triton  # noqa: E402  (installed: hf_knorm.attention.triton_kernel imported it)
import triton.language as tl  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.device]  # make device runs them compiled on a GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = dict(block_m=16, block_n=16)


def _tensors(batch=2, q_heads=4, kv_heads=2, q_len=37, kv_len=37, dim=8, dtype=torch.float32, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: (scale * torch.randn(*shape, generator=generator)).to(DEVICE, dtype)  # noqa: E731
    tensors = make(batch, q_heads, q_len, dim), make(batch, kv_heads, kv_len, dim), make(batch, kv_heads, kv_len, dim)
    return tuple(t.requires_grad_() for t in tensors)


def _padded_causal_mask(batch, q_len, kv_len, pad, window=None):
    """Bottom-right causal bool ``(B, 1, q, kv)``; item 1 left-padded by ``pad``; optionally a sliding window."""
    rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
    keys = torch.arange(kv_len)[None, :]
    mask = keys <= rows
    if window is not None:
        mask &= keys > rows - window
    mask = mask.expand(batch, 1, q_len, kv_len).clone()
    mask[1, :, :, :pad] = False
    return mask.to(DEVICE)


def _check(spelling, q, k, v, mask, *, rtol=1e-4, grads=True, blocks=BLOCKS, **options):
    """Output and gradients of the Triton kernel against the reference (fp64 on the same inputs); ``blocks={}``: the
    production block sizes."""
    normalization = parse_normalization(spelling)
    out = triton_kernel.triton_attention(q, k, v, mask, normalization, **options, **blocks)
    reference_options = {key: value for key, value in options.items() if key != "bias"}
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if "bias" in options:  # the reference takes no bias: add it through the scores' definition, by hand
        ref = _reference_with_bias(*leaves, mask, normalization, options["bias"], **reference_options)
    else:
        ref, _ = reference_attention(*leaves, mask, normalization, **reference_options)
    assert out.dtype == q.dtype and out.shape == ref.shape
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=rtol * scale, msg=lambda m: f"output: {m}")
    if not grads:
        return
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))
    want = torch.autograd.grad((ref * upstream.double()).sum(), leaves)
    for name, grad, ref_grad in zip("qkv", got, want):
        assert grad.dtype == q.dtype
        torch.testing.assert_close(grad.double(), ref_grad, rtol=rtol, atol=rtol * ref_grad.abs().max().item(),
                                   msg=lambda m: f"d{name}: {m}")


def _reference_with_bias(q, k, v, allowed, normalization, bias, scaling=None, softcap=None, causal=False):
    """The reference with an additive bias on the (softcapped) scores, written out: ``s = cap*tanh(r/cap) + bias``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + bias.double()
    weights = normalization.pointwise.reference(scores, allowed.expand_as(scores))
    return (weights @ v).transpose(1, 2)


@pytest.mark.parametrize("spelling", ["x/1", "x/16", "x^2/4", "x^3/1", "x^3/16", "x^3/sqrtN", "relu(x)/n",
                                      "relu(x)^2/n", "relu(x)^3/16", "relu(x)^2/sqrtN"])
def test_every_power_and_constant_with_a_padded_causal_mask_and_gqa(spelling):
    """4 query heads over 2 KV heads (K and V are never repeated: query head h reads KV head h // 2)."""
    q, k, v = _tensors()
    _check(spelling, q, k, v, _padded_causal_mask(2, 37, 37, pad=5), scaling=0.4)


@pytest.mark.parametrize("spelling", ["x^3/16", "x/sqrtN", "relu(x)/n", "relu(x)^2/n"])
def test_softcap_and_the_implicit_causal_mask(spelling):
    """No mask and ``causal``: top-left causal, computed from indices (sqrtN: row i counts i + 1 keys); a softcap of
    2 bends most scores."""
    q, k, v = _tensors(q_heads=6, kv_heads=2)
    _check(spelling, q, k, v, None, softcap=2.0, causal=True)


def test_sliding_window_and_a_cache_longer_than_the_queries():
    """5 queries against 40 keys (a chunked prefill with a cache), a 12-key window, a per-head mask, sqrtN."""
    q, k, v = _tensors(q_len=5, kv_len=40)
    mask = _padded_causal_mask(2, 5, 40, pad=30, window=12).expand(2, 4, 5, 40).clone()
    mask[:, 3, :, -1] = False  # one query head's mask differs: the mask is read per head
    _check("x^3/sqrtN", q, k, v, mask)


@pytest.mark.parametrize(("spelling", "q_len"), [("x^3/sqrtN", 20), ("x^3/16", 1)], ids=["encoder", "decode-step"])
def test_no_mask(spelling, q_len):
    """Every query attends every key: an encoder (sqrtN: c = sqrt(29)), or one decoded token against a cache."""
    q, k, v = _tensors(q_len=q_len, kv_len=29)
    _check(spelling, q, k, v, None)


def test_additive_bias_and_fully_masked_rows():
    """An additive float mask with biases, as the kernels take it (a bool mask and a bias that is 0 where masked), and
    query rows that attend nothing (left padding in a square mask): their output is exactly 0."""
    q, k, v = _tensors()
    allowed = _padded_causal_mask(2, 37, 37, pad=5)
    allowed[1, :, :5] = False  # padded queries attend nothing
    generator = torch.Generator().manual_seed(3)
    bias = torch.where(allowed.cpu(), 0.3 * torch.randn(allowed.shape, generator=generator), 0.0).to(DEVICE)
    _check("x^3/sqrtN", q, k, v, allowed, bias=bias, softcap=3.0)
    out = triton_kernel.triton_attention(q, k, v, allowed, parse_normalization("x^3/16"), bias=bias, **BLOCKS)
    assert (out[1, :5] == 0).all()


HALF = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def _large_scores(q_len, dim, dtype, scale=4.0):
    """Scores up to ~75 (q and k scaled by 4; ~50 by 3): their cubes (~4e5; ~1e5) overflow fp16 (max 65504), the
    output (small values: v scaled by 0.05) does not."""
    q, k, v = _tensors(q_len=q_len, kv_len=q_len, dim=dim, dtype=dtype, scale=scale)
    v = (v.detach() * 0.05).requires_grad_()
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * dim**-0.5
    assert scores.abs().max() ** 3 > torch.finfo(torch.float16).max  # the case these tests are about
    return q, k, v


@HALF
def test_half_precision_accumulates_in_fp32(dtype):
    """fp16 products are taken on fp32 operands (cubes overflow fp16); bf16 multiplies bf16 operands (``w`` split in
    two bf16 tiles) and sums in fp32. Outputs and gradients finite and right."""
    q, k, v = _large_scores(24, 16, dtype)
    _check("x^3/16", q, k, v, _padded_causal_mask(2, 24, 24, pad=4), rtol=2e-2)


@HALF
def test_half_precision_at_the_production_blocks(dtype):
    """The same at the block sizes every call uses (64 x 64) and head dim 64: 100 rows, a full and a ragged block;
    a 24-key window, so that as many rows as above attend each key, and q, k scaled by 3 (the largest of 25,600
    entries of dV reaches 1e5 with 4: the true gradient overflows fp16)."""
    q, k, v = _large_scores(100, 64, dtype, scale=3.0)
    _check("x^3/16", q, k, v, _padded_causal_mask(2, 100, 100, pad=4, window=24), rtol=2e-2, blocks={})


@pytest.mark.parametrize("spelling", ["x^3/16", "x/1", "relu(x)^2/n"])
def test_bf16_weights_lose_nothing_but_the_outputs_rounding(spelling):
    """bf16 inputs: the output equals the fp32 computation on the same inputs up to the output's own rounding. The
    weights enter their products split in two bf16 tiles (16 significant bits); rounded once to bf16, as FlashAttention
    rounds ``P``, they doubled the mean error (measured under the interpreter: 5.8e-3 against 2.8e-3 for ``x^3/16``).
    Bound: 1.25x the mean error of truncating the fp32 result to bf16 (the interpreter truncates; a GPU rounds to
    nearest, half of it), relative to the mean absolute output."""
    from hf_knorm.attention.kernel import chunked_attention

    q, k, v = (t.detach() for t in _tensors(q_len=100, kv_len=100, dim=64, dtype=torch.bfloat16))
    normalization = parse_normalization(spelling)
    got = triton_kernel.triton_attention(q, k, v, None, normalization, causal=True).float()
    exact = chunked_attention(q.float(), k.float(), v.float(), None, normalization, causal=True)[0]
    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32)
    scale = exact.abs().mean()
    assert (got - exact).abs().mean() / scale <= 1.25 * (truncated - exact).abs().mean() / scale


@pytest.mark.skipif(not triton_kernel.INTERPRETED, reason="reads the operands through Triton's interpreter")
def test_bf16_multiplies_bf16_operands_at_the_production_blocks(monkeypatch):
    """Every ``tl.dot`` of a bf16 call, forward and backward, multiplies bf16 tiles of 64 rows or columns (the
    interpreter's conversion records what reaches it), and the result is right."""
    from triton import language as tl

    from hf_knorm.attention import triton_interpreter

    operands, convert = [], triton_interpreter._as_fp32

    def recording(handle):
        operands.append((handle.dtype.scalar, handle.data.shape))
        return convert(handle)

    monkeypatch.setattr(triton_interpreter, "_as_fp32", recording)
    q, k, v = _tensors(q_len=100, kv_len=100, dim=64, dtype=torch.bfloat16)
    _check("x^3/16", q, k, v, None, causal=True, rtol=2e-2, blocks={})
    assert operands and {dtype for dtype, _ in operands} == {tl.bfloat16}
    assert all(64 in shape for _, shape in operands)


@triton.jit
def _product(A, B, C, N: tl.constexpr):
    """A 64 x 64 ``tl.dot`` of a kernel that is not the package's."""
    rows, columns = tl.arange(0, N)[:, None], tl.arange(0, N)[None, :]
    c = tl.dot(tl.load(A + rows * N + columns), tl.load(B + rows * N + columns))
    tl.store(C + rows * N + columns, c)


def _bf16_product(generator_seed=0):
    generator = torch.Generator().manual_seed(generator_seed)
    a, b = (torch.randn(64, 64, generator=generator).to(DEVICE, torch.bfloat16) for _ in range(2))
    c = torch.empty(64, 64, device=DEVICE, dtype=torch.float32)
    _product[(1,)](a, b, c, N=64)
    return a, b, c


def test_the_interpreter_multiplies_bf16_tiles():
    """The product ``triton_interpreter.py`` teaches Triton's interpreter inside ``bf16_dot`` (on a GPU, the
    hardware's): a 64 x 64 bf16 ``tl.dot`` with fp32 sums, as torch computes it on the fp32 values of the same bf16
    numbers."""
    from hf_knorm.attention.triton_interpreter import bf16_dot

    with bf16_dot() if triton_kernel.INTERPRETED else contextlib.nullcontext():
        a, b, c = _bf16_product()
    want = a.double() @ b.double()
    torch.testing.assert_close(c.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(not triton_kernel.INTERPRETED, reason="Triton's interpreter only")
def test_the_bf16_product_is_taught_to_the_package_kernels_only(monkeypatch):
    """Another interpreted kernel multiplies as Triton does (no operand converted), before and after a launch of the
    package's kernels and from another thread during one; the interpreter's ``create_dot`` is Triton's own outside
    the package's launches; teaching a kernel twice wraps it once."""
    from triton.runtime import interpreter

    from hf_knorm.attention import triton_interpreter

    own = interpreter.InterpreterBuilder.create_dot
    converted, convert = [], triton_interpreter._as_fp32
    monkeypatch.setattr(triton_interpreter, "_as_fp32", lambda handle: converted.append(handle) or convert(handle))
    _bf16_product()
    assert not converted and interpreter.InterpreterBuilder.create_dot is own
    q, k, v = _tensors(q_len=16, kv_len=16, dim=16, dtype=torch.bfloat16)
    triton_kernel.triton_attention(q, k, v, None, parse_normalization("x^3/16"), causal=True)
    assert converted and interpreter.InterpreterBuilder.create_dot is own
    converted.clear()
    with triton_interpreter.bf16_dot():  # as during a package launch: the converting create_dot is on the class
        assert interpreter.InterpreterBuilder.create_dot is not own
        elsewhere = threading.Thread(target=_bf16_product)
        elsewhere.start()
        elsewhere.join()
    assert not converted and interpreter.InterpreterBuilder.create_dot is own
    run = triton_kernel._forward_kernel.run
    triton_interpreter.teach_bf16_dot(triton_kernel._forward_kernel)
    assert triton_kernel._forward_kernel.run is run


def test_block_ranges_from_a_window_mask():
    """The key blocks each query block visits and the query blocks each key block serves, against a plain loop."""
    mask = _padded_causal_mask(2, 37, 45, pad=30, window=9)
    key_blocks, query_blocks = triton_kernel.block_ranges(mask, 16, 8)
    for b in range(2):
        for m in range(3):
            columns = mask[b, 0, m * 16:(m + 1) * 16].any(dim=0).nonzero().flatten().tolist()
            expected = [columns[0] // 8, columns[-1] // 8 + 1] if columns else [0, 0]
            assert key_blocks[b, 0, m].tolist() == expected
        for n in range(6):
            rows = mask[b, 0, :, n * 8:(n + 1) * 8].any(dim=1).nonzero().flatten().tolist()
            expected = [rows[0] // 16, rows[-1] // 16 + 1] if rows else [0, 0]
            assert query_blocks[b, 0, n].tolist() == expected
    assert key_blocks[1, 0, 0].tolist() == [0, 0]  # rows 0-15 of item 1 (keys <= 23) attend nothing: 30 keys of padding


def test_what_it_does_not_compute_is_refused():
    q, k, v = _tensors(q_len=4, kv_len=4)
    for spelling in ("softmax", "sigmoid", "stick-breaking"):  # no element-wise form (Normalization.pointwise)
        with pytest.raises(ValueError, match="computes the element-wise families"):
            triton_kernel.triton_attention(q, k, v, None, parse_normalization(spelling))
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        triton_kernel.triton_attention(q.double(), k.double(), v.double(), None, parse_normalization("x/1"))
    with pytest.raises(ValueError, match="cannot be grouped"):
        triton_kernel.triton_attention(q[:, :3], k, v, None, parse_normalization("x/1"))


@pytest.mark.parametrize("spelling", ["x^3/16", "relu(x)^2/n"])
def test_a_patched_model_runs_the_triton_kernel_through_the_attention_interface(monkeypatch, spelling):
    """The hook in ``interface.py``: every layer counted as "triton", logits and gradients those of the PyTorch
    kernel (fp32, 1e-4 of the largest value); for each element-wise form the dispatcher reads (the power, and the
    rectified power with its row rule ``1/n``)."""
    import hf_knorm
    from hf_knorm.attention import backends
    from tests.tiny_models import tiny_model

    if DEVICE == "cpu":
        monkeypatch.setattr(backends, "_device_type", lambda tensor: "cuda")  # the interpreter stands in for CUDA
    model = hf_knorm.patch(tiny_model("llama"), spelling).to(DEVICE)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    runs = {}
    for kernel in ("triton", "pytorch"):
        backends._CHOSEN.set({"quadratic": kernel, "linear": "auto"})
        model.zero_grad()
        with hf_knorm.attention_paths() as taken:
            logits = model(input_ids=ids, attention_mask=mask).logits
        (logits[mask.bool()] ** 2).mean().backward()
        assert dict(taken) == {"triton" if kernel == "triton" else "quadratic": model.config.num_hidden_layers}
        runs[kernel] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (logits, grads), (ref_logits, ref_grads) = runs["triton"], runs["pytorch"]
    scale = ref_logits[mask.bool()].abs().max().item()
    torch.testing.assert_close(logits[mask.bool()], ref_logits[mask.bool()], rtol=1e-4, atol=1e-4 * scale)
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name], ref_grad, rtol=1e-4, atol=1e-4 * ref_grad.abs().max().item(), msg=name)


def test_a_patched_model_whose_triton_kernel_fails_its_check_runs_the_pytorch_kernel(monkeypatch):
    """The automatic choice on "CUDA" (the interpreter standing in) with a Triton kernel 5% off: one warning, every
    layer counted as "quadratic", the PyTorch kernel's logits."""
    import hf_knorm
    from hf_knorm.attention import backends, self_check
    from tests.tiny_models import tiny_model

    if DEVICE == "cpu":
        monkeypatch.setattr(backends, "_device_type", lambda tensor: "cuda")
    monkeypatch.setattr(self_check, "_VERDICTS", {})
    monkeypatch.setattr(backends, "_REPORTED", set())
    backends._CHOSEN.set({"quadratic": "auto", "linear": "auto"})
    real = triton_kernel.triton_attention
    monkeypatch.setattr(triton_kernel, "triton_attention", lambda *args, **options: real(*args, **options) * 1.05)
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16").to(DEVICE)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with pytest.warns(UserWarning, match=r"the Triton kernel failed its self-check.*case \(a\), output"):
        with hf_knorm.attention_paths() as taken, torch.no_grad():
            logits = model(input_ids=ids).logits
    assert dict(taken) == {"quadratic": model.config.num_hidden_layers}
    backends._CHOSEN.set({"quadratic": "pytorch", "linear": "auto"})
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids=ids).logits, rtol=0, atol=0)

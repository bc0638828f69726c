"""FlexAttention's route (``hf_knorm/attention/flex.py``) against the plain reference, on the CPU.

Every family that declares the route (a softmax over modified logits, or a weight with an element-wise logarithm)
runs FlexAttention's eager forward in fp64 and must equal ``reference.py`` to rounding: the implicit causal mask with
GQA and the family's learned values, left-padded key padding with a softcap, one decoded row against a padded cache,
and an explicit sliding-window mask with an additive bias and a row with no key. Torch 2.13 refuses FlexAttention's
backward on the CPU at its entry (tested, so that a torch that lifts it says so); the gradients are checked here by
lifting that refusal (:func:`cpu_backward`): FlexAttention's dense implementation under it is the autograd its CUDA
kernels fuse, and it differentiates the returned log-sum-exp and the captured learned values. The compiled CUDA
kernels are checked on a GPU (the last test, and the self-check before first use).
"""

import warnings

import pytest
import torch

from hf_knorm.attention import backends, flex, self_check
from hf_knorm.attention.kernel import chunked_attention
from hf_knorm.attention.masks import KeyPadding
from hf_knorm.attention.reference import reference_attention
from hf_knorm.normalizations import parse_normalization

ROUTED = ["softmax", "ssmax(scale=learned)", "ssmax(scale=0.144)", "softmax(sink=learned)", "softmax(sink=0)",
          "sigmoid(bias=-log n)", "sigmoid(bias=learned)", "sigmoid(bias=-6.93)", "relu(x)/n", "relu(x)^2/sqrtN",
          "relu(x)^3/16", "x^2/16", "softpick", "softpick(eps=0.01)"]
"""Every family with the route, and each way its values come (fixed, per row, learned)."""
NOT_ROUTED = ["stick-breaking", "x^3/16", "x/1"]

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def cpu_backward(monkeypatch):
    """FlexAttention's backward on the CPU: its entry's refusal lifted (``_validate_device``), the rest as it is."""
    import torch.nn.attention.flex_attention as module

    monkeypatch.setattr(module, "_validate_device", lambda query, key, value: None)


@pytest.fixture
def cpu_max_scores(monkeypatch):
    """FlexAttention's row maximum (``AuxRequest(max_scores=True)``) on the CPU: its refusal lifted (torch 2.13 raises
    in ``_apply_kernel_options``; the dense implementation under it computes the maximum), the rest as it is."""
    import torch.nn.attention.flex_attention as module

    original = module._apply_kernel_options

    def lifted(query, key, value, return_lse, kernel_options, return_aux=None):
        wanted = return_aux is not None and return_aux.max_scores
        options = original(query, key, value, return_lse, kernel_options,
                           return_aux._replace(max_scores=False) if wanted else return_aux)
        options["OUTPUT_MAX"] = wanted
        return options

    monkeypatch.setattr(module, "_apply_kernel_options", lifted)


def _inputs(q_len, kv_len, q_heads=4, kv_heads=2, dim=8, batch=2, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    shapes = (batch, q_heads, q_len, dim), (batch, kv_heads, kv_len, dim), (batch, kv_heads, kv_len, dim)
    return [2.0 * torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]


def _params(normalization, heads=4, seed=1, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return {name: init + 0.3 * torch.randn(heads, generator=generator, dtype=dtype)
            for name, init in normalization.learnable().items()}


def _close(got, want, tolerance=1e-12):
    scale = want.abs().max().item() or 1.0
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= tolerance * scale, (got - want).abs().max().item() / scale


@pytest.mark.parametrize("spelling", [spelling for spelling in ROUTED
                                      if parse_normalization(spelling).log_weights is not None])
def test_the_declared_log_form_is_the_familys_weights(spelling):
    """``e^{l(s)}`` (:class:`LogWeight`) equals the family's own weights, masked pairs and empty rows included."""
    normalization = parse_normalization(spelling)
    form = normalization.log_weights
    scores = 3.0 * torch.randn(2, 4, 9, 11, dtype=torch.float64)
    allowed = torch.rand(2, 1, 9, 11) > 0.3
    allowed[0, 0, 4] = False  # a row with no key
    params = _params(normalization)
    values = {name: value[:, None, None] for name, value in params.items()}
    want = normalization.weights(scores, allowed, values)
    _close(form.reference(scores, allowed.expand_as(scores), values), want, 1e-14)


@pytest.mark.parametrize("spelling", ["softpick", "softpick(eps=0.01)", "softpick(eps=0.5)"])
def test_the_declared_ratio_is_the_familys_weights(spelling):
    """``e^{a(s)} / (sum e^{b(s)} + eps e^m)``, ``m`` read back from the row's largest ``a`` (:class:`LogWeightRatio`),
    equals the family's own shifted weights: large scores, rows with no positive score, masked pairs, an empty row."""
    normalization = parse_normalization(spelling)
    scores = 6.0 * torch.randn(2, 4, 9, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    scores[1, 2, 3] = -scores[1, 2, 3].abs()  # no positive score: m = 0
    scores[0, 1, 2, 4] = 0.0  # a score exactly 0: weight 0 in both sums
    scores[1, 3, 1, :] = 1e-3 * scores[1, 3, 1, :]  # every score near 0: the floor weighs
    scores[0, 3, 5, 2] = 60.0  # a large score: e^s far past any shift-free sum's range in fp32
    allowed = torch.rand(2, 1, 9, 11, generator=torch.Generator().manual_seed(4)) > 0.3
    allowed[0, 0, 4] = False  # a row with no key
    allowed[0, :, 5, 2] = True
    want = normalization.weights(scores.clone(), allowed)
    _close(normalization.log_weight_ratio.reference(scores, allowed.expand_as(scores)), want, 1e-14)
    form = normalization.log_weight_ratio
    assert form.row_shift(torch.tensor(float("-inf"))) == 0.0
    positive = torch.tensor([1e-8, 0.3, 5.0, 40.0], dtype=torch.float64)
    _close(form.row_shift(form.numerator(positive)), positive, 1e-12)  # softplus inverts a on s > 0


@pytest.mark.parametrize("spelling", NOT_ROUTED)
def test_the_families_without_a_logarithm_or_softmax_form_have_no_route(spelling):
    normalization = parse_normalization(spelling)
    assert "flex" not in normalization.fast_paths and not flex.computes(normalization)
    query, key, value = _inputs(5, 5)
    with pytest.raises(ValueError, match="FlexAttention computes a softmax over modified logits or a non-negative"):
        flex.flex_route_attention(query, key, value, None, normalization, causal=True)


@pytest.mark.parametrize("spelling", ROUTED)
def test_flex_equals_the_reference(cpu_max_scores, spelling):
    normalization = parse_normalization(spelling)
    params = _params(normalization)
    # the implicit top-left causal mask, 4 query heads over 2 KV heads (enable_gqa), 150 rows (two blocks of 128)
    query, key, value = _inputs(150, 150)
    got = flex.flex_route_attention(query, key, value, None, normalization, causal=True, params=params)
    _close(got, reference_attention(query, key, value, None, normalization, causal=True, params=params)[0])
    # left padding (item 1: 37 padded keys), a softcap; as a plain causal call hands it: key padding, no N x N mask
    key_valid = torch.ones(2, 150, dtype=torch.bool)
    key_valid[1, :37] = False
    padding = KeyPadding(key_valid, 150, causal=True)
    got = flex.flex_route_attention(query, key, value, padding, normalization, softcap=5.0, params=params)
    want = reference_attention(query, key, value, padding.dense(), normalization, softcap=5.0, params=params)[0]
    _close(got, want)  # the padded queries' rows attend no key: 0 in both
    # one decoded row against the padded cache (the path generate takes)
    step = KeyPadding(key_valid, 1, causal=True)
    got = flex.flex_route_attention(query[:, :, -1:], key, value, step, normalization, params=params)
    _close(got, reference_attention(query[:, :, -1:], key, value, step.dense(), normalization, params=params)[0])


@pytest.mark.parametrize("spelling", ROUTED)
def test_flex_equals_the_reference_on_an_explicit_mask(cpu_max_scores, spelling):
    """A model's own sliding window (Transformers hands it as an explicit mask), a cache before the queries, an
    additive bias, and a row with no key (0, the plugin's convention)."""
    normalization = parse_normalization(spelling)
    params = _params(normalization)
    query, key, value = _inputs(70, 200, seed=2)
    rows = torch.arange(70)[:, None] + 130
    keys = torch.arange(200)[None, :]
    allowed = ((keys <= rows) & (keys > rows - 60)).expand(2, 1, 70, 200).clone()
    allowed[1, :, 5] = False
    bias = torch.where(allowed, 0.5 * torch.randn(allowed.shape, dtype=torch.float64), 0.0)
    got = flex.flex_route_attention(query, key, value, allowed, normalization, bias=bias, params=params)
    want = reference_attention(query, key, value, allowed, normalization, bias=bias, params=params)[0]
    _close(got, want)
    assert got[1, 5].abs().max() == 0.0


def test_fp32_and_bf16_inputs_compute_in_fp32_on_the_cpu():
    normalization = parse_normalization("sigmoid")
    query, key, value = _inputs(40, 40, dtype=torch.float32)
    want = reference_attention(query.double(), key.double(), value.double(), None, normalization, causal=True)[0]
    got = flex.flex_route_attention(query, key, value, None, normalization, causal=True)
    assert got.dtype == torch.float32
    _close(got.double(), want, 1e-5)
    half = [tensor.bfloat16() for tensor in (query, key, value)]
    got = flex.flex_route_attention(*half, None, normalization, causal=True)
    exact = reference_attention(*[t.double() for t in half], None, normalization, causal=True)[0]
    assert got.dtype == torch.bfloat16
    _close(got.double(), exact, 1e-2)  # the output's own bf16 rounding; computed in fp32


def test_torch_refuses_the_row_maximum_on_the_cpu():
    """Softpick's two passes read FlexAttention's row maximum, which torch 2.13 returns on CUDA only: on the CPU the
    route raises torch's own error (the dispatcher sends it CUDA calls only). A torch that lifts it fails this test."""
    query, key, value = _inputs(8, 8)
    with pytest.raises(NotImplementedError, match="max scores is not supported on CPU"):
        flex.flex_route_attention(query, key, value, None, parse_normalization("softpick"), causal=True)


def test_torch_refuses_flex_backward_on_the_cpu():
    """The finding the route's docstring states (torch 2.13): no backward on the CPU, so the dispatcher sends it CUDA
    calls only. A torch that lifts the refusal fails this test: then test the gradients without lifting it."""
    query, key, value = (tensor.requires_grad_() for tensor in _inputs(8, 8))
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex.flex_route_attention(query, key, value, None, parse_normalization("sigmoid"), causal=True)


@pytest.mark.parametrize("spelling", ["softmax", "ssmax(scale=learned)", "softmax(sink=learned)",
                                      "sigmoid(bias=-log n)", "sigmoid(bias=learned)", "relu(x)^2/n", "x^2/16",
                                      "softpick"])
def test_gradients_through_the_log_sum_exp_equal_the_reference(cpu_backward, cpu_max_scores, spelling):
    """Outputs' gradients with respect to query, key, value and the learned values, through the returned ``lse``
    (the renormalizations) and the captured values: fp64, left padding and a softcap, a row whose weights are all 0
    (``relu`` of negative scores: ``lse = -inf``) included. Softpick's row shift ``m`` has no gradient on this route
    (FlexAttention's maximum): its gradients differ from the reference's by the floor's share, ``~eps`` = 1e-6
    relative (``flex.py``), so its tolerance is 1e-5 of the largest gradient."""
    normalization = parse_normalization(spelling)
    leaves = [tensor.requires_grad_() for tensor in _inputs(130, 130, seed=3)]
    params = {name: value.requires_grad_() for name, value in _params(normalization).items()}
    with torch.no_grad():
        leaves[0][0, :, 7] = 0.0  # query 7 of item 0: every score 0
    key_valid = torch.ones(2, 130, dtype=torch.bool)
    key_valid[1, :20] = False
    padding = KeyPadding(key_valid, 130, causal=True)
    got = flex.flex_route_attention(*leaves, padding, normalization, softcap=4.0, params=params)
    want = reference_attention(*leaves, padding.dense(), normalization, softcap=4.0, params=params)[0]
    upstream = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    upstream[1, :20] = 0.0  # padded queries: no one reads them
    if normalization.log_weight_ratio is not None:
        # softpick at scores exactly 0: relu(e^s - 1) has no derivative there; the reference's clamp takes the right
        # one, 1 / eps per unit (1e6), the route's log-weight -inf the left one, 0. Not a row a model meets.
        upstream[0, 7] = 0.0
    inputs = [*leaves, *params.values()]
    got_grads = torch.autograd.grad((got * upstream).sum(), inputs)
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)
    tolerance = 1e-5 if normalization.log_weight_ratio is not None else 1e-10
    for got_grad, want_grad in zip(got_grads, want_grads):
        _close(got_grad, want_grad, tolerance)


def test_the_self_check_key_is_what_the_compiled_code_depends_on():
    """Each way a family's values come (a number, per row, learned) compiles its own ``score_mod``: a check each;
    numbers of one kind share one."""
    def key(spelling):
        return self_check.key_of("flex", torch.device("cpu"), torch.bfloat16, parse_normalization(spelling), 64)[3]

    spellings = ["sigmoid(bias=-log n)", "sigmoid(bias=learned)", "sigmoid(bias=-6.93)", "ssmax(scale=learned)",
                 "ssmax(scale=0.144)", "softmax(sink=0)", "softmax(sink=learned)", "relu(x)/n", "relu(x)^2/n",
                 "softmax", "softpick"]
    assert len({key(spelling) for spelling in spellings}) == len(spellings)
    assert key("sigmoid(bias=-3)") == key("sigmoid(bias=-6.93)") and key("x^2/16") == key("x^2/1")
    assert key("softpick(eps=0.01)") == key("softpick")  # eps: a number the score_mod does not read


def test_softpicks_self_check_passes_on_the_cpu(cpu_backward, cpu_max_scores):
    """The self-check the dispatcher runs before softpick's first FlexAttention call (its real code: causal, key
    padding with a softcap, a sliding window with a bias; outputs and gradients against the chunked kernel in fp64),
    with torch's CPU refusals lifted; a route off by 5% fails it."""
    softpick = parse_normalization("softpick")
    assert self_check.run_check("flex", torch.device("cpu"), torch.float32, softpick, 16) == ""
    assert self_check.key_of("flex", torch.device("cpu"), torch.float32, softpick, 16)[3] == (
        "softpick: expm1 ratio + number floor")


def test_the_self_check_passes_and_catches_a_broken_route(cpu_backward, stub_cuda, monkeypatch):
    """The self-check the dispatcher runs before FlexAttention's first call (its real code, on the CPU), then a route
    off by 5%: caught, and the call goes to the next kernel of the order (SDPA for SSMax), with one warning."""
    for spelling in ("sigmoid(bias=learned)", "ssmax(scale=learned)"):
        assert self_check.run_check("flex", torch.device("cpu"), torch.float32, parse_normalization(spelling),
                                    16) == ""
    route = flex.flex_route_attention
    monkeypatch.setattr(flex, "flex_route_attention", lambda *args, **options: route(*args, **options) * 1.05)
    query = torch.zeros(1, 2, 3, 16)
    path = backends.Path(linear=False)
    with pytest.warns(UserWarning, match="FlexAttention failed its self-check"):
        chosen = backends.with_kernel(path, query, parse_normalization("ssmax(scale=learned)"), dropout=0.0,
                                      return_weights=False, recording=False, compiling=False)
    assert chosen.kernel == "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once
        assert backends.with_kernel(path, query, parse_normalization("ssmax(scale=learned)"), dropout=0.0,
                                    return_weights=False, recording=False, compiling=False).kernel == "sdpa"


@pytest.mark.parametrize("spelling", ["sigmoid(bias=learned)", "softpick"])
def test_a_patched_model_runs_flex_where_the_dispatcher_chooses_it(stub_cuda, cpu_max_scores, monkeypatch, spelling):
    """Through the plugin: a left-padded batch and greedy decoding of a tiny Llama patched with sigmoid or softpick
    (two passes), the flex route computing every attention call (its eager forward on the CPU, self-check stubbed),
    equal to the PyTorch kernel's logits and tokens."""
    import hf_knorm
    from hf_knorm.attention.paths import attention_paths
    from tiny_models import tiny_model

    monkeypatch.setattr(backends, "verdict", lambda *key: "")
    model = hf_knorm.patch(tiny_model("llama"), spelling)  # fp32: the GPU kernels' dtypes
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad(), attention_paths() as paths:
        got = model(input_ids=ids, attention_mask=mask).logits
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert set(paths) == {"flex"}
    with torch.no_grad(), hf_knorm.kernels(quadratic="pytorch"):
        want = model(input_ids=ids, attention_mask=mask).logits
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    _close(got[0], want[0], 1e-5)
    _close(got[1, 3:], want[1, 3:], 1e-5)
    assert torch.equal(generated, expected)


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled kernels, and any backward of it, "
                    "run on CUDA only (torch 2.13 refuses its backward on the CPU)")
@pytest.mark.parametrize("spelling", ["ssmax(scale=learned)", "softmax(sink=learned)", "sigmoid(bias=learned)",
                                      "relu(x)^2/n", "softpick"])
def test_the_compiled_route_on_cuda_passes_the_self_check_in_bf16_and_fp32(spelling):
    normalization = parse_normalization(spelling)
    for dtype in (torch.float32, torch.bfloat16):
        assert self_check.run_check("flex", torch.device("cuda"), dtype, normalization, 64) == ""


def _block_maps(blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` bool ``(B, H, nQ, nK)`` maps of a ``BlockMask``'s blocks."""
    def dense(counts, indices):
        columns = torch.arange(indices.shape[-1])
        chosen = columns < counts[..., None].long()  # the first `counts` indices of each row are the blocks
        result = torch.zeros(*indices.shape, dtype=torch.bool)
        return result.scatter(-1, indices.long(), chosen)

    return (dense(blocks.kv_num_blocks, blocks.kv_indices),
            dense(blocks.full_kv_num_blocks, blocks.full_kv_indices))


def _dense_blocks(allowed: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any, all)`` per block of a dense mask, written as loops (past the ends: never all)."""
    batch, heads, q_len, kv_len = allowed.shape
    q_blocks, kv_blocks = -(-q_len // block), -(-kv_len // block)
    any_map = torch.zeros(batch, heads, q_blocks, kv_blocks, dtype=torch.bool)
    all_map = torch.zeros_like(any_map)
    for m in range(q_blocks):
        for n in range(kv_blocks):
            tile = allowed[:, :, m * block:(m + 1) * block, n * block:(n + 1) * block]
            whole = tile.shape[-2:] == (block, block)
            any_map[:, :, m, n] = tile.flatten(2).any(-1)
            all_map[:, :, m, n] = tile.flatten(2).all(-1) & whole
    return any_map, all_map


@pytest.mark.parametrize(("q_len", "kv_len", "causal"), [(50, 50, True), (20, 70, True), (1, 45, True),
                                                        (40, 40, False), (33, 64, True)])
def test_the_block_mask_skips_exactly_the_empty_blocks_and_trusts_only_the_full_ones(q_len, kv_len, causal):
    """On a GPU a full block is computed without the ``mask_mod`` and an absent one is skipped: the summaries of key
    padding (built without the ``q x kv`` mask) and of an explicit mask must be those of the dense mask, block by
    block (blocks of 16 here, ragged ends included), and the counts ``n_i`` its row sums."""
    key_valid = torch.rand(2, kv_len, generator=torch.Generator().manual_seed(q_len)) > 0.2
    key_valid[1, :17] = False  # item 1 left-padded over a whole block and more
    key_valid[0, 16:32] = True  # a whole block of real keys
    padding = KeyPadding(key_valid, q_len, causal=causal)
    dense = padding.dense()
    for form in (padding, dense):
        blocks = flex.block_mask(form, q_len, kv_len, block=16, dtype=torch.float64)
        partial, full = _block_maps(blocks.block_mask)
        any_map, all_map = _dense_blocks(dense, 16)
        assert torch.equal(full, all_map)
        assert torch.equal(partial | full, any_map)
        assert not (partial & full).any()
        counts = dense.sum(-1).clamp_min(1).double().log()
        assert torch.equal(blocks.log_counts.expand_as(counts), counts)

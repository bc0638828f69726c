"""flash-linear-attention's ``x/c`` against the project's linear path: outputs, gradients, states.

On a CPU, fla's kernels cannot run (not even under Triton's interpreter: ``hf_knorm/attention/fla_linear.py`` says
why), so the adapter is checked with fla's own plain reference of the same function in their place
(``naive_recurrent_linear_attn``), against the project's PyTorch linear kernel: that checks every convention the
adapter maps (scale, ``c``, ``sqrtN`` rows, padded keys, a cache prefix, GQA, the state in and out). One function then
stands in for both of fla's kernels, so a test with spies checks what those comparisons cannot: that a prefill goes
to the chunked kernel and a decoded token to the recurrent one, with arguments fla's real kernels accept. With CUDA,
the same checks run fla's chunked and recurrent kernels.

Tolerance: fp32, ``rtol = atol = 1e-4`` of the largest value (fla's kernels may use TF32 inside: measured on a device
only).
"""

import pytest
import torch

pytest.importorskip("fla", reason="fla-core is not installed (pip install 'hf_knorm[gpu]')")
pytestmark = pytest.mark.device  # make device runs fla's kernels on a GPU

from fla.ops.linear_attn.naive import naive_recurrent_linear_attn  # noqa: E402

from hf_knorm.attention.fla_linear import fla_kernels, fla_linear_attention  # noqa: E402
from hf_knorm.attention.linear_kernel import linear_attention  # noqa: E402
from hf_knorm.normalizations import parse_normalization  # noqa: E402

CUDA = torch.cuda.is_available()
KERNELS = [pytest.param("naive", id="fla-naive"),
           pytest.param("fla", id="fla-kernels", marks=pytest.mark.skipif(
               not CUDA, reason="fla's kernels need CUDA (they do not run under Triton's interpreter)"))]


def _kernels(name):
    return (naive_recurrent_linear_attn, naive_recurrent_linear_attn) if name == "naive" else fla_kernels()


def _tensors(batch=2, q_heads=4, kv_heads=2, q_len=19, kv_len=19, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    device = "cuda" if CUDA else "cpu"
    make = lambda *shape: torch.randn(*shape, generator=generator).to(device).requires_grad_()  # noqa: E731
    return make(batch, q_heads, q_len, dim), make(batch, kv_heads, kv_len, dim), make(batch, kv_heads, kv_len, dim)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spelling", ["x/1", "x/16", "x/sqrtN"])
def test_outputs_and_gradients_match_the_linear_path(kernel, spelling):
    """Padded keys, a 6-key cache prefix (25 keys, 19 queries), GQA 4 over 2."""
    normalization = parse_normalization(spelling)
    q, k, v = _tensors(kv_len=25)
    key_valid = torch.ones(2, 25, dtype=torch.bool, device=q.device)
    key_valid[1, :4] = False
    got = fla_linear_attention(q, k, v, key_valid, normalization, scaling=0.3, kernels=_kernels(kernel))
    want = linear_attention(q, k, v, key_valid, normalization, scaling=0.3)
    _close(got, want, "output")
    upstream = torch.randn_like(want)
    for name, grad, ref in zip("qkv", torch.autograd.grad((got * upstream).sum(), (q, k, v)),
                               torch.autograd.grad((want * upstream).sum(), (q, k, v))):
        _close(grad, ref, f"d{name}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_state_carries_over_for_decoding(kernel):
    """A prefill returning its state, then one decoded token from it: as the project's path does both."""
    normalization = parse_normalization("x/sqrtN")
    q, k, v = (t.detach() for t in _tensors(q_len=12, kv_len=12))
    step_q, step_k, step_v = (t.detach() for t in _tensors(q_len=1, kv_len=1, seed=1))
    results = []
    for attend in (lambda *a, **o: fla_linear_attention(*a, **o, kernels=_kernels(kernel)), linear_attention):
        _, state, count = attend(q, k, v, None, normalization, return_state=True)
        output, state, count = attend(step_q, step_k, step_v, None, normalization, initial_state=state,
                                      initial_count=count, return_state=True)
        results.append((output, state, count))
    for got, want, what in zip(results[0], results[1], ("output", "state", "count")):
        _close(got, want, what)


def test_prefill_takes_the_chunked_kernel_and_decoding_the_recurrent_one_with_fla_s_arguments():
    """Each stand-in binds its call to the signature of the fla kernel it stands for (a ``TypeError`` if fla's would
    not take it) and records the layout it received: ``(B, T, H_q, D)``, K and V repeated per query head, the state
    ``(B, H_q, D, D_v)``."""
    import inspect

    from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn

    calls = []

    def stand_in(name, real):
        signature = inspect.signature(real)

        def kernel(*args, **options):
            bound = signature.bind(*args, **options).arguments
            state = bound.get("initial_state")
            calls.append((name, tuple(bound["q"].shape), tuple(bound["k"].shape),
                          None if state is None else tuple(state.shape)))
            return naive_recurrent_linear_attn(*args, **options)

        return kernel

    kernels = (stand_in("chunked", chunk_linear_attn), stand_in("recurrent", fused_recurrent_linear_attn))
    normalization = parse_normalization("x/16")
    q, k, v = (t.detach() for t in _tensors(q_len=12, kv_len=15))
    _, state, count = fla_linear_attention(q, k, v, None, normalization, return_state=True, kernels=kernels)
    step_q, step_k, step_v = (t.detach() for t in _tensors(q_len=1, kv_len=1, seed=1))
    fla_linear_attention(step_q, step_k, step_v, None, normalization, initial_state=state, initial_count=count,
                         kernels=kernels)
    assert calls == [("chunked", (2, 12, 4, 16), (2, 12, 4, 16), (2, 4, 16, 16)),  # the 3-key prefix: a state
                     ("recurrent", (2, 1, 4, 16), (2, 1, 4, 16), (2, 4, 16, 16))]


def test_it_refuses_what_it_does_not_compute():
    q, k, v = _tensors(q_len=4, kv_len=3)
    kernels = _kernels("naive")
    with pytest.raises(ValueError, match="p = 1"):
        fla_linear_attention(q, k, v, None, parse_normalization("x^3/16"), kernels=kernels)
    with pytest.raises(ValueError, match="at least as many keys"):
        fla_linear_attention(q, k, v, None, parse_normalization("x/1"), kernels=kernels)

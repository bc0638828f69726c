"""The blocks a mask lets attend (``blocks.py``), and the PyTorch kernel's chunks without a host sync per chunk."""

import pytest
import torch

from hf_knorm.attention import blocks, kernel
from hf_knorm.attention.kernel import chunked_attention, default_chunk_elements
from hf_knorm.normalizations import parse_normalization


def _window_mask(batch=2, q_len=37, kv_len=45, pad=30, window=9):
    rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
    keys = torch.arange(kv_len)[None, :]
    mask = ((keys <= rows) & (keys > rows - window)).expand(batch, 1, q_len, kv_len).clone()
    mask[1, :, :, :pad] = False
    return mask


@pytest.mark.parametrize("rows", [1, 5, 16, 37, 100])
def test_chunk_key_ranges_match_a_plain_loop(rows):
    mask = _window_mask()
    ranges = blocks.chunk_key_ranges(mask, rows).tolist()
    assert len(ranges) == -(-37 // rows)
    for index, start in enumerate(range(0, 37, rows)):
        columns = mask[..., start:start + rows, :].reshape(-1, 45).any(dim=0).nonzero().flatten().tolist()
        assert ranges[index] == ([columns[0], columns[-1] + 1] if columns else [0, 0])


def test_a_chunk_that_attends_nothing_is_empty():
    mask = torch.zeros(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 2:, 3] = True
    assert blocks.chunk_key_ranges(mask, 2).tolist() == [[0, 0], [3, 4]]


def test_the_kernel_finds_its_key_ranges_once_per_call(monkeypatch):
    """Many chunks, one pass over the mask (read to the host once) for the forward and backward pass; none at all for
    the implicit causal mask. The results are the reference's (tests/attention/test_attention.py checks the values;
    here the count)."""
    calls = []
    original = kernel.chunk_key_ranges
    monkeypatch.setattr(kernel, "chunk_key_ranges", lambda *a: calls.append(a[1]) or original(*a))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37 if i == 0 else 45, 8, generator=generator, requires_grad=True) for i in range(3))
    out, _ = chunked_attention(q, k, v, _window_mask(), parse_normalization("x^3/16"), chunk_elements=400)
    out.square().sum().backward()
    assert calls == [2]  # 2 rows a chunk (19 chunks); the backward reuses the forward's plan and its ranges
    calls.clear()
    out, _ = chunked_attention(q, k[:, :, :37], v[:, :, :37], None, parse_normalization("x^3/16"), causal=True,
                               chunk_elements=400)
    out.square().sum().backward()
    assert calls == []


def test_chunk_sizes_depend_on_the_device(monkeypatch):
    assert default_chunk_elements(torch.device("cpu")) == kernel.DEFAULT_CHUNK_ELEMENTS
    assert default_chunk_elements(torch.device("cuda")) == kernel.DEVICE_CHUNK_ELEMENTS["cuda"]
    monkeypatch.setattr(kernel, "DEFAULT_CHUNK_ELEMENTS", 123)  # read at call time
    assert default_chunk_elements(torch.device("cpu")) == 123


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronizations are detected on CUDA only")
def test_no_host_synchronization_on_cuda():
    """torch.cuda.set_sync_debug_mode("error") fails on any synchronizing call: the PyTorch kernel under the implicit
    causal mask, and the Triton kernel under an explicit mask, forward and backward."""
    triton_attention = pytest.importorskip("hf_knorm.attention.triton_kernel").triton_attention
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, 64, device="cuda", generator=generator, requires_grad=True) for _ in range(3))
    normalization = parse_normalization("x^3/16")
    mask = _window_mask(batch=1, q_len=300, kv_len=300, pad=0, window=64).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = chunked_attention(q, k, v, None, normalization, causal=True, chunk_elements=4096)
        out.float().sum().backward()
        triton_attention(q, k, v, mask, normalization).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")

"""The transfer's closed forms (head scales, window mix) summed from per-head Gram blocks: the same sums as the
formulation through each head's ``(tokens, H, hidden)`` contributions (kept here as the reference) to float64
round-off, and no float64 tensor of that size made, however many tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_helpers import lm  # noqa: E402

import hf_knorm  # noqa: E402
from hf_knorm.conversion import transfer as transfer_module  # noqa: E402
from hf_knorm.conversion.transfer import AttentionTransfer, head_inner_products, mix_normal_equations  # noqa: E402
from hf_knorm.models.window_mix import distant_part_off, set_window_mix  # noqa: E402

from test_conversion import _ids  # noqa: E402


def _contributions(outputs, o_weight, head_dim):
    """The reference: each head's share of the attention output, ``(tokens, H, hidden)`` in float64."""
    heads = outputs.double().reshape(-1, outputs.shape[-1] // head_dim, head_dim)
    columns = o_weight.double().reshape(o_weight.shape[0], -1, head_dim)
    return torch.einsum("thd,ohd->tho", heads, columns)


def _reference_mix_equations(window, full, teacher_window, o_weight, teacher_o_weight, head_dim):
    alone = _contributions(window, o_weight, head_dim)
    part = _contributions(full, o_weight, head_dim) - alone
    residual = (_contributions(teacher_window, teacher_o_weight, head_dim) - alone).sum(dim=1)
    return torch.einsum("thd,tgd->hg", part, part), torch.einsum("thd,td->h", part, residual)


def _outputs(seed, shape=(3, 50, 4 * 8)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("token_block", [1024, 16], ids=["one-block", "many-blocks"])
def test_the_sums_from_gram_blocks_are_the_reference_sums(token_block, monkeypatch):
    monkeypatch.setattr(transfer_module, "TOKEN_BLOCK", token_block)
    window, full, teacher = _outputs(0), _outputs(1), _outputs(2)
    weight, teacher_weight = _outputs(3, (24, 32)), _outputs(4, (24, 32))  # hidden 24, 4 heads of 8
    gram, target = mix_normal_equations(window, full, teacher, weight, teacher_weight, 8)
    want_gram, want_target = _reference_mix_equations(window, full, teacher, weight, teacher_weight, 8)
    torch.testing.assert_close(gram, want_gram, rtol=1e-12, atol=0)
    torch.testing.assert_close(target, want_target, rtol=1e-12, atol=0)

    energy, overlap = head_inner_products(full, teacher, weight, teacher_weight, 8)
    student, wanted = _contributions(full, weight, 8), _contributions(teacher, teacher_weight, 8)
    torch.testing.assert_close(energy, student.pow(2).sum(dim=(0, 2)), rtol=1e-12, atol=0)
    torch.testing.assert_close(overlap, (student * wanted).sum(dim=(0, 2)), rtol=1e-12, atol=0)


class _LargestFloat64(TorchDispatchMode):
    """The element count of the largest float64 tensor any op returns inside the mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in (result if isinstance(result, (tuple, list)) else (result,)):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float64:
                self.largest = max(self.largest, tensor.numel())
        return result


def test_match_mix_is_the_reference_solution_without_a_tokens_by_heads_by_hidden_tensor(monkeypatch):
    monkeypatch.setattr(transfer_module, "TOKEN_BLOCK", 16)
    model = lm().eval()
    transfer = AttentionTransfer(model)
    hf_knorm.patch(model, "x^3/16", softmax_window=4)
    ids = _ids(length=40)  # 160 tokens
    with _LargestFloat64() as watch:
        mixes = transfer.match_mix(model, ids)
    config = model.config
    hidden, heads = config.hidden_size, config.num_attention_heads
    width = heads * (hidden // heads)
    assert watch.largest <= max(16, width) * max(hidden, width)  # a block's or a Gram matrix's, no more
    assert watch.largest < ids.numel() * heads * hidden  # what the reference formulation makes

    set_window_mix(model, None)
    full = transfer._head_outputs(model, ids)
    with distant_part_off(model):
        window = transfer._head_outputs(model, ids)
    for index, (module, teacher) in enumerate(zip(transfer.students, transfer.teachers)):
        gram, target = _reference_mix_equations(window[(index, "student")], full[(index, "student")],
                                                window[(index, "teacher")], module.o_proj.weight,
                                                teacher.o_proj.weight, hidden // heads)
        want = torch.linalg.lstsq(gram, target[:, None]).solution[:, 0]
        torch.testing.assert_close(mixes[index].double(), want, rtol=2**-23, atol=0)  # float32's rounding

"""The teacher's top-k cache: the coarse-grained KL equals the full KL when one token is left in the bucket (values and
gradients) and is below it otherwise; the cache holds the teacher's own top k per example, is read back instead of
computed, lays its rows out as a padded batch is; the recovery with it equals the recovery with the teacher."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_helpers import char_tokenizer, lm  # noqa: E402

from hf_knorm.conversion import teacher_logits  # noqa: E402
from hf_knorm.conversion.teacher_logits import example_key, teacher_top_k, top_k_kl  # noqa: E402
from hf_knorm.conversion.trainers import DistillationTrainer, distillation_kl  # noqa: E402

VOCAB = 128
TEACHER = "lm seed 0"
"""The teacher's id (:func:`teacher_top_k` keys its cache by it; a conversion passes its model folder's fingerprint)."""


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_KNORM_CACHE", str(tmp_path / "cache"))


def _logits(seed: int, shape=(2, 6, VOCAB), scale=3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _top_k(teacher_logits: torch.Tensor, k: int):
    log_probs = F.log_softmax(teacher_logits.float(), -1)
    values, indices = log_probs.topk(k, -1)
    return values, indices, log_probs.scatter(-1, indices, float("-inf")).logsumexp(-1)


def test_with_one_token_in_the_bucket_the_kl_is_the_full_kl_values_and_gradients():
    teacher = _logits(0).float()
    labels = torch.tensor([[5, 6, -100, 7, 8, 9], [1, 2, 3, 4, -100, -100]])
    student_full = _logits(1).float().requires_grad_(True)
    student_top = student_full.detach().clone().requires_grad_(True)
    for reduction in ("mean", "sum"):
        full = distillation_kl(student_full, teacher, labels, reduction)
        coarse = top_k_kl(student_top, *_top_k(teacher, VOCAB - 1), labels, reduction)
        torch.testing.assert_close(coarse, full, rtol=1e-5, atol=1e-6)
        full.backward()
        coarse.backward()
        torch.testing.assert_close(student_top.grad, student_full.grad, rtol=1e-4, atol=1e-7)
        student_full.grad = student_top.grad = None


@pytest.mark.parametrize("k", [1, 4, 32])
def test_a_smaller_k_never_exceeds_the_full_kl_and_is_zero_for_the_teacher_itself(k):
    teacher = _logits(2, (4, 16, VOCAB)).float()
    student = _logits(3, (4, 16, VOCAB)).float()
    full = distillation_kl(student, teacher, reduction="sum")
    coarse = top_k_kl(student, *_top_k(teacher, k), reduction="sum")
    per_position = [top_k_kl(student[:, i:i + 1], *(t[:, i:i + 1] for t in _top_k(teacher, k)), reduction="sum")
                    for i in range(16)]
    assert 0 <= coarse <= full and all(value >= -1e-6 for value in per_position)
    assert abs(top_k_kl(teacher, *_top_k(teacher, k))) < 1e-6


def _examples() -> datasets.Dataset:
    """Three examples of different lengths, right-padded to 12 (a duplicate of the first among them)."""
    rows = [[5, 9, 17, 33, 2, 8, 40, 41, 42, 11, 12, 13], [7, 7, 60, 61, 62], [5, 9, 17, 33, 2, 8, 40, 41, 42, 11, 12, 13],
            [100, 3, 4]]
    return datasets.Dataset.from_dict({"input_ids": [r + [0] * (12 - len(r)) for r in rows],
                                       "attention_mask": [[1] * len(r) + [0] * (12 - len(r)) for r in rows]})


def test_the_cache_holds_each_examples_own_top_k_and_is_read_back(monkeypatch):
    teacher = lm().eval()
    examples = _examples()
    cache = teacher_top_k(teacher, examples, k=8, teacher_id=TEACHER, progress=False)
    assert len(cache.rows) == 3 and len(cache.rest) == 12 + 5 + 3  # the duplicate computed once
    for ids, mask in zip(examples["input_ids"], examples["attention_mask"]):
        real = torch.tensor(ids)[torch.tensor(mask).bool()]
        with torch.no_grad():  # the example alone, unpadded
            values, indices, rest = _top_k(teacher(real[None]).logits, 8)
        first, count = cache.rows[example_key(real)]
        torch.testing.assert_close(cache.log_probs[first:first + count], values[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(cache.indices[first:first + count].long(), indices[0])
        torch.testing.assert_close(cache.rest[first:first + count], rest[0], rtol=1e-5, atol=1e-5)

    def no_compute(*args, **kwargs):
        raise AssertionError("computed again")

    monkeypatch.setattr(teacher_logits, "_compute", no_compute)
    again = teacher_top_k(teacher, examples, k=8, teacher_id=TEACHER, progress=False)
    assert torch.equal(again.log_probs, cache.log_probs) and again.rows == cache.rows
    with pytest.raises(AssertionError, match="computed again"):  # another k: another cache
        teacher_top_k(teacher, examples, k=4, teacher_id=TEACHER, progress=False)


def test_the_cache_is_keyed_by_the_teachers_id_and_dtype_not_by_reading_its_weights(monkeypatch):
    teacher = lm().eval()
    examples = _examples()
    cache = teacher_top_k(teacher, examples, k=8, teacher_id=TEACHER, progress=False)

    def no_compute(*args, **kwargs):
        raise AssertionError("computed again")

    def no_weights_read(*args, **kwargs):
        raise AssertionError("the weights were read for the key")

    monkeypatch.setattr(teacher_logits, "_compute", no_compute)
    other = lm(seed=1).eval()  # the same id: the caller vouches that these are the same weights, and none is read
    monkeypatch.setattr(other, "state_dict", no_weights_read)
    again = teacher_top_k(other, examples, k=8, teacher_id=TEACHER, progress=False)
    assert torch.equal(again.log_probs, cache.log_probs)
    with pytest.raises(AssertionError, match="computed again"):  # another teacher (its model folder changed)
        teacher_top_k(other, examples, k=8, teacher_id="another model folder", progress=False)
    with pytest.raises(AssertionError, match="computed again"):  # the same weights in another dtype
        teacher_top_k(lm().eval().to(torch.bfloat16), examples, k=8, teacher_id=TEACHER, progress=False)
    with pytest.raises(ValueError, match="teacher_id"):
        teacher_top_k(teacher, examples, k=8, teacher_id="", progress=False)


def test_a_batch_gets_each_examples_rows_at_its_real_positions_and_an_unknown_example_fails():
    teacher = lm().eval()
    examples = _examples()
    cache = teacher_top_k(teacher, examples, k=8, teacher_id=TEACHER, progress=False)
    ids, mask = torch.tensor(examples["input_ids"][1:4]), torch.tensor(examples["attention_mask"][1:4])
    log_probs, indices, rest = cache.batch(ids, mask)
    assert log_probs.shape == (3, 12, 8) and rest.shape == (3, 12)
    first, count = cache.rows[example_key(ids[0, :5])]
    assert torch.equal(log_probs[0, :5], cache.log_probs[first:first + count]) and (log_probs[0, 5:] == 0).all()
    assert torch.equal(indices[2, :3], cache.indices[cache.rows[example_key(ids[2, :3])][0]:][:3].long())
    left = cache.batch(torch.tensor([[0, 0, 0, 100, 3, 4]]), torch.tensor([[0, 0, 0, 1, 1, 1]]))  # left-padded
    assert torch.equal(left[0][0, 3:], log_probs[2, :3]) and (left[0][0, :3] == 0).all()
    with pytest.raises(KeyError, match="example 0 of this batch"):
        cache.batch(torch.tensor([[1, 2, 3]]), None)
    with pytest.raises(ValueError, match="between 1 and"):
        teacher_top_k(teacher, examples, k=VOCAB, teacher_id=TEACHER, progress=False)


def test_the_recovery_loss_with_the_cache_is_the_recovery_loss_with_the_teacher(tmp_path):
    """One training loss and its gradients: the cache with one token in the bucket against the teacher's forward."""
    from transformers import TrainingArguments

    teacher = lm().eval()
    examples = _examples().map(lambda row: {"labels": [t if m else -100 for t, m in zip(row["input_ids"],
                                                                                          row["attention_mask"])]})
    batch = {name: torch.tensor(examples[name]) for name in ("input_ids", "attention_mask", "labels")}
    losses, grads = [], []
    for kind in ("teacher", "cache"):
        student = lm(seed=1)
        extra = ({"teacher": teacher} if kind == "teacher"
                 else {"teacher_top_k": teacher_top_k(teacher, examples, k=VOCAB - 1, teacher_id=TEACHER,
                                                                   progress=False)})
        trainer = DistillationTrainer(model=student, args=TrainingArguments(str(tmp_path / kind), use_cpu=True,
                                                                            report_to="none"),
                                      distill_weight=0.7, **extra)
        loss = trainer.compute_loss(student, dict(batch))
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in student.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-3, atol=1e-6, msg=name)

"""The teacher's next-token distributions computed once and kept as their top k: the recovery's KL without a teacher
forward at every step (``hf-knorm convert --teacher-top-k K``).

A distilled recovery step runs the original model on the batch (its logits, ``(B, N, V)``) beside the student's
forward and backward. The training examples are fixed (the general mixture is a cached sample), so the teacher's
distribution of every example can be computed once, before the recovery, and read back at each step: a run draws
each example about 1.5 times, a second run (another seed, another recipe) none at all.

What is kept, per position of each example's real tokens: the teacher's ``k`` largest log-probabilities and their
token ids, and the log of the mass of every other token (``rest``, computed from the full distribution, not
``log(1 - sum)``). The KL is then taken between the two distributions coarse-grained to those ``k`` tokens plus one
"every other token" bucket (:func:`top_k_kl`):

    KL_k = sum_{i in top k} p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)

exactly the full ``KL(teacher || student)`` when the bucket holds one token (``k = V - 1``), and never above it for
smaller ``k`` (merging outcomes cannot raise a KL divergence): the student is still pulled to the teacher's mass on
the rest, not to its shape there.

The cache lives under ``cache_dir()/teacher_logits``, keyed by what the caller says the teacher is (``teacher_id``: a
conversion passes its run's fingerprint of the model folder) and its weights' dtype, the examples' tokens and ``k``;
the weights themselves are not read for the key (a 7B model's would be copied to the CPU and hashed at every start).
An example is found at each step by its tokens (a hash of its real token ids), so any sampler, shuffle or batch layout
reads the right rows.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

BATCH_TOKENS = 2048
"""Tokens per teacher forward while the cache is computed (the ``(B, N, V)`` logits of one batch in memory)."""


@dataclass
class TeacherTopK:
    """The teacher's top-``k`` next-token log-probabilities of a set of examples, one row per real token.

    Attributes:
        log_probs: ``(T, k)`` float32, each row's ``k`` largest log-probabilities, largest first.
        indices: ``(T, k)`` int32, their token ids.
        rest: ``(T,)`` float32, the log of the probability of every other token.
        rows: an example's key (:func:`example_key`) -> ``(first row, number of rows)``.
    """

    log_probs: torch.Tensor
    indices: torch.Tensor
    rest: torch.Tensor
    rows: dict[str, tuple[int, int]]

    @property
    def k(self) -> int:
        return self.log_probs.shape[1]

    def batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows of a batch, laid out as the batch is: ``(log_probs (B, N, k), indices (B, N, k), rest (B, N))``
        on the batch's device; an example's rows go to its real positions (``attention_mask`` 1) in order, padding
        positions get zeros (no loss scores them).

        Raises:
            KeyError: an example the cache was not computed for.
        """
        batch, length = input_ids.shape
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        log_probs = torch.zeros(batch, length, self.k)
        indices = torch.zeros(batch, length, self.k, dtype=torch.long)
        rest = torch.zeros(batch, length)
        for row in range(batch):
            real = mask[row].nonzero().squeeze(-1).cpu()
            key = example_key(input_ids[row][mask[row]])
            if key not in self.rows:
                raise KeyError(f"Teacher top-k: example {row} of this batch ({len(real)} tokens) is not in the cache "
                               "computed before the recovery; the cache and the training data disagree.")
            first, count = self.rows[key]
            log_probs[row, real] = self.log_probs[first:first + count]
            indices[row, real] = self.indices[first:first + count].long()
            rest[row, real] = self.rest[first:first + count]
        device = input_ids.device
        return log_probs.to(device), indices.to(device), rest.to(device)


def example_key(real_ids: torch.Tensor) -> str:
    """An example's key: a hash of its real token ids (``(n,)``, padding removed)."""
    return hashlib.blake2b(real_ids.detach().to("cpu", torch.int64).numpy().tobytes(), digest_size=16).hexdigest()


def top_k_kl(student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, teacher_indices: torch.Tensor,
             teacher_rest: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
    """``KL(teacher || student)`` coarse-grained to the teacher's top ``k`` tokens and one bucket for the rest (in
    fp32), over the positions the next-token loss scores (as :func:`.trainers.distillation_kl` counts them).

    Args:
        student_logits: ``(B, N, V)``.
        teacher_log_probs, teacher_indices: ``(B, N, k)``, the teacher's top ``k`` log-probabilities and token ids.
        teacher_rest: ``(B, N)``, the log of the teacher's mass outside them.
        labels: ``(B, N)`` the next-token labels (``-100``: not scored); ``None``: every position.
        reduction: ``mean`` (per counted position) or ``sum``.
    """
    if labels is not None:  # only the counted positions: the padding's zeros never enter the arithmetic
        counted = labels[:, 1:] != -100
        student_logits, teacher_log_probs = student_logits[:, :-1][counted], teacher_log_probs[:, :-1][counted]
        teacher_indices, teacher_rest = teacher_indices[:, :-1][counted], teacher_rest[:, :-1][counted]
    student = F.log_softmax(student_logits.float(), dim=-1)  # (..., V)
    student_top = student.gather(-1, teacher_indices)  # (..., k)
    student_rest = student.scatter(-1, teacher_indices, float("-inf")).logsumexp(-1)  # (...,)
    top = (teacher_log_probs.exp() * (teacher_log_probs - student_top)).sum(-1)
    bucket = teacher_rest.exp() * (teacher_rest - student_rest)
    per_position = top + bucket
    return per_position.sum() if reduction == "sum" else per_position.mean()


def teacher_top_k(teacher: torch.nn.Module, examples, k: int, *, teacher_id: str,
                  progress: bool = True) -> TeacherTopK:
    """The teacher's top-``k`` of every example of ``examples`` (a dataset of ``input_ids`` and optionally
    ``attention_mask``), read from the cache or computed (in fp32, on the teacher's device) and cached.

    Args:
        teacher: the model whose distributions are kept.
        examples: the dataset.
        k: how many tokens per position.
        teacher_id: names the teacher's weights, and changes whenever they do: the cache is keyed by it (with the
            weights' dtype), not by the weights. A conversion passes its run's fingerprint of the model folder the
            teacher was loaded from (:func:`hf_knorm.runs.run_folder.inputs_fingerprint`'s ``"model"``).
        progress: show a progress bar while computing.

    Raises:
        ValueError: ``k`` is not between 1 and the vocabulary size - 1 (``V - 1`` is already the exact KL), or an
            empty ``teacher_id``.
    """
    vocabulary = teacher.get_output_embeddings().weight.shape[0]
    if not 1 <= k < vocabulary:
        raise ValueError(f"teacher top-k must be between 1 and the vocabulary size - 1 ({vocabulary - 1}: the exact "
                         f"KL already), not {k}; 0 (no cache) runs the teacher at every step.")
    if not teacher_id:
        raise ValueError("teacher_top_k keys its cache by teacher_id, which names the teacher's weights (a conversion "
                         "passes its fingerprint of the model folder); got an empty one.")
    sequences = _real_sequences(examples)
    path = _cache_path(teacher, teacher_id, sequences, k)
    if path.is_file():
        return _load(path)
    cache = _compute(teacher, sequences, k, progress)
    _save(cache, path)
    return cache


def _real_sequences(examples) -> list[torch.Tensor]:
    """Each example's real token ids (``(n,)``; padding removed), in order."""
    masks = examples["attention_mask"] if "attention_mask" in examples.column_names else None
    sequences = []
    for index, ids in enumerate(examples["input_ids"]):
        ids = torch.as_tensor(ids)
        sequences.append(ids if masks is None else ids[torch.as_tensor(masks[index]).bool()])
    return sequences


@torch.no_grad()
def _compute(teacher, sequences: list[torch.Tensor], k: int, progress: bool) -> TeacherTopK:
    from tqdm.auto import tqdm

    was_training = teacher.training
    teacher.eval()
    device = next(teacher.parameters()).device
    unique = list({example_key(ids): ids for ids in sequences}.items())
    parts, rows, first = [], {}, 0
    bar = tqdm(total=sum(len(ids) for _, ids in unique), desc=f"teacher top-{k}", unit="tok", disable=not progress)
    try:
        start = 0
        while start < len(unique):
            longest = len(unique[start][1])
            size = max(1, BATCH_TOKENS // max(longest, 1))
            chunk = unique[start:start + size]
            start += size
            length = max(len(ids) for _, ids in chunk)
            input_ids = torch.zeros(len(chunk), length, dtype=torch.long)
            mask = torch.zeros(len(chunk), length, dtype=torch.long)
            for row, (_, ids) in enumerate(chunk):  # padded on the right: the real positions are unchanged
                input_ids[row, :len(ids)], mask[row, :len(ids)] = ids, 1
            logits = teacher(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
            log_probs = F.log_softmax(logits.float(), dim=-1)  # (b, n, V)
            values, indices = log_probs.topk(k, dim=-1)
            rest = log_probs.scatter(-1, indices, float("-inf")).logsumexp(-1)
            for row, (key, ids) in enumerate(chunk):
                count = len(ids)
                parts.append((values[row, :count].cpu(), indices[row, :count].to("cpu", torch.int32),
                              rest[row, :count].cpu()))
                rows[key] = (first, count)
                first += count
                bar.update(count)
    finally:
        bar.close()
        teacher.train(was_training)
    return TeacherTopK(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                       torch.cat([p[2] for p in parts]), rows)


def _cache_path(teacher, teacher_id: str, sequences: list[torch.Tensor], k: int) -> Path:
    """The cache file of this teacher (``teacher_id`` and its weights' dtypes; no weight is read), these examples and
    ``k``."""
    from ..assets.pypi import cache_dir

    dtypes = sorted({str(parameter.dtype) for parameter in teacher.parameters()})
    key = hashlib.sha256(json.dumps(["top-k v2", k, teacher_id, dtypes]).encode())
    for ids in sequences:
        key.update(example_key(ids).encode())
    folder = cache_dir() / "teacher_logits"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{key.hexdigest()[:16]}.pt"


def _save(cache: TeacherTopK, path: Path) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # several processes may compute the same cache
    torch.save({"log_probs": cache.log_probs, "indices": cache.indices, "rest": cache.rest, "rows": cache.rows},
               partial)
    os.replace(partial, path)


def _load(path: Path) -> TeacherTopK:
    saved = torch.load(path, weights_only=True)
    return TeacherTopK(saved["log_probs"], saved["indices"], saved["rest"],
                       {key: tuple(value) for key, value in saved["rows"].items()})

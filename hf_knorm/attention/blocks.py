"""Which blocks of the score matrix a bool mask lets attend, found on the mask's device in a few reductions.

Both quadratic kernels skip the key blocks no query of a block may attend (beyond the causal diagonal, outside a
sliding window, padding): the PyTorch kernel per row chunk (``kernel.py``), the Triton kernel per query block and,
in its backward, per key block (``triton_kernel.py``). Finding them reads the mask once, as a whole, with no host
synchronization; the PyTorch kernel then reads the ranges to the host once per call (it slices with them), the
Triton kernel not at all (its programs load them).
"""

from __future__ import annotations

import torch


def block_any(mask: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    """Whether any entry is True in each block of ``block`` entries along ``dim`` (the last block may be short):
    ``dim`` shrinks from ``n`` to ``ceil(n / block)``; no copy of ``mask`` is made."""
    dim = dim % mask.dim()
    size = mask.shape[dim]
    full = size // block * block
    head = mask.narrow(dim, 0, full).unflatten(dim, (size // block, block)).any(dim=dim + 1)
    if full == size:
        return head
    return torch.cat([head, mask.narrow(dim, full, size - full).any(dim=dim, keepdim=True)], dim=dim)


def first_last(blocks: torch.Tensor) -> torch.Tensor:
    """``(..., rows, n)`` bool -> ``(..., rows, 2)`` int32: ``[first, last + 1)`` of the True entries of each row,
    ``[0, 0)`` for a row with none."""
    count = blocks.shape[-1]
    as_int = blocks.to(torch.uint8)
    first = as_int.argmax(dim=-1)  # argmax returns the first maximum: the first True entry
    last = count - 1 - as_int.flip(-1).argmax(dim=-1)
    some = blocks.any(dim=-1)
    ranges = torch.stack([torch.where(some, first, 0), torch.where(some, last + 1, 0)], dim=-1)
    return ranges.to(torch.int32).contiguous()


def chunk_key_ranges(allowed: torch.Tensor, rows: int) -> torch.Tensor:
    """``(chunks, 2)`` int32: the keys ``[lo, hi)`` that some query of each chunk of ``rows`` queries may attend,
    over every batch item and head, from a bool mask ``(..., q, kv)``."""
    per_chunk = block_any(allowed, rows, dim=-2)  # (..., chunks, kv)
    return first_last(per_chunk.reshape(-1, *per_chunk.shape[-2:]).any(dim=0))

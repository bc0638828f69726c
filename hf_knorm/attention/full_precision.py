"""The attention in full precision under autocast: scores, normalization and sums in fp32, forward and backward.

Autocast (``torch.autocast``; the Trainer's ``--bf16``/``--fp16``) runs every matmul in bf16/fp16, also one whose
operands the kernels have just cast to fp32: under it, ``q.float() @ k.float().T`` is a bf16 product again, and an
``x^p/c`` normalization raises its rounding error to the ``p``-th power. So each entry of the attention turns autocast
off for the device of its tensors (:func:`full_precision`): the ``AttentionInterface`` function, the chunked and
linear kernels, the compiled custom ops; and each hand-written backward (the chunked kernel's autograd Function, the
custom op's backward) turns it off as well, since a backward runs under whatever autocast state its caller has. The
kernels then compute in fp32 (fp64 for fp64 inputs) from inputs of any dtype and return the query's dtype (bf16
under bf16 autocast, as the projections around them return).

Backward through autograd's own formulas (the linear kernel, the window's composition, the chunked kernel with
dropout) computes in the dtype of the saved fp32 activations when, as the Trainer does and PyTorch advises,
``backward()`` is called outside the autocast context.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla")
AUTOCAST_DEVICE_TYPES = frozenset(name for name in _DEVICE_TYPES if torch.amp.is_autocast_available(name))
"""Device types autocast exists for in this PyTorch (read once: compiled code traces a set lookup)."""


def autocast_off(device_type: str):
    """A context in which autocast is off on ``device_type`` (``"cpu"``, ``"cuda"``, ...); a no-op context where
    autocast is already off there or does not exist for it."""
    if device_type not in AUTOCAST_DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def full_precision(function):
    """Decorate an attention entry point: ``function`` runs with autocast off on the device of its first tensor
    argument (the query, or the upstream gradient of a backward); its own casts decide every dtype.

    Raises:
        TypeError: at call time, when no argument is a tensor (there is no device to turn autocast off on).
    """

    @functools.wraps(function)
    def entry(*args, **kwargs):
        device_type = _first_device_type(args, kwargs, function.__qualname__)
        with autocast_off(device_type):
            return function(*args, **kwargs)

    return entry


def _first_device_type(args: tuple, kwargs: dict, name: str) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    raise TypeError(f"{name} takes its device from a tensor argument, and was called with none.")

"""The normalizations this folder's tests run, derived from the registry so that a newly registered family is checked
by every test here without editing them: the first example spelling of each family
(:data:`hf_knorm.normalizations.FAMILIES`), every family's learnable variant, and softmax windows (with sinks) beside
a family. Learnable values are set to random values away from their initial ones (:func:`random_values`), so that
their gradients and their saving are meaningful.
"""

from __future__ import annotations

import torch

from hf_knorm.models.parameters import set_learned_values
from hf_knorm.normalizations import FAMILIES, Normalization, Windowed, parse_normalization, with_window

LEARNABLE = ("sigmoid(bias=learned)", "softmax(sink=learned)", "ssmax(scale=learned)")
"""A learnable variant of each family that has one (the families' own examples include some of them)."""

WINDOW = 4
"""The softmax window of the windowed cases: shorter than the tests' sequences, so every part has keys."""

WINDOWED = (
    "relu(x)^3/16 + softmax window 4 + sinks 1",
    "sigmoid(bias=learned) + softmax window 4",  # the base family's learnable value beside the mix
    # the window's own examples, with a window of 4 (and at most one sink)
    *(with_window(parse_normalization(example).without_window, WINDOW,
                  min(1, parse_normalization(example).sinks)).name for example in Windowed.examples),
)


def _unique(spellings) -> tuple[str, ...]:
    return tuple(dict.fromkeys(spellings))


FAMILY_EXAMPLES = _unique(family.examples[0] for family in FAMILIES.values())
"""One spelling per registered family: its first example."""

ALL_EXAMPLES = _unique([*(example for family in FAMILIES.values() for example in family.examples),
                        *Windowed.examples])
"""Every example spelling the registry lists."""

SPELLINGS = _unique([*FAMILY_EXAMPLES, *LEARNABLE, *WINDOWED])
"""What the kernel and model tests run: one per family, the learnable variants, the windowed ones."""

NOT_WINDOWED = tuple(spelling for spelling in SPELLINGS if not parse_normalization(spelling).window)
WITH_SINKS = tuple(spelling for spelling in SPELLINGS if parse_normalization(spelling).sinks)

_RANGES = {"bias": (-3.0, 0.0), "sink": (-1.0, 1.0), "scale": (0.3, 1.5), "window_mix": (0.5, 1.5)}
"""Where the random values of each known learnable value lie (a sigmoid bias at its init, -6.9, would leave weights of
1e-3 on these short rows); a value of a new family: its init +- 0.5."""


def random_values(normalization: Normalization, heads: int, seed: int = 0,
                  dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """``{name: (heads,) tensor}`` for each learnable value of ``normalization``, none equal to its init."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for name, init in normalization.learnable().items():
        low, high = _RANGES.get(name, (init - 0.5, init + 0.5))
        value = low + (high - low) * torch.rand(heads, generator=generator, dtype=torch.float64)
        assert not torch.isclose(value, torch.tensor(float(init), dtype=torch.float64)).any()
        values[name] = value.to(dtype)
    return values


def randomize_learned(model, normalization: Normalization, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Set every learnable value of a patched ``model`` to random values (:func:`random_values`, per layer);
    returns them ``{name: [(H_q,) per layer]}``."""
    from hf_knorm.models.architectures import attention_modules
    from hf_knorm.models.parameters import query_heads

    modules = [module for _, module in attention_modules(model)]
    written = {name: [] for name in normalization.learnable()}
    for layer, module in enumerate(modules):
        for name, value in random_values(normalization, query_heads(module), seed=seed + layer,
                                         dtype=torch.float32).items():
            written[name].append(value)
    for name, values in written.items():
        set_learned_values(model, name, values)
    return written

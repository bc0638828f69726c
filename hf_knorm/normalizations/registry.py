"""The registered families, and the one place a spelling or a saved record becomes a normalization.

``parse_normalization("sigmoid(bias=-log n)")`` and ``Sigmoid()`` are the same object; every entry point (``hf_knorm.patch``, the
CLI, a saved config) parses here once and passes the object on. :func:`normalizations` lists the families with an
example spelling each (the CLI's ``--help`` prints the same list).

Adding a family: one file in this package (a frozen dataclass subclassing :class:`~.base.Normalization`), and one
line in :data:`FAMILIES`. The parametrized tests (``tests/normalizations/``) then check it everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache

from .base import Normalization
from .polynomial import Polynomial
from .rectified import Rectified
from .sigmoid import Sigmoid
from .sink_softmax import SinkSoftmax
from .softmax import Softmax
from .softpick import Softpick
from .ssmax import SSMax
from .stick_breaking import StickBreaking
from .sparse_choice import DEFAULT_SCORE
from .windowed import Windowed, with_clusters, with_sparse, with_window

FAMILIES: dict[str, type[Normalization]] = {
    family.family: family
    for family in (Softmax, Polynomial, Rectified, Sigmoid, SinkSoftmax, Softpick, SSMax, StickBreaking)
}
"""Every family by its registry key, in the order they are listed."""

RECORD_FORMAT = 2
"""The version of the saved record (``config.hf_knorm["normalization_record"]``); format 1 (releases before the
families) saved the spelling only."""

_WINDOW = re.compile(r"^(?P<base>.*?)\s*\+\s*softmax\s*window\s*(?P<window>[^\s+]*)"
                     r"(?:\s*\+\s*sinks\s*(?P<sinks>[^\s+]*))?"
                     r"(?:\s*\+\s*sparse\s*(?P<sparse>[^\s(]*)\s*(?:\((?P<score>[^)]*)\))?)?"
                     r"(?:\s*\+\s*clusters\s*(?P<clusters>[^\s+]*))?\s*$", re.IGNORECASE)


def accepted_forms() -> str:
    """One line per family: its key, example spellings and source."""
    return "\n".join(f"  {key:<15} {', '.join(family.examples):<55} {family.source}"
                     for key, family in FAMILIES.items())


def representative_spellings() -> list[str]:
    """The first example spelling of each family, then every other example that learns a value: what the benchmarks
    and the device check run, one line per family and per learnable variant."""
    first = [family.examples[0] for family in FAMILIES.values()]
    learned = [example for family in FAMILIES.values() for example in family.examples[1:] if "learned" in example]
    return first + [spelling for spelling in learned if spelling not in first]


def list_normalizations() -> dict[str, dict[str, str]]:
    """The registered families: ``{key: {"example": spelling, "examples": ..., "source": ..., "fast_paths": ...}}``;
    each example parses (``hf_knorm.parse_normalization(example)``)."""
    listed = {}
    for key, family in FAMILIES.items():
        example = parse_normalization(family.examples[0])
        listed[key] = {"example": family.examples[0], "examples": ", ".join(family.examples),
                       "source": family.source, "fast_paths": ", ".join(example.fast_paths)}
    return listed


@lru_cache(maxsize=256)
def _parse_text(spelling: str) -> Normalization:
    windowed = _WINDOW.match(spelling)
    if windowed is not None:
        window, sinks = windowed["window"], windowed["sinks"]
        if not window.isdigit():
            raise ValueError(f"Normalization {spelling!r}: the softmax window is a number of keys, an integer >= 0, "
                             f"got {window!r}. Spell it like 'x^3/16 + softmax window 64'.")
        if sinks is not None and not sinks.isdigit():
            raise ValueError(f"Normalization {spelling!r}: the sinks are a number of keys, an integer >= 0, got "
                             f"{sinks!r}. Spell it like 'x^3/16 + softmax window 64 + sinks 4'.")
        sparse, score = windowed["sparse"], windowed["score"]
        if sparse is not None and not sparse.isdigit():
            raise ValueError(f"Normalization {spelling!r}: the sparse cache is a number of key/value pairs, an integer "
                             f">= 0, got {sparse!r}. Spell it like 'x/1 + softmax window 64 + sparse 64 (key_norm)'.")
        normalization = with_window(_parse_text(windowed["base"]), int(window), sinks=int(sinks or 0))
        clusters = windowed["clusters"]
        if clusters is not None and not clusters.isdigit():
            raise ValueError(f"Normalization {spelling!r}: clusters is a number of pseudo-pairs, an integer >= 0, got "
                             f"{clusters!r}. Spell it like 'x/1 + softmax window 64 + sparse 64 (key_norm) + "
                             "clusters 256'.")
        if sparse is not None:
            normalization = with_sparse(normalization, int(sparse), (score or DEFAULT_SCORE).strip())
        return normalization if clusters is None else with_clusters(normalization, int(clusters))
    if re.search(r"\+\s*sparse", spelling, re.IGNORECASE):
        raise ValueError(f"Normalization {spelling!r}: a sparse cache is weighted by softmax jointly with a softmax "
                         "window, and this spelling has none before it. Spell it like "
                         "'x/1 + softmax window 64 + sinks 4 + sparse 64 (key_norm)'.")
    text = spelling.strip().replace(" ", "")
    for family in FAMILIES.values():
        parsed = family.parse(text)
        if parsed is not None:
            return parsed
    raise ValueError(f"Unknown normalization {spelling!r}. The families and their spellings:\n{accepted_forms()}")


def parse_normalization(spelling: str | Normalization) -> Normalization:
    """The normalization a spelling names (a :class:`Normalization` is returned as it is).

    Raises:
        ValueError: not a spelling of a registered family (the message lists them with examples), or a family's
            spelling with a bad value (the message says which).
    """
    if isinstance(spelling, Normalization):
        return spelling
    if not isinstance(spelling, str):
        raise ValueError(f"A normalization is a string or a hf_knorm normalization object, got "
                         f"{type(spelling).__name__}. The families:\n{accepted_forms()}")
    return _parse_text(spelling)


def from_record(record: Mapping) -> Normalization:
    """The normalization a saved record (:meth:`Normalization.to_record`) describes.

    Raises:
        ValueError: an unknown family (a record written by a newer hf_knorm) or fields the family does not take.
    """
    family = record.get("family")
    if family == Windowed.family:
        return Windowed.from_record(record)
    if family not in FAMILIES:
        raise ValueError(f"The saved normalization's family {family!r} is not one this hf_knorm knows "
                         f"({', '.join(FAMILIES)}); upgrade hf_knorm to load it.")
    try:
        return FAMILIES[family].from_record(record)
    except TypeError as error:
        raise ValueError(f"The saved {family} normalization {dict(record)} does not fit this hf_knorm: {error}.") from None

"""The registered families, and the one place a spelling or a saved record becomes a normalization.

``parse_normalization("sigmoid(bias=-log n)")`` and ``Sigmoid()`` are the same object; every entry point (``hf_knorm.patch``, the
CLI, a saved config) parses here once and passes the object on. :func:`list_normalizations` lists the families with
an example spelling each; :func:`normalization_grammar` says how a spelling composes a family with a softmax window,
sinks, a sparse cache and clusters (:mod:`.grammar`), and every spelling error shows it, naming the part that failed
and the nearest valid spelling (:class:`~.grammar.SpellingError`); the CLI's ``--help`` prints it too.

Adding a family: one file in this package (a frozen dataclass subclassing :class:`~.base.Normalization`), and one
line in :data:`FAMILIES`. The parametrized tests (``tests/normalizations/``) then check it everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from .base import Normalization
from .grammar import PARTS, SCORES, Misspelled, SpellingError, nearest, parts_usage, read_parts, split
from .polynomial import Polynomial
from .rectified import Rectified
from .sigmoid import Sigmoid
from .sink_softmax import SinkSoftmax
from .softmax import Softmax
from .softpick import Softpick
from .ssmax import SSMax
from .stick_breaking import StickBreaking
from .windowed import Windowed, with_clusters, with_sparse, with_window

FAMILIES: dict[str, type[Normalization]] = {
    family.family: family
    for family in (Softmax, Polynomial, Rectified, Sigmoid, SinkSoftmax, Softpick, SSMax, StickBreaking)
}
"""Every family by its registry key, in the order they are listed."""

RECORD_FORMAT = 2
"""The version of the saved record (``config.hf_knorm["normalization_record"]``); format 1 (releases before the
families) saved the spelling only."""


def representative_spellings() -> list[str]:
    """The first example spelling of each family, then every other example that learns a value: what the benchmarks
    and the device check run, one line per family and per learnable variant."""
    first = [family.examples[0] for family in FAMILIES.values()]
    learned = [example for family in FAMILIES.values() for example in family.examples[1:] if "learned" in example]
    return first + [spelling for spelling in learned if spelling not in first]


def list_normalizations() -> dict[str, dict[str, str]]:
    """The registered families: ``{key: {"example": spelling, "examples": ..., "source": ..., "fast_paths": ...}}``;
    each example parses (``hf_knorm.parse_normalization(example)``). How a whole spelling composes a family with the
    optional parts (a softmax window, sinks, a sparse cache, clusters): :func:`normalization_grammar`."""
    listed = {}
    for key, family in FAMILIES.items():
        example = parse_normalization(family.examples[0])
        listed[key] = {"example": family.examples[0], "examples": ", ".join(family.examples),
                       "source": family.source, "fast_paths": ", ".join(example.fast_paths)}
    return listed


def normalization_grammar() -> str:
    """The grammar of a spelling, in one block: the composition, the base families with their spellings, and the
    optional parts in their order (with the sparse cache's scores). Every spelling error ends with it; the CLI's
    ``--help`` prints it."""
    families = "\n".join(f"  {key:<15} {', '.join(family.examples)}" for key, family in FAMILIES.items())
    parts = "\n".join(f"  + {part.form:<17} {part.means}" for part in PARTS)
    return (f"A normalization is spelled {parts_usage()}.\n"
            f"BASE, one family (its key: its spellings):\n{families}\n"
            f"Then, each at most once, in this order (W, S, K, C integers >= 0):\n{parts}\n"
            f"  SCORE, one of: {SCORES}\n"
            "e.g. 'x^3/16 + softmax window 64 + sinks 4',\n"
            "     'x/1 + softmax window 64 + sinks 4 + sparse 64 (prefix_kv_diff) + clusters 256'.")


@lru_cache(maxsize=256)
def _parse_text(spelling: str) -> Normalization:
    parts = split(spelling)
    try:
        return _compose(parts)
    except Misspelled as failure:
        suggestion = _nearest_valid(failure)
        lead = "Unknown normalization" if failure.unknown else "Normalization"
        named = f"{failure.label} {failure.part!r}" if failure.part else failure.label
        did_you_mean = f" Did you mean {suggestion!r}?" if suggestion else ""
        raise SpellingError(f"{lead} {spelling!r}, at {named}: {failure.problem}{did_you_mean}\n"
                            f"{normalization_grammar()}", part=failure.part, suggestion=suggestion) from None


_BASE = "the base family's part"


def _compose(parts: list[str]) -> Normalization:
    """The normalization of a spelling split into its parts (:func:`.grammar.split`).

    Raises:
        Misspelled: a part that does not parse (the first from the left).
        ValueError: parts that parse but do not go together (e.g. a softmax window beside softmax).
    """
    base = _parse_base(parts)
    read = read_parts(parts)
    if "softmax window" not in read:
        return base
    normalization = with_window(base, read["softmax window"][0], sinks=read.get("sinks", (0,))[0])
    if "sparse" in read:
        normalization = with_sparse(normalization, *read["sparse"])
    if "clusters" in read:
        normalization = with_clusters(normalization, read["clusters"][0])
    return normalization


def _parse_base(parts: list[str]) -> Normalization:
    given = parts[0]
    if not given:
        problem = "the spelling is empty" if len(parts) == 1 else "the spelling starts with '+'"
        raise Misspelled(0, given, _BASE, f"{problem}; it starts with a family's spelling.", [], unknown=True)
    text = given.replace(" ", "")
    problem = None
    for family in FAMILIES.values():
        try:
            parsed = family.parse(text)
        except ValueError as error:  # the family's spelling with a bad value
            problem = str(error).removeprefix(f"Normalization {text!r}: ")
            break
        if parsed is not None:
            return parsed
    spellings = [example for family in FAMILIES.values() for example in family.examples]
    guesses = nearest(text, [*spellings, *FAMILIES])
    fixes = [[FAMILIES[guess].examples[0] if guess in FAMILIES else guess, *parts[1:]] for guess in guesses]
    raise Misspelled(0, given, _BASE, problem or "no family is spelled so (the families are listed below).", fixes,
                     unknown=problem is None)


def _nearest_valid(failure: Misspelled, depth: int = 4) -> str | None:
    """The canonical spelling of the first of ``failure``'s fixes that parses, fixing what fails next in turn (at
    most ``depth`` parts); ``None`` when none does."""
    for fix in failure.fixes:
        try:
            return _compose(fix).name
        except Misspelled as next_failure:
            found = _nearest_valid(next_failure, depth - 1) if depth > 1 else None
            if found is not None:
                return found
        except ValueError:  # parses, but its parts do not go together
            continue
    return None


def parse_normalization(spelling: str | Normalization) -> Normalization:
    """The normalization a spelling names (a :class:`Normalization` is returned as it is).

    Raises:
        SpellingError: (a ``ValueError``) a part of the spelling does not parse: the base family's (no family's
            spelling, or a bad value), a ``+ ...`` part (unknown, repeated, out of order, without the part it needs,
            or a bad value) or the sparse cache's score. ``error.part`` is that part as typed, ``error.suggestion``
            the nearest valid spelling (or ``None``); the message says both and ends with
            :func:`normalization_grammar`.
        ValueError: parts that parse but do not go together (a softmax window beside softmax, sinks beside a
            window of 0, ...), or neither a string nor a normalization.
    """
    if isinstance(spelling, Normalization):
        return spelling
    if not isinstance(spelling, str):
        raise ValueError(f"A normalization is a string or a hf_knorm normalization object, got "
                         f"{type(spelling).__name__}.\n{normalization_grammar()}")
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

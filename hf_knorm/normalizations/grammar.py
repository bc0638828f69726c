"""The grammar of a spelling: ``BASE [+ softmax window W [+ sinks S] [+ sparse K (SCORE) [+ clusters C]]]``.

``BASE`` is one family's spelling (the registry parses it); the optional parts (:data:`PARTS`) follow it, each once,
in their order, each after the part it needs. This module splits a spelling into its parts (:func:`split`), reads
the optional ones (:func:`read_parts`) and, where one does not parse, says which part, what is wrong with it, and
which corrected part lists to try (:class:`Misspelled`): the registry turns that into a :class:`SpellingError` naming
the part, the nearest valid spelling and the grammar (:func:`hf_knorm.normalizations.registry.normalization_grammar`).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from .prefix_kv_diff import REACH
from .sparse_choice import DEFAULT_SCORE, PREFIX_SCORES, SPARSE_SCORES, check_sparse_score


@dataclass(frozen=True)
class Part:
    """An optional part ``+ keyword VALUE``: ``form`` as the grammar writes it, ``example`` a value that parses,
    ``counts`` what the value counts, ``requires`` the keyword of the part it needs before it (``None``: the base's),
    ``needs`` why, ``means`` what the part does (one line of the grammar)."""

    keyword: str
    form: str
    example: str
    counts: str
    requires: str | None
    needs: str
    means: str

    def starts(self, text: str) -> re.Match | None:
        """The keyword at the start of ``text`` (any case, any spaces inside it), not followed by a letter."""
        return re.match(self.keyword.replace(" ", r"\s*") + r"(?![a-z_])", text, re.IGNORECASE)


PARTS = (
    Part("softmax window", "softmax window W", "64", "the softmax window is a number of keys", None, "",
         "the last W keys weighted by softmax, the older ones by BASE (0: BASE alone)"),
    Part("sinks", "sinks S", "4", "the sinks are a number of keys", "softmax window",
         "the sinks are keys weighted by softmax beside a softmax window, and this spelling has none before them",
         "each sequence's first S keys weighted by softmax too"),
    Part("sparse", "sparse K (SCORE)", "64", "the sparse cache is a number of key/value pairs", "softmax window",
         "a sparse cache is weighted by softmax jointly with a softmax window, and this spelling has none before it",
         "the K older pairs of highest SCORE (per KV head) weighted by softmax too"),
    Part("clusters", "clusters C", "256", "clusters is a number of pseudo-pairs", "sparse",
         "clusters summarize the older pairs a sparse cache leaves, and this spelling has none before them",
         "the remaining older pairs summarized by C pseudo-pairs (per KV head) weighted by softmax too"),
)
"""The optional parts, in the order a spelling gives them."""

SCORES = ", ".join(f"{score} (the default)" if score == DEFAULT_SCORE else
                   f"{score} (a window >= {REACH + 1})" if score in PREFIX_SCORES else score for score in SPARSE_SCORES)
"""The sparse cache's scores (:data:`.sparse_choice.SPARSE_SCORES`), as the grammar lists them."""

_ORDER = {part.keyword: position for position, part in enumerate(PARTS)}
_BY_KEYWORD = {part.keyword: part for part in PARTS}


def parts_usage() -> str:
    """``BASE [+ softmax window W [+ sinks S] [+ sparse K (SCORE) [+ clusters C]]]``, from :data:`PARTS`."""
    def nested(part: Part) -> str:
        inner = "".join(f" {nested(child)}" for child in PARTS if child.requires == part.keyword)
        return f"[+ {part.form}{inner}]"
    return "BASE" + "".join(f" {nested(part)}" for part in PARTS if part.requires is None)


class SpellingError(ValueError):
    """A spelling that does not parse. ``part`` is the part that failed, as typed (the base family's part, a
    ``+ ...`` part, or a sparse cache's score), ``suggestion`` the nearest valid spelling (``None`` when none is
    near); the message says both and shows the grammar."""

    def __init__(self, message: str, part: str | None = None, suggestion: str | None = None):
        super().__init__(message)
        self.part = part
        self.suggestion = suggestion


class Misspelled(Exception):
    """Where a spelling (split into parts, :func:`split`) stops parsing: ``index`` of the part, ``part`` its text as
    typed, ``label`` what it is (``"the base family's part"``, ``"the part"``, ``"the sparse cache's score"``),
    ``problem`` what is wrong, ``fixes`` the corrected part lists to try, nearest first; ``unknown``: the base
    family's part is no family's spelling (or empty)."""

    def __init__(self, index: int, part: str, label: str, problem: str, fixes: list[list[str]],
                 unknown: bool = False):
        super().__init__(problem)
        self.index, self.part, self.label, self.problem, self.fixes = index, part, label, problem, fixes
        self.unknown = unknown


def split(spelling: str) -> list[str]:
    """The base family's part and each ``+ ...`` part after it, stripped (the ``+`` dropped). A ``+`` inside
    parentheses or signing a number (``x^+3/16``, ``1e+3``) is not a separator."""
    parts, depth, start = [], 0, 0
    for position, char in enumerate(spelling):
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        elif char == "+" and depth == 0 and not _signs_a_number(spelling, position):
            parts.append(spelling[start:position].strip())
            start = position + 1
    return [*parts, spelling[start:].strip()]


def _signs_a_number(text: str, position: int) -> bool:
    before, after = text[position - 1:position], text[position + 1:position + 2]
    if not (after.isdigit() or after == "."):
        return False
    return before in ("^", "=", ",", "/") or (before in ("e", "E") and text[position - 2:position - 1].isdigit())


def nearest(text: str, candidates, cutoff: float = 0.5) -> list[str]:
    """The candidates close to ``text`` (difflib's ratio, any case, spaces ignored), nearest first."""
    def key(value: str) -> str:
        return value.replace(" ", "").lower()
    by_key = {}
    for candidate in candidates:
        by_key.setdefault(key(candidate), candidate)
    return [by_key[match] for match in difflib.get_close_matches(key(text), list(by_key), n=5, cutoff=cutoff)]


def read_parts(parts: list[str]) -> dict[str, tuple[int, str | None]]:
    """``{keyword: (value, score)}`` of the optional parts ``parts[1:]`` (``score`` for ``sparse`` only; ``None``
    elsewhere).

    Raises:
        Misspelled: the first part (from the left) that is unknown, repeated, out of order, missing the part it
            needs, or has a value that is not an integer >= 0 (or, for ``sparse``, an unknown score).
    """
    known = {index: _which(text) for index, text in enumerate(parts) if index}
    read: dict[str, tuple[int, str | None]] = {}
    for index in range(1, len(parts)):
        text, part = parts[index], known[index]
        if part is None:
            raise _unknown(parts, index)
        if part.keyword in read:
            raise Misspelled(index, f"+ {text}", "the part", f"'+ {part.keyword}' is given twice; give it once.",
                             [parts[:index] + parts[index + 1:]])
        later = [parts[after] for after in range(index + 1, len(parts))
                 if known[after] is not None and _ORDER[known[after].keyword] < _ORDER[part.keyword]]
        if later:
            order = ", then ".join(f"'+ {each.form}'" for each in PARTS)
            in_order = [parts[0], *sorted(parts[1:], key=_position)]
            raise Misspelled(index, f"+ {text}", "the part", f"it comes before '+ {later[0]}', and the parts go in "
                             f"the order {order}.", [in_order])
        if part.requires is not None and part.requires not in read:
            required = _BY_KEYWORD[part.requires]
            raise Misspelled(index, f"+ {text}", "the part", f"{part.needs}; give '+ {required.form}' before it.",
                             [parts[:index] + [f"{required.keyword} {required.example}"] + parts[index:]])
        read[part.keyword] = _read_value(parts, index, part)
    return read


def _which(text: str) -> Part | None:
    return next((part for part in PARTS if part.starts(text)), None)


def _position(text: str) -> int:
    """Where a part goes in :data:`PARTS`'s order (an unknown one last)."""
    part = _which(text)
    return len(PARTS) if part is None else _ORDER[part.keyword]


def _unknown(parts: list[str], index: int) -> Misspelled:
    text = parts[index]
    if not text:
        return Misspelled(index, "+", "the part", "nothing follows this '+'.", [parts[:index] + parts[index + 1:]])
    words = re.match(r"[^\d(]*", text).group()
    rest = text[len(words):].strip()
    names = ", ".join(f"'+ {part.form}'" for part in PARTS)
    guesses = nearest(words.strip(" =:_-"), _BY_KEYWORD)
    fixes = [parts[:index] + [f"{keyword} {rest or _BY_KEYWORD[keyword].example}"] + parts[index + 1:]
             for keyword in guesses]
    what = f"'{words.strip()}' is not a part's name" if words.strip() else "a part starts with its name"
    return Misspelled(index, f"+ {text}", "the part", f"{what}; the parts, in their order: {names}.", fixes)


def _read_value(parts: list[str], index: int, part: Part) -> tuple[int, str | None]:
    text = parts[index]
    value = text[part.starts(text).end():].strip()
    after = ""
    if part.keyword == "sparse":  # sparse K (SCORE)
        value, after = re.match(r"([^\s(]*)\s*(.*)", value, re.DOTALL).groups()
    if not re.fullmatch(r"[0-9]+", value):
        digits = re.match(r"[+-]?([0-9]+)", value)  # '-1', '64k', '4.5': its leading integer; else the example
        fixed = f"{part.keyword} {digits.group(1) if digits else part.example} {after}".strip()
        raise Misspelled(index, f"+ {text}", "the part", f"{part.counts}, an integer >= 0, got {value!r}.",
                         [parts[:index] + [fixed] + parts[index + 1:]])
    return int(value), (_read_score(parts, index, value, after) if part.keyword == "sparse" else None)


def _read_score(parts: list[str], index: int, value: str, after: str) -> str:
    """The score of ``sparse K (SCORE)`` (``after`` is what follows ``K``; empty: the default score)."""
    if not after:
        return DEFAULT_SCORE
    given = re.fullmatch(r"\((.*)\)", after, re.DOTALL)
    score = (given.group(1) if given else after).strip()
    fixes = [parts[:index] + [f"sparse {value} ({guess})"] + parts[index + 1:]
             for guess in nearest(score, SPARSE_SCORES, cutoff=0.4)]
    if given is None:
        raise Misspelled(index, score, "the sparse cache's score", f"the score is given in parentheses, e.g. "
                         f"'sparse {value} ({DEFAULT_SCORE})', got {after!r}.",
                         fixes + [parts[:index] + [f"sparse {value}"] + parts[index + 1:]])
    try:
        check_sparse_score(score)
    except ValueError as error:
        raise Misspelled(index, score, "the sparse cache's score", str(error), fixes) from None
    return score

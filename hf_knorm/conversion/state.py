"""The run state of a conversion, ``convert_state.json``: what each finished stage measured.

Its presence means a run was started in the folder (``--resume`` continues it); a stage marked ``done`` is not run
again. Written atomically, so an interrupted write never leaves half a file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STATE_FILE = "convert_state.json"


def read_state(out: Path) -> dict:
    """The run's state (what each finished stage measured), or a new one."""
    path = out / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {"started": time.time()}


def write_state(out: Path, state: dict) -> None:
    """Write the run's state atomically (a temporary file, then ``os.replace``)."""
    partial = out / (STATE_FILE + ".partial")
    partial.write_text(json.dumps(state, indent=2, default=str) + "\n")
    os.replace(partial, out / STATE_FILE)

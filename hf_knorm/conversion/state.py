"""The run state of a conversion, ``convert_state.json``: what each finished stage measured.

Its presence means a run was started in the folder (``--resume`` continues it); a stage marked ``done`` is not run
again. Written atomically, so an interrupted write never leaves half a file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..runs.run_folder import is_main_process, write_json

STATE_FILE = "convert_state.json"


def read_state(out: Path) -> dict:
    """The run's state (what each finished stage measured), or a new one."""
    path = out / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {"started": time.time()}


def write_state(out: Path, state: dict) -> None:
    """Write the run's state atomically (:func:`hf_knorm.runs.run_folder.write_json`), from the main process only."""
    if is_main_process():
        write_json(out / STATE_FILE, state)

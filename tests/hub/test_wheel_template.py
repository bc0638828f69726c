"""The card template ships in the wheel: an installed (not editable) hf_knorm renders cards as a checkout does."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from hf_knorm.hub.card import TEMPLATE

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_the_card_template(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools builds in the source tree, and a stale build/ would leak in
    shutil.copytree(ROOT / "hf_knorm", source / "hf_knorm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("hf_knorm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("hf_knorm/hub/model_card.md").decode() == TEMPLATE.read_text()


def test_model_cards_links_to_the_packaged_template():
    assert (ROOT / "model_cards" / "hf_knorm_model_card.md").resolve() == TEMPLATE.resolve()

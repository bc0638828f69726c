"""The README's Layout block is the map of the package: every module is on it, and everything on it exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layout_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    return block.splitlines()


def _listed_modules() -> set[str]:
    """Paths relative to hf_knorm/ named by the block (folders from indentation, files by name)."""
    listed, folder = set(), None
    for line in _layout_block():
        match = re.match(r"^( *)(\S+)", line)
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2)
        if indent == 2 and name.endswith("/"):
            folder = name
        elif indent == 2:
            folder = None
            listed.add(name)
        elif indent == 4 and folder:
            listed.add(folder + name)
    return listed


def test_readme_layout_matches_the_package():
    package = ROOT / "hf_knorm"
    actual = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    listed = _listed_modules()
    assert actual - listed == set(), "modules missing from the README's Layout block"
    assert listed - actual == set(), "the README's Layout block names modules that do not exist"


def test_every_subpackage_says_what_it_holds_and_may_import():
    for init in sorted((ROOT / "hf_knorm").glob("*/__init__.py")):
        doc = init.read_text().split('"""')[1]
        assert "import" in doc.lower(), f"{init.parent.name}/__init__.py should say what it may import"

"""The Layout block of docs/architecture.md is the map of the package: every module is on it, and everything on it
exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layout_block() -> list[str]:
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    block = architecture.split("## Layout", 1)[1].split("```", 2)[1]
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


def test_the_layout_block_matches_the_package():
    package = ROOT / "hf_knorm"
    actual = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    listed = _listed_modules()
    assert actual - listed == set(), "modules missing from the Layout block of docs/architecture.md"
    assert listed - actual == set(), "the Layout block of docs/architecture.md names modules that do not exist"


def test_every_subpackage_says_what_it_holds_and_may_import():
    for init in sorted((ROOT / "hf_knorm").glob("*/__init__.py")):
        doc = init.read_text().split('"""')[1]
        assert "import" in doc.lower(), f"{init.parent.name}/__init__.py should say what it may import"


def _contract_layers() -> list[str]:
    import tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    return [name.strip() for layer in contract["layers"] for name in layer.split("|")]


def test_the_architecture_page_names_every_layer_of_the_import_contract_in_order():
    """docs/architecture.md's sentence on the layers names those of pyproject.toml's contract, top to bottom, none left
    out."""
    readme = (ROOT / "docs" / "architecture.md").read_text()
    sentence = readme.split("The layers, top to bottom, are declared once in", 1)[1].split("An upward import", 1)[0]
    named = re.findall(r"`([a-z_]+)`", sentence)  # `pyproject.toml`, `make test`, `lint-imports` do not match
    assert named == _contract_layers()


def test_the_documents_the_package_cites_exist():
    """A docstring or config that cites a repository document (README.md, BENCHMARKS.md, ...) cites one that is
    there."""
    cited = {}
    for path in [*(ROOT / "hf_knorm").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "configs").glob("*")]:
        for name in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", path.read_text()):
            cited.setdefault(name, str(path.relative_to(ROOT)))
    missing = {name: where for name, where in cited.items() if not (ROOT / name).is_file()}
    assert missing == {}, "documents cited but not in the repository (name: first file citing it)"


def test_the_fsdp_config_says_what_the_jobs_do_on_a_cpu(monkeypatch):
    """configs/accelerate_fsdp.yaml does not promise a CPU run that the jobs refuse."""
    import pytest

    from hf_knorm.runs import sharding

    text = (ROOT / "configs" / "accelerate_fsdp.yaml").read_text()
    assert "gloo" not in text and "refuse" in text
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setattr(sharding, "has_accelerator", lambda: False)
    with pytest.raises(ValueError, match="no accelerator"):
        sharding.check_fsdp("hf-knorm finetune", supported=True)


def test_the_package_reaches_trl_only_through_its_public_modules():
    """TRL's own dataset handling is used through its public API (``trl``, ``trl.data_utils``), never through a
    trainer's module (the conversion's collator came from ``trl.trainer.sft_trainer``, which TRL may move any day)."""
    reached = set()
    for path in (ROOT / "hf_knorm").rglob("*.py"):
        for module in re.findall(r"^\s*(?:from|import) (trl[\w.]*)", path.read_text(), flags=re.M):
            reached.add((module, str(path.relative_to(ROOT))))
    assert {module for module, _ in reached} <= {"trl", "trl.data_utils"}, sorted(reached)

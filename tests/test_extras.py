"""Dependencies are declared where they are used: a small core, the jobs' needs in extras, a clear error naming one."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hf_knorm.extras import OPTIONAL, MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
JOB_MODULES = ("tensorboard", "sklearn", "peft", "matplotlib", "datasets")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group()).lower() for r in requirements}


def test_importing_hf_knorm_loads_no_job_dependency():
    """peft is left out of this check: Transformers' own ``trainer_utils`` (hence ``TrainerCallback``, which the core's
    ``NormLoggerCallback`` subclasses) imports peft whenever it is installed; hf_knorm imports it only in the
    conversion's LoRA recovery (the scan of the package's imports below checks that)."""
    loaded_by_us = [module for module in JOB_MODULES if module != "peft"]
    code = f"import json, sys, hf_knorm; print(json.dumps([m for m in {loaded_by_us} if m in sys.modules]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_each_optional_module_is_in_the_extra_that_require_names():
    extras = _project()["optional-dependencies"]
    for module, (extra, distribution) in OPTIONAL.items():
        assert distribution.lower() in _names(extras[extra]), f"{module}: {distribution} not in [{extra}]"
        assert distribution.lower() not in _names(_project()["dependencies"]), f"{distribution} is also core"


def test_every_module_the_package_imports_is_declared():
    """Each third-party import in hf_knorm/ (AST) is a core dependency or in an extra; peft's extra is ready for
    the LoRA job."""
    imported = set()
    for path in (ROOT / "hf_knorm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    imported -= set(sys.stdlib_module_names) | {"hf_knorm"}
    distributions = importlib.metadata.packages_distributions()
    project = _project()
    declared = _names(project["dependencies"]).union(*(_names(r) for r in project["optional-dependencies"].values()))
    for module in sorted(imported | set(OPTIONAL)):
        names = {re.sub(r"[-_.]+", "-", name).lower() for name in distributions.get(module, [module])}
        assert names & declared, f"hf_knorm imports {module} ({names}) but pyproject.toml does not declare it"
    assert "sklearn" in imported  # the scan sees imports inside functions (digits_vit)


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_a_missing_optional_module_names_its_extra(monkeypatch, module):
    extra, distribution = OPTIONAL[module]
    monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError
    with pytest.raises(MissingExtraError, match=re.escape(f"needs {distribution}, which is not installed: "
                                                          f"pip install 'hf_knorm[{extra}]'")):
        require(module, "The job")


def test_the_jobs_stop_with_the_extra_to_install(monkeypatch, tmp_path, capsys):
    from hf_knorm.cli import main
    from hf_knorm.data.digits_vit import digits_splits
    from hf_knorm.jobs.finetune import FinetuneSettings, check_settings

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    (tmp_path / "model").mkdir()
    assert main(["finetune", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-knorm finetune: error: hf-knorm finetune's TensorBoard logs") and "hf_knorm[train]" in error
    without_logs = FinetuneSettings(model=str(tmp_path / "model"), out=str(tmp_path / "run"), report_to=("none",))
    assert check_settings(without_logs) is None  # TensorBoard is needed only to log to it

    from hf_knorm.jobs.convert import check_settings as check_conversion
    from hf_knorm.conversion.settings import ConvertSettings

    assert main(["convert", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "conversion")]) == 2
    assert capsys.readouterr().err.startswith("hf-knorm convert: error: hf-knorm convert's TensorBoard logs")
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingExtraError, match=re.escape("hf-knorm convert with LoRA (--recovery lora) needs peft")):
        check_conversion(ConvertSettings(model=str(tmp_path / "model"), out=str(tmp_path / "c"), report_to=("none",),
                                         recovery="lora"))
    assert not (tmp_path / "conversion").exists() and not (tmp_path / "c").exists()  # nothing started

    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(MissingExtraError, match=re.escape("needs scikit-learn, which is not installed: "
                                                          "pip install 'hf_knorm[train]'")):
        digits_splits()

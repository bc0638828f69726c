"""The README's examples run as written: the normalization, balancing and eviction snippets on the real default model,
in order, in one namespace (as a reader would paste them); the training and conversion snippets, which need a dataset
and minutes of training, are compiled and the calls they make checked to exist with the arguments they pass. The
python blocks of docs/ are checked the same way."""

import ast
import inspect
import re
from pathlib import Path

import pytest

import hf_knorm

ROOT = Path(__file__).resolve().parents[1]


def _snippets() -> dict[str, str]:
    """``{section heading: its python snippet}`` of the README."""
    readme = (ROOT / "README.md").read_text()
    found = {}
    for section in re.split(r"^## ", readme, flags=re.M)[1:]:
        heading = section.splitlines()[0].strip()
        blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
        if blocks:
            found[heading] = "\n".join(blocks)
    return found


RUN = ["Attention normalizations", "K/V balancing", "KV-cache eviction by key norm"]
CHECKED = ["Norms while training", "Conversion, saving and the Hub"]


def test_every_python_snippet_is_covered_here():
    assert sorted(_snippets()) == sorted(RUN + CHECKED)


def test_the_runnable_snippets_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"long_prompt": "The quick brown fox jumps over the lazy dog. " * 40}
    for heading in RUN:
        exec(compile(_snippets()[heading], f"README.md ({heading})", "exec"), namespace)
    model = namespace["model"]
    assert model.config._attn_implementation != "hf_knorm"  # unpatched at the end, as it says
    assert model.config.hf_knorm["kv_balancing"]["mode"] == "layer"  # balanced, in its config
    assert (tmp_path / "kv_norms.png").stat().st_size > 0
    assert namespace["out"].shape[-1] > namespace["tokenizer"](namespace["long_prompt"], return_tensors="pt")[
        "input_ids"].shape[-1]


@pytest.mark.parametrize("heading", CHECKED)
def test_the_other_snippets_call_what_exists_with_arguments_it_takes(heading):
    tree = ast.parse(_snippets()[heading])
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "hf_knorm"]
    assert calls, heading
    for call in calls:
        function = getattr(hf_knorm, call.func.attr)  # AttributeError: the README calls a name that is not there
        target = function.__init__ if inspect.isclass(function) else function
        parameters = inspect.signature(target).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        for keyword in call.keywords:
            assert takes_any or keyword.arg in parameters, f"hf_knorm.{call.func.attr} takes no {keyword.arg}="


def test_the_helpers_that_left_the_top_level_still_work_for_one_release():
    import hf_knorm.balancing.balance as balance

    with pytest.warns(DeprecationWarning, match="moved to hf_knorm.balancing.balance.key_scales"):
        assert hf_knorm.key_scales is balance.key_scales
    with pytest.warns(DeprecationWarning, match="or hf_knorm.KNormCache with model.generate"):
        hf_knorm.knorm_generate
    assert "key_scales" not in hf_knorm.__all__ and "kernels" in hf_knorm.__all__
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hf_knorm.not_a_name


def _docs_snippets() -> list[tuple[str, str]]:
    """``(page, snippet)`` for every python block of the guides and results pages."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            found.append((str(page.relative_to(ROOT)), block))
    return found


def _resolve(node: ast.AST):
    """The object a dotted ``hf_knorm.a.b`` expression names, or ``None`` when it does not start at ``hf_knorm``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "hf_knorm"):
        return None
    target = hf_knorm
    for part in reversed(parts):
        target = getattr(target, part)  # AttributeError: the page names what is not there
    return target


@pytest.mark.parametrize("page, snippet", _docs_snippets(), ids=lambda value: value[:40] if "/" in value else "")
def test_the_docs_snippets_parse_and_call_what_exists(page, snippet):
    """Every python block of docs/ parses, and each ``hf_knorm...`` call in it names something that exists and takes
    the keyword arguments passed (the snippets themselves need minutes of training or a long context to run)."""
    import warnings

    import importlib

    tree = ast.parse(snippet, filename=page)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # a snippet must not use a deprecated name
        imported = {}  # from hf_knorm... import name: the object, checked to exist
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_knorm":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
        for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
            function = imported.get(call.func.id) if isinstance(call.func, ast.Name) else _resolve(call.func)
            if function is None or not callable(function):
                continue
            target = function.__init__ if inspect.isclass(function) else function
            try:
                parameters = inspect.signature(target).parameters
            except (TypeError, ValueError):
                continue
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
            for keyword in call.keywords:
                assert keyword.arg is None or takes_any or keyword.arg in parameters, \
                    f"{page}: {ast.unparse(call.func)} takes no {keyword.arg}="

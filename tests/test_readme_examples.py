"""Every python example of the README and of docs/ runs, as written, so that none can drift.

A page's blocks (the README's, or one page of docs/) run in order in one namespace, in a fresh folder, as a reader
would paste them, statement by statement. The real default model wherever a page loads it; what a page leaves to the
reader is given below (``GIVEN``: a ``prompt``, a dataset ``ds``, the ``args`` of a one-step run, and ``model`` on a
page that never loads one), small. Four substitutions, stated here and nowhere else:

- ``hf_knorm.balance_kv`` calibrates on at most 512 tokens (one batch) instead of its default 4,096 (eight), unless the
  caller says how many: the same computation and exactness check, an eighth of the time (a minute less per call here).
- ``hf_knorm.convert`` converts a tiny random Llama (2 layers, 128-token vocabulary, saved from a config) on a few lines
  of text, 2 transfer + 2 recovery steps, evaluated on one held-out text, no probe, nothing measured beyond the window,
  instead of SmolLM2-135M on the general mixture for about 30 minutes; what the caller passes (``normalization``,
  ``out``, ``recovery``) is kept. ``hf_knorm.from_pretrained`` then loads that converted model.
- The Hub is the loopback stand-in of tests/hub (``hub_standin.py``, the ``hub`` fixture): ``push_to_hub`` and
  ``from_pretrained("alice/...")`` talk to it; nothing leaves the machine.
- A run that a block plots beside its own without training it (``plot_norm_history(["runs/x3-16", "runs/softmax"],
  ...)``: ``runs/softmax``) is a copy of the run the block trained.

Not executed (``NOT_RUN``, each with its reason): the two blocks of docs/research/2026-12-knorm.md, records of how a
measurement was made, not examples to paste.
"""

import ast
import collections
import importlib
import inspect
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "hub"))
from hub_helpers import hub  # noqa: E402,F401 (fixture)

import hf_knorm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

NOT_RUN = {
    "docs/research/2026-12-knorm.md": "records of how the first head-budget measurement was made (an excerpt of an "
                                      "uncommitted script running a 10-minute needle grid, and the cache it timed), "
                                      "not examples",
}

# A text of about 400 tokens with a needle in it (the question of the pipeline examples asks for it).
TEXT = ("The quick brown fox jumps over the lazy dog. " * 20 + "The special magic number for Paris is 7319846. "
        + "The quick brown fox jumps over the lazy dog. " * 20)


def _training_args(out: str):
    """One optimizer step on one example, nothing saved or reported: the ``args`` a block trains with."""
    from transformers import TrainingArguments

    return TrainingArguments(out, max_steps=1, logging_steps=1, per_device_train_batch_size=1, report_to="none",
                             save_strategy="no", disable_tqdm=True, use_cpu=True)


def _token_rows(count: int, length: int, vocab: int) -> list[dict]:
    import torch

    rows = torch.randint(3, vocab, (count, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in rows]


def _tiny_llama(layers: int = 2):
    """A tiny random Llama (tests/tiny_models.py), with ``layers`` layers."""
    import transformers as tf
    from tiny_models import tiny_config

    config = tiny_config("llama")
    config.num_hidden_layers = layers
    return tf.LlamaForCausalLM(config)


def _default_model_patched(normalization: str):
    model, tokenizer = hf_knorm.load_default_model()
    hf_knorm.patch(model, normalization)
    return model, tokenizer


def _given_linear_attention() -> dict:
    model, tokenizer = _default_model_patched("x/1")
    return {"hf_knorm": hf_knorm, "model": model, "batch": tokenizer(TEXT, return_tensors="pt")}


GIVEN = {
    "README.md": lambda: {"long_prompt": TEXT, "args": _training_args("runs/relu"), "ds": _token_rows(1, 16, 49152)},
    "docs/usage.md": lambda: {"long_prompt": TEXT, "context": TEXT, "args": _training_args("runs/x3-16"),
                              "ds": _token_rows(1, 16, 49152)},
    "docs/knorm.md": lambda: {"prompt": TEXT, "context": TEXT},
    # 8 layers, 12 steps at the page's own TrainingArguments (3 epochs of 4 batches of 8): the page logs at step 10
    "docs/training.md": lambda: {"model": _tiny_llama(layers=8), "ds": _token_rows(32, 16, 128)},
    "docs/normalizations.md": lambda: {"model": _tiny_llama()},
    "docs/linear_attention.md": _given_linear_attention,
}


def _readme_sections() -> dict[str, str]:
    """``{section heading: its python blocks}`` of the README."""
    readme = (ROOT / "README.md").read_text()
    found = {}
    for section in re.split(r"^## ", readme, flags=re.M)[1:]:
        heading = section.splitlines()[0].strip()
        blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
        if blocks:
            found[heading] = "\n".join(blocks)
    return found


README_SECTIONS = ["Attention normalizations", "K/V balancing", "KV-cache eviction by key norm", "Norms while training",
                   "Conversion, saving and the Hub"]


def _docs_blocks() -> dict[str, list[str]]:
    """``{page: its python blocks}`` for every page of docs/ with any."""
    found = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        if blocks:
            found[str(page.relative_to(ROOT))] = blocks
    return found


def _copy_missing_runs(node: ast.stmt, namespace: dict) -> None:
    """Before a statement that plots norm histories: a named run folder that does not exist is a copy of the run the
    block trained (``args.output_dir``)."""
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        if not (isinstance(call.func, ast.Attribute) and call.func.attr == "plot_norm_history"):
            continue
        trained = Path(namespace["trainer"].args.output_dir)
        for run in ast.literal_eval(call.args[0]):
            if not Path(run).exists():
                shutil.copytree(trained, run)


def _run(source: str, filename: str, namespace: dict) -> None:
    """``source`` executed in ``namespace`` statement by statement (tracebacks name the page and its line)."""
    for node in ast.parse(source, filename=filename).body:
        _copy_missing_runs(node, namespace)
        exec(compile(ast.Module([node], type_ignores=[]), filename, "exec"), namespace)


@pytest.fixture
def small_calibration(monkeypatch):
    """``hf_knorm.balance_kv`` on at most 512 calibration tokens (the module docstring's first substitution)."""
    real = hf_knorm.balance_kv

    def balance_kv(*args, **kwargs):
        kwargs.setdefault("max_tokens", 512)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_knorm, "balance_kv", balance_kv)


@pytest.fixture
def tiny_convert(monkeypatch, tmp_path_factory):
    """``hf_knorm.convert`` on a tiny model and a few lines of text (the module docstring's second substitution)."""
    from training_helpers import save_tiny_lm

    from hf_knorm.assets.texts import SAMPLE_TEXT

    folder = tmp_path_factory.mktemp("convert_inputs")
    model_dir = save_tiny_lm(folder / "model")
    (folder / "train.txt").write_text((SAMPLE_TEXT + "\n") * 6)
    (folder / "heldout.txt").write_text(SAMPLE_TEXT[::-1] + "\n" + SAMPLE_TEXT + "\n")
    small = dict(model=str(model_dir), dataset=str(folder / "train.txt"), eval_dataset=str(folder / "heldout.txt"),
                 block_size=32, batch_size=2, eval_tokens=128, eval_steps=2, transfer_steps=2, recovery_steps=2,
                 logging_steps=2, save_steps=2, warmup_steps=0, report_to=("none",), eval_domains=("none",),
                 probe=False, beyond_window=False)
    real = hf_knorm.convert

    def convert(settings=None, **fields):
        return real(settings, **{**small, **fields})

    monkeypatch.setattr(hf_knorm, "convert", convert)


def test_every_readme_and_docs_block_is_run_or_listed_with_a_reason():
    assert sorted(_readme_sections()) == sorted(README_SECTIONS)
    assert set(NOT_RUN) <= set(_docs_blocks())


def test_the_readme_examples_run_as_written(tmp_path, monkeypatch, hub, small_calibration, tiny_convert):
    monkeypatch.chdir(tmp_path)
    namespace = GIVEN["README.md"]()
    sections = _readme_sections()
    for heading in README_SECTIONS[:3]:
        _run(sections[heading], f"README.md ({heading})", namespace)
    model = namespace["model"]
    assert model.config._attn_implementation != "hf_knorm"  # unpatched at the end, as it says
    assert model.config.hf_knorm["kv_balancing"]["mode"] == "layer"  # balanced, in its config
    assert (tmp_path / "kv_norms.png").stat().st_size > 0
    assert namespace["out"].shape[-1] > namespace["tokenizer"](namespace["long_prompt"], return_tensors="pt")[
        "input_ids"].shape[-1]
    for heading in README_SECTIONS[3:]:
        _run(sections[heading], f"README.md ({heading})", namespace)
    assert (tmp_path / "norms.png").stat().st_size > 0
    assert hf_knorm.patched_normalization(namespace["model"]) is not None  # the converted model, reloaded
    assert "me/smollm2-sparse" in hub.repos


@pytest.mark.parametrize("page", [page for page in _docs_blocks() if page not in NOT_RUN])
def test_the_docs_examples_run_as_written(page, tmp_path, monkeypatch, hub, small_calibration, tiny_convert):
    monkeypatch.chdir(tmp_path)
    namespace = GIVEN.get(page, dict)()
    for number, block in enumerate(_docs_blocks()[page], 1):
        _run(block, f"{page} (python block {number})", namespace)
    if page == "docs/linear_attention.md":
        assert namespace["paths"] == collections.Counter({"linear": 30})  # what the page prints
    if page == "docs/usage.md":
        assert "alice/smollm2-x3-16" in hub.repos


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


@pytest.mark.parametrize("page, snippet", [(page, block) for page, blocks in _docs_blocks().items() for block in blocks]
                         + [("README.md", source) for source in _readme_sections().values()],
                         ids=lambda value: value[:40] if value.endswith(".md") else "")
def test_the_examples_use_no_deprecated_name(page, snippet):
    """Every python block (those not run too) names only what exists, with keyword arguments it takes, and no name
    that is deprecated (a run block would only warn)."""
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

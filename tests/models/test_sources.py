"""The one loader (:mod:`hf_knorm.models.sources`): ``"default"``, a checkpoint folder, or a Hub id found in the local
Hub cache, for ``hf_knorm.from_pretrained`` and every command's ``--model``; anything else is one error naming the three
forms. The commands never download.

``"default"`` is the embedded SmolLM2-135M-Instruct; here ``default_model_dir`` is pointed at a saved tiny model, so
that every form loads in well under a second: what is tested is which folder each name reaches and that the model
loaded from it is that one (the real default's own loading is tested in tests/assets/). The Hub cache is a folder
of ``tmp_path`` laid out as ``hf download`` writes it, with huggingface_hub offline.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from tiny_models import tiny_config, tiny_inputs
from training_helpers import char_tokenizer, lm, save_tiny_lm

import hf_knorm
from hf_knorm.assets import default_model
from hf_knorm.cli import main
from hf_knorm.models.persistence import load_model
from hf_knorm.models.sources import FORMS, ModelNotFoundError, model_folder, model_source
from hf_knorm.runs.sources import causal_lm_source

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hub"))
from hub_helpers import hub  # noqa: E402,F401 (fixture)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "someone/tiny-llama"
LAYERS = tiny_config("llama").num_hidden_layers
ONE_ERROR = r"is not 'default', not a folder .*A model is named by one of three forms: " + re.escape(FORMS)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty local Hub cache (``HF_HUB_CACHE``), huggingface_hub offline, and a function that puts a model in it as
    ``hf download`` lays it out (``models--org--name/snapshots/<commit>/``, ``refs/main``): ``cached(repo_id, save)``
    returns the snapshot folder ``save(folder)`` wrote."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def cached(repo_id: str, save=save_tiny_lm) -> Path:
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        save(repo / "snapshots" / COMMIT)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
        return repo / "snapshots" / COMMIT

    return cached


@pytest.fixture
def named(tmp_path, monkeypatch, hub_cache):
    """``name(form, save)``: the name by which ``form`` (``default``, ``folder`` or ``hub``) reaches the model that
    ``save(folder)`` writes, and that folder."""

    def name(form: str, save=save_tiny_lm) -> tuple[str, Path]:
        if form == "default":
            folder = save(tmp_path / "embedded-default")
            monkeypatch.setattr(default_model, "default_model_dir", lambda: folder)
            return "default", folder
        if form == "folder":
            folder = save(tmp_path / "checkpoint")
            return str(folder), folder
        return REPO, hub_cache(REPO, save)

    return name


@pytest.mark.parametrize("form", ["default", "folder", "hub"])
def test_each_form_reaches_its_folder(named, form):
    name, folder = named(form)
    assert model_folder(name) == folder
    assert model_source(name, download=True) == folder  # offline, the library finds the same folder
    found, config = causal_lm_source(name, block_size=32)  # the training jobs' argument path
    assert found == folder and config.model_type == "llama"


def _patched_with_learned_values():
    """A tiny llama patched with a learnable family, its learned bias moved off its initial value (eval mode)."""
    model = lm("sigmoid(bias=learned)").eval()
    with torch.no_grad():
        for parameter_name, value in model.named_parameters():
            if "hf_knorm_" in parameter_name:
                value.add_(0.75)
    return model


@pytest.mark.parametrize("form", ["default", "folder", "hub"])
def test_a_patched_model_loads_back_with_its_normalization_whichever_form_names_it(named, form):
    original = _patched_with_learned_values()
    name, _ = named(form, lambda folder: hf_knorm.save_pretrained(original, folder, tokenizer=char_tokenizer()))
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        expected = original(**inputs).logits
    learned = {key: value for key, value in original.state_dict().items() if "hf_knorm_" in key}
    assert learned
    for model in (hf_knorm.from_pretrained(name).eval(), load_model(name)[0]):
        assert hf_knorm.patched_normalization(model) == hf_knorm.patched_normalization(original)
        assert all(torch.equal(model.state_dict()[key], value) for key, value in learned.items())
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, expected)


@pytest.mark.parametrize("form", ["default", "folder", "hub"])
def test_kv_norms_takes_each_form(named, tmp_path, form):
    name, _ = named(form)
    out = tmp_path / "kv"
    assert main(["kv-norms", "--model", name, "--calibration-tokens", "64", "--out", str(out)]) == 0
    report = json.loads((out / "kv_norms_layer.json").read_text())
    assert len(report["layers"]) == LAYERS  # the tiny model's layers: the model that name reaches was balanced


@pytest.mark.parametrize("form", ["default", "folder", "hub"])
def test_finetune_takes_each_form(named, tmp_path, form):
    name, _ = named(form)
    data = tmp_path / "text.txt"
    data.write_text("the lighthouse keeper counts the ships at night\n" * 40)
    out = tmp_path / "run"
    assert main(["finetune", "--model", name, "--dataset", str(data), "--out", str(out), "--normalization", "softmax",
                 "--max-steps", "1", "--block-size", "32", "--eval-tokens", "64", "--report-to", "none"]) == 0
    assert json.loads((out / "finetune.json").read_text())["global_step"] == 1
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == LAYERS


BAD_NAMES = ["someone/not-downloaded", "missing_folder", "/no/such/folder"]
"""A Hub id not in the cache, a name that is a Hub id or a folder and neither, a path that is no folder."""


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_name_of_no_form_is_one_error_naming_the_three_forms(hub_cache, name):
    for load in (model_folder, hf_knorm.from_pretrained, load_model):
        with pytest.raises(ModelNotFoundError, match=rf"^'{name}' {ONE_ERROR}"):
            load(name)
    with pytest.raises(FileNotFoundError):  # what callers caught before the one error
        model_folder(name)


def test_the_error_says_where_it_looked_and_how_to_fix_it(hub_cache, tmp_path):
    with pytest.raises(ModelNotFoundError) as missing:
        model_folder("acme/smol")
    message = str(missing.value)
    assert f"nothing at {Path('acme/smol').absolute()}" in message
    assert f"not in the local Hub cache (HF_HUB_CACHE={tmp_path / 'hub'})" in message
    assert "download it once with `hf download acme/smol` on a machine with network, or pass a checkpoint folder" \
        in message
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set, so nothing is downloaded"):
        hf_knorm.from_pretrained("acme/smol")  # the library would fetch it, but not offline
    with pytest.raises(ModelNotFoundError, match=r"not a Hub id \(org/name\) either: pass a checkpoint folder that"):
        model_folder("/no/such/folder")
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ModelNotFoundError, match=r"is a file\)"):
        model_folder(tmp_path / "weights.bin")


@pytest.mark.parametrize("command", ["kv-norms", "niah", "finetune", "convert", "demo"])
def test_every_command_refuses_a_name_of_no_form_with_the_one_error(hub_cache, tmp_path, capsys, command):
    assert main([command, "--model", "someone/not-downloaded", "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hf-knorm {command}: error: 'someone/not-downloaded' is not 'default', not a folder")
    assert FORMS in error and error.count("\n") == 1


def test_the_library_fetches_a_hub_id_into_the_local_hub_cache_and_names_the_three_forms_when_it_cannot(hub, tmp_path):
    original = _patched_with_learned_values()
    hf_knorm.push_to_hub(original, "user/tiny-sigmoid", tokenizer=char_tokenizer())
    with pytest.raises(ModelNotFoundError):
        model_folder("user/tiny-sigmoid")  # pushed, not downloaded: the jobs would not fetch it
    assert model_source("user/tiny-sigmoid", download=True) == "user/tiny-sigmoid"  # for Transformers to fetch
    loaded = hf_knorm.from_pretrained("user/tiny-sigmoid").eval()
    assert hf_knorm.patched_normalization(loaded) == hf_knorm.patched_normalization(original)
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, original(**inputs).logits)
    assert model_folder("user/tiny-sigmoid").is_relative_to(tmp_path / "hf_cache")  # now it is in the local cache
    with pytest.raises(ModelNotFoundError, match=rf"^'user/never-pushed' {ONE_ERROR}") as missing:
        hf_knorm.from_pretrained("user/never-pushed")
    assert "and fetching it from the Hub failed" in str(missing.value)


@pytest.mark.slow
def test_default_is_the_embedded_model(default_model_and_tokenizer):
    embedded, _ = default_model_and_tokenizer
    assert model_folder("default") == default_model.default_model_dir()
    for model in (hf_knorm.from_pretrained("default"), load_model("default")[0]):
        assert type(model) is type(embedded) and hf_knorm.patched_normalization(model) is None
        assert all(torch.equal(value, embedded.state_dict()[key]) for key, value in model.state_dict().items())

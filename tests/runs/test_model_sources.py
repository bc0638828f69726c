"""A job's ``--model``: 'default', a checkpoint folder, or a Hub id found in the local Hub cache (never downloaded)."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
from training_helpers import save_tiny_lm

from hf_knorm.cli import main
from hf_knorm.runs.sources import causal_lm_source, model_folder

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty local Hub cache (``HF_HUB_CACHE``) and, offline, a function that puts a model in it as
    ``hf download`` lays it out: ``models--org--name/snapshots/<commit>/`` and ``refs/main``."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def cached(repo_id: str):
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        save_tiny_lm(repo / "snapshots" / COMMIT)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
        return repo / "snapshots" / COMMIT

    return cached


def test_a_hub_id_in_the_local_cache_is_its_snapshot_folder(hub_cache):
    snapshot = hub_cache("someone/tiny-llama")
    assert model_folder("someone/tiny-llama") == snapshot
    folder, config = causal_lm_source("someone/tiny-llama", block_size=32)
    assert folder == snapshot and config.model_type == "llama"


@pytest.mark.parametrize("model", ["someone/not-downloaded", "missing_folder", "/no/such/folder"])
def test_neither_a_folder_nor_a_cached_hub_id_names_both_forms(hub_cache, model):
    with pytest.raises(FileNotFoundError, match="No model folder at .*and no Hub model .*in the local Hub cache"):
        model_folder(model)


def test_finetune_takes_a_hub_id_from_the_local_cache(hub_cache, tmp_path):
    hub_cache("someone/tiny-llama")
    data = tmp_path / "text.txt"
    data.write_text("the lighthouse keeper counts the ships at night\n" * 40)
    out = tmp_path / "run"
    assert main(["finetune", "--model", "someone/tiny-llama", "--dataset", str(data), "--out", str(out),
                 "--normalization", "softmax", "--max-steps", "1", "--block-size", "32", "--eval-tokens", "64",
                 "--report-to", "none"]) == 0
    assert json.loads((out / "finetune.json").read_text())["global_step"] == 1

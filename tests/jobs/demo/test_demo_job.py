"""The main job (`make demo`), end to end through the CLI with `--fast`, on the real default model."""

import json
import math

import pytest
from card_values import expected_normalization, stated_held_out, stated_normalization, two_decimals

import hf_knorm
from hf_knorm.cli import main

pytestmark = pytest.mark.slow


def test_every_step_ran_and_recorded_its_results(fast_demo):
    record = json.loads((fast_demo / "demo.json").read_text())
    assert list(record["steps"]) == ["normalizations", "balancing", "knorm", "conversion", "sharing"]
    assert len(record["timings_s"]) == 5 and record["total_s"] > 0

    native, softmax, cubic = record["steps"]["normalizations"]["normalizations"]
    assert [native["normalization"], softmax["normalization"], cubic["normalization"]] == \
        ["native (sdpa)", "softmax", "x^3/16"]
    assert math.isclose(softmax["perplexity"], native["perplexity"], rel_tol=1e-4)
    assert softmax["continuations"] == native["continuations"]
    assert native["continuations"][0].startswith(" Paris")
    decoding = {(row["normalization"], row["context"]): row for row in record["steps"]["normalizations"]["decoding"]}
    assert set(decoding) == {(name, length) for name in ("softmax", "x/1") for length in (32, 128)}
    assert decoding[("x/1", 32)]["cache_bytes"] == decoding[("x/1", 128)]["cache_bytes"]
    assert decoding[("softmax", 128)]["cache_bytes"] == 4 * decoding[("softmax", 32)]["cache_bytes"]
    assert (fast_demo / "normalizations" / "decoding.png").exists()

    balancing = record["steps"]["balancing"]
    assert balancing["max_logit_change"] <= balancing["tolerance"]
    assert all(abs(layer["after"]["ratio"] - 1) < 1e-3 for layer in balancing["layers"])

    assert all(f"| {row} |" in record["steps"]["knorm"] for row in ("r=0", "r=0.5", "r=0.5 kv_diff"))
    assert (fast_demo / "knorm" / "heatmap_niah_r=0.5_kv_diff.png").exists()

    conversion = record["steps"]["conversion"]
    # convert's window, shrunk with the blocks, and its default sinks and sparse cache
    assert conversion["normalization"] == \
        "x/1 + softmax window 16 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters 8"  # the fast demo's clusters
    assert len(conversion["stages"]["transfer"]["window_mix"]) == 30  # solved for every layer, saved
    transfer, recovery = conversion["stages"]["transfer"], conversion["stages"]["recovery"]
    assert transfer["steps"] == 4 and recovery["steps"] == 4 and recovery["mode"] == "lora"
    assert [point[0] for point in recovery["curve"]] == [0, 2, 4]  # held-out perplexity at 0 and every 2 steps
    evaluation = conversion["evaluation"]
    assert evaluation["tokens"] == 128 and list(evaluation["domains"]) == ["essays", "plays", "technical", "conversation"]
    assert evaluation["ratio_to_original"] == max(r["ratio_to_original"] for r in evaluation["domains"].values())
    assert conversion["training_data"]["parts"]["teacher_samples"]["texts"] >= 1  # the general mixture
    patched_only = float(record["steps"]["normalizations"]["normalizations"][2]["perplexity"])
    assert patched_only > 1e3  # what patching alone with the pure normalization does to the model
    answers = conversion["answers"]
    assert [a["normalization"] for a in answers] == [
        "native (sdpa)", "x/1 + softmax window 16 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters 8, patched only",
        "x/1 + softmax window 16 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters 8, converted"]
    for stage in ("transfer", "recovery"):
        history = (fast_demo / "conversion" / stage / "norms.jsonl").read_text().splitlines()
        assert len(history) == 2  # logging every 2 of 4 steps
        assert list((fast_demo / "conversion" / stage / "runs").rglob("events.out.tfevents.*"))

    sharing = record["steps"]["sharing"]
    assert sharing["same_logits_after_reload"] is True and sharing["commit_url"] is None
    assert {"config.json", "README.md", "model.safetensors", "tokenizer.json"} <= set(sharing["files"])


def test_the_saved_model_loads_back_with_its_normalization_and_card(fast_demo):
    folder = fast_demo / "model"
    model = hf_knorm.from_pretrained(folder)
    spelling = "x/1 + softmax window 16 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters 8"
    assert hf_knorm.patched_normalization(model) == spelling
    card = (folder / "README.md").read_text()
    assert "pip install hf_knorm" in card.split("---", 2)[2][:2000]
    assert stated_normalization(card) == expected_normalization(spelling)
    evaluation = json.loads((fast_demo / "demo.json").read_text())["steps"]["conversion"]["evaluation"]
    stated = stated_held_out(card)  # the card's perplexities are the run's
    assert stated["worst_domain"] == max(evaluation["domains"],
                                         key=lambda name: evaluation["domains"][name]["ratio_to_original"])
    assert stated["worst_ratio"] == two_decimals(evaluation["ratio_to_original"])
    assert stated["domains"] == {name: tuple(two_decimals(domain[key]) for key in
                                             ("original_perplexity", "perplexity", "ratio_to_original"))
                                 for name, domain in evaluation["domains"].items()}
    assert "model-index" in card


def test_the_report_has_every_section_and_embeds_its_images(fast_demo):
    page = (fast_demo / "report.html").read_text()
    for title in ("Attention normalizations side by side", "K/V balancing", "KNorm KV-cache compression",
                  "Converting the model to a new normalization", "Saving the model with its card"):
        assert title in page
    assert page.count('<p class="look">') == 5
    assert page.count('src="data:image/png;base64,') >= 6
    assert 'src="http' not in page and '<link rel="stylesheet"' not in page  # self-contained: nothing to fetch


@pytest.mark.parametrize("flags, message", [
    (["--normalizations", "x^0/1"], "power p must be an integer >= 1"),
    (["--train-normalization", "x^0/1"], "power p must be an integer >= 1"),
    (["--softmax-window", "0", "--sparse-cache", "8"], "sparse_cache=8 without a softmax window"),
])
def test_demo_reports_a_bad_normalization_before_loading_the_model(tmp_path, capsys, flags, message):
    assert main(["demo", "--fast", *flags, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("flags, message", [
    (["--niah-score", "attention"], "Unknown score 'attention'; accepted: key_norm, value_over_key"),
    (["--niah-score", "key_norm"], "choose another score"),
    (["--niah-ratio", "0"], "niah_ratio must be in (0, 1)"),
])
def test_demo_reports_bad_needle_settings_before_any_work(tmp_path, capsys, flags, message):
    assert main(["demo", "--fast", *flags, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_demo_refuses_a_push_without_a_token_before_any_work(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token_file"))  # no saved login either
    assert main(["demo", "--fast", "--push-to", "alice/demo", "--out", str(tmp_path / "out")]) == 2
    assert "No Hugging Face token" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_demo_refuses_an_invalid_repo_id(tmp_path, capsys):
    assert main(["demo", "--fast", "--push-to", "not a repo", "--token", "x", "--out", str(tmp_path)]) == 2
    assert "Invalid repo id" in capsys.readouterr().err

"""The model card hf_knorm.save_pretrained writes: metadata, first lines, measurements, and the user's text kept."""

import json
import re

import pytest
import transformers as tf
from huggingface_hub import ModelCard
from card_values import (expected_normalization, load_as_the_card_says, loading_snippet, stated_changes,
                         stated_normalization)
from hub_helpers import tiny_tokenizer
from tiny_models import tiny_inputs, tiny_model

import hf_knorm
from hf_knorm.eviction.defaults import set_knorm_defaults
from hf_knorm.hub.card import BEGIN, END

REPO = "alice/tiny-llama"


def _card(folder) -> ModelCard:
    return ModelCard((folder / "README.md").read_text())


def _first_lines(card: ModelCard, n: int = 8) -> str:
    """The first ``n`` non-empty lines of the card's body (after the front matter and the block's opening marker)."""
    body = card.text.split(BEGIN, 1)[1]
    return "\n".join([line for line in body.splitlines() if line.strip()][:n])


def _balanced(model_type="llama"):
    model = tiny_model(model_type)
    calibration = [tiny_inputs(model_type, batch=2, length=24, seed=seed) for seed in range(2)]
    report = hf_knorm.balance_kv(model, None, calibration, mode="layer", progress=False)
    return model, report


def test_patched_model_card_says_how_to_install_and_load(tmp_path):
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    hf_knorm.save_pretrained(model, tmp_path, tokenizer=tiny_tokenizer(), repo_id=REPO)
    card = _card(tmp_path)
    assert card.data.library_name == "hf_knorm"
    assert card.data.tags == ["hf-knorm", "normalization-x3-16"]
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.base_model is None  # built from a config: no Hub origin to name
    first = _first_lines(card)
    assert "pip install hf_knorm==" + hf_knorm.__version__ in first
    assert f'hf_knorm.from_pretrained("{REPO}")' in first
    assert hf_knorm.patched_normalization(load_as_the_card_says(card.text, REPO, tmp_path)) == "x^3/16"
    assert stated_normalization(card.text) == expected_normalization("x^3/16")
    assert stated_changes(card.text) == {"normalization": "x^3/16", "balancing": None, "knorm": None}
    assert "no tokenizer" not in card.text
    assert f"- transformers {tf.__version__}" in card.text and f"- hf_knorm {hf_knorm.__version__}" in card.text
    assert "## Measurements" not in card.text  # none were given


def test_balanced_unpatched_model_card_loads_with_plain_transformers_and_shows_the_ratios(tmp_path):
    model, report = _balanced()
    hf_knorm.save_pretrained(model, tmp_path, tokenizer=tiny_tokenizer(), repo_id=REPO, balance_report=report)
    card = _card(tmp_path)
    assert card.data.library_name == "transformers"
    assert card.data.tags == ["hf-knorm", "kv-balancing"]
    assert "hf_knorm" not in loading_snippet(card.text)  # loads with plain Transformers, as the card says
    loaded = load_as_the_card_says(card.text, REPO, tmp_path)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config._attn_implementation != "hf_knorm"
    mode = json.loads((tmp_path / "config.json").read_text())["hf_knorm"]["kv_balancing"]["mode"]
    assert stated_changes(card.text) == {"normalization": None, "balancing": mode, "knorm": None} and mode == "layer"
    before, after = report.before.ratios(), report.after.ratios()
    for layer in range(len(before)):
        assert f"| {layer} | {before[layer]:.3f} | {after[layer]:.3f} |" in card.text
    assert abs(after[0] - 1) < 1e-3 < abs(before[0] - 1)  # the table shows a real change
    figure = f"figures/kv_norms_layer{report.default_layer()}_layer.png"
    assert f"]({figure})" in card.text and (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"
    inputs = json.loads((tmp_path / "hf_knorm_card.json").read_text())
    assert [row["after"] for row in inputs["kv_balance"]["layers"]] == pytest.approx(after.tolist())


def test_balanced_and_patched_model_card_has_both(tmp_path):
    model, report = _balanced()
    hf_knorm.patch(model, "x^3/sqrtN")
    hf_knorm.save_pretrained(model, tmp_path, tokenizer=tiny_tokenizer(), repo_id=REPO, balance_report=report)
    card = _card(tmp_path)
    assert card.data.library_name == "hf_knorm"
    assert card.data.tags == ["hf-knorm", "normalization-x3-sqrtn", "kv-balancing"]
    assert stated_changes(card.text) == {"normalization": "x^3/sqrtN", "balancing": "layer", "knorm": None}
    assert "sqrt(N_i)" in card.text  # the divisor the spelling means


def test_plain_model_card_says_unmodified(tmp_path):
    hf_knorm.save_pretrained(tiny_model("llama"), tmp_path, tokenizer=tiny_tokenizer(), repo_id=REPO)
    card = _card(tmp_path)
    assert card.data.library_name == "transformers"
    assert card.data.tags == ["hf-knorm"]
    assert stated_changes(card.text) == {"normalization": None, "balancing": None, "knorm": None}
    assert "hf_knorm" not in loading_snippet(card.text)
    loaded = load_as_the_card_says(card.text, REPO, tmp_path)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config._attn_implementation != "hf_knorm"
    config = json.loads((tmp_path / "config.json").read_text())
    assert "hf_knorm" not in config and "attn_implementation" not in config


def test_card_without_tokenizer_says_so(tmp_path):
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x/16"), tmp_path)
    assert "This repo has no tokenizer" in _card(tmp_path).text
    assert f'from_pretrained("{tmp_path}")' in _card(tmp_path).text  # a local save names its folder


def test_encoder_card_uses_automodel(tmp_path):
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("bert"), "x^3/16"), tmp_path, repo_id=REPO)
    card = _card(tmp_path)
    assert card.data.pipeline_tag is None
    assert set(re.findall(r"`(Auto\w+)\.from_pretrained`", card.text)) == {"AutoModel"}  # not a causal LM class


def test_base_model_only_as_a_hub_id(tmp_path):
    model = tiny_model("llama")
    hf_knorm.save_pretrained(model, tmp_path / "a", base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert _card(tmp_path / "a").data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="base_model must be a Hub repo id"):
        hf_knorm.save_pretrained(model, tmp_path / "b", base_model=str(tmp_path / "a"))
    assert not (tmp_path / "b").exists()  # refused before anything was written
    model.config._name_or_path = "org/loaded-from-the-hub"  # what from_pretrained("org/...") records
    hf_knorm.save_pretrained(model, tmp_path / "c")
    assert _card(tmp_path / "c").data.base_model == "org/loaded-from-the-hub"


def test_origin_follows_a_save_load_save_chain(tmp_path):
    hf_knorm.save_pretrained(tiny_model("llama"), tmp_path / "a", base_model="org/origin")
    loaded = hf_knorm.from_pretrained(tmp_path / "a")  # name_or_path is now the folder
    hf_knorm.save_pretrained(hf_knorm.patch(loaded, "x/16"), tmp_path / "b")
    assert _card(tmp_path / "b").data.base_model == "org/origin"
    unknown = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    (tmp_path / "a" / "hf_knorm_card.json").unlink()  # a folder hf_knorm did not save
    hf_knorm.save_pretrained(unknown, tmp_path / "c")
    card = _card(tmp_path / "c")
    assert card.data.base_model is None and "origin was not recorded" in card.text
    assert str(tmp_path) not in card.text.split("from_pretrained")[0]  # no local path as the origin


def test_the_embedded_default_model_is_the_base_model_and_its_gguf_origin_is_said(tmp_path, monkeypatch):
    from hf_knorm.assets.default_model import DEFAULT_MODEL_HUB_ID, WHEEL_NAME, default_model_path

    monkeypatch.setenv("HF_KNORM_CACHE", str(tmp_path / "cache"))
    tiny_model("llama").save_pretrained(default_model_path())  # stands in for the converted GGUF checkpoint
    default = tf.AutoModelForCausalLM.from_pretrained(default_model_path())
    hf_knorm.save_pretrained(hf_knorm.patch(default, "x^3/16"), tmp_path / "out", repo_id=REPO)
    card = _card(tmp_path / "out")
    assert card.data.base_model == DEFAULT_MODEL_HUB_ID
    assert f"`{WHEEL_NAME}==" in card.text and "dequantized" in card.text


def test_a_training_job_folder_names_the_model_the_job_started_from(tmp_path):
    hf_knorm.save_pretrained(tiny_model("llama"), tmp_path / "start", base_model="org/origin")
    run = tmp_path / "run"
    hf_knorm.save_pretrained(hf_knorm.from_pretrained(tmp_path / "start"), run)
    (run / "hf_knorm_card.json").unlink()  # as a job's Trainer-side save leaves it
    (run / "finetune.json").write_text(json.dumps({"model_dir": str(tmp_path / "start")}))
    hf_knorm.save_pretrained(hf_knorm.from_pretrained(run), tmp_path / "pushed")
    assert _card(tmp_path / "pushed").data.base_model == "org/origin"


def test_the_card_carries_the_held_out_perplexity_in_text_and_model_index(tmp_path):
    evaluation = {"text": "Paul Graham essays 40-48 (not trained on)", "tokens": 8192, "block_size": 256,
                  "perplexity": 51.25, "original_perplexity": 33.9, "stages": {"recovery": [[0, 0, 90.0]]}}
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    hf_knorm.save_pretrained(model, tmp_path, base_model="org/origin", evaluation=evaluation)
    card = _card(tmp_path)
    results = {result.metric_name: result.metric_value for result in card.data.eval_results}
    assert sorted(results.values()) == [33.9, 51.25]
    assert "Paul Graham essays 40-48" in card.text and "| 51.25 |" in card.text and "| 33.90 |" in card.text
    assert "model-index" in (tmp_path / "README.md").read_text()
    hf_knorm.save_pretrained(model, tmp_path)  # a save without the measurement: the card no longer claims it
    assert _card(tmp_path).data.eval_results is None
    with pytest.raises(ValueError, match="lacks perplexity"):
        hf_knorm.save_pretrained(model, tmp_path / "bad", evaluation={"text": "t", "tokens": 1, "block_size": 1,
                                                                      "original_perplexity": 3.0})


def test_regenerating_keeps_the_users_text_and_metadata(tmp_path):
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    hf_knorm.save_pretrained(model, tmp_path, tokenizer=tiny_tokenizer(), repo_id=REPO)
    card = _card(tmp_path)
    card.data.license = "apache-2.0"
    card.data.tags = card.data.tags + ["my-experiment"]
    card.text = "Intro written by the user.\n\n" + card.text + "\n## My notes\n\nTrained on my data.\n"
    card.save(tmp_path / "README.md")

    hf_knorm.unpatch(model)
    hf_knorm.save_pretrained(hf_knorm.patch(model, "x/16"), tmp_path, tokenizer=tiny_tokenizer(), repo_id=REPO)
    again = _card(tmp_path)
    assert again.data.license == "apache-2.0"
    assert again.data.tags == ["hf-knorm", "normalization-x-16", "my-experiment"]  # the stale x3-16 tag is gone
    assert again.text.index("Intro written by the user.") < again.text.index(BEGIN)
    assert again.text.index(END) < again.text.index("## My notes\n\nTrained on my data.")
    assert "**`x/16`**" in again.text and "x^3/16" not in again.text
    assert again.text.count(BEGIN) == 1


def test_a_card_without_markers_is_kept_below_the_generated_block(tmp_path):
    (tmp_path).mkdir(exist_ok=True)
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# My model\n\nHand-written description.\n")
    hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x^3/16"), tmp_path, repo_id=REPO)
    card = _card(tmp_path)
    assert card.data.license == "mit"
    assert card.text.index(END) < card.text.index("# My model\n\nHand-written description.")


def test_measurements_niah_table_and_training_figure(tmp_path):
    records = [dict(task="niah", variant=variant, ratio=ratio, length=length, depth=0.5, seed=0, expected="x",
                    answer="x" if ok else "y", correct=ok)
               for variant, ratio, ok in (("r=0", 0.0, True), ("r=0.5", 0.5, False)) for length in (1000, 2000)]
    (tmp_path / "niah").mkdir()
    (tmp_path / "niah" / "results.json").write_text(json.dumps(records))
    figure = tmp_path / "norms.png"
    figure.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    hf_knorm.save_pretrained(model, tmp_path / "out", repo_id=REPO, niah=tmp_path / "niah", norm_history=figure)
    text = _card(tmp_path / "out").text
    assert "### Needle in a haystack" in text
    assert "| r=0 | 100 | 100 | 100.0 | 1 |" in text and "| r=0.5 | 0 | 0 | 0.0 | 1 |" in text
    assert "](figures/norm_history.png)" in text
    assert (tmp_path / "out" / "figures" / "norm_history.png").read_bytes() == figure.read_bytes()

    hf_knorm.save_pretrained(model, tmp_path / "out", repo_id=REPO)  # new save, no measurements: none shown
    assert "## Measurements" not in _card(tmp_path / "out").text
    assert not (tmp_path / "out" / "figures" / "norm_history.png").exists()


def test_bad_measurement_inputs_are_refused_before_writing(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(FileNotFoundError, match="No needle-in-a-haystack results"):
        hf_knorm.save_pretrained(model, tmp_path / "a", niah=tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="No norm-history figure"):
        hf_knorm.save_pretrained(model, tmp_path / "a", norm_history=tmp_path / "missing.png")
    with pytest.raises(TypeError, match="BalanceReport"):
        hf_knorm.save_pretrained(model, tmp_path / "a", balance_report={"mode": "layer"})
    assert not (tmp_path / "a").exists()


def test_a_plain_model_with_knorm_defaults_is_not_called_unmodified(tmp_path):
    model = tiny_model("llama")
    set_knorm_defaults(model, compression_ratio=0.5)
    hf_knorm.save_pretrained(model, tmp_path, tokenizer=tiny_tokenizer(), repo_id=REPO)
    card = _card(tmp_path)
    assert card.data.library_name == "transformers"
    recorded = json.loads((tmp_path / "config.json").read_text())["hf_knorm"]["knorm"]
    assert stated_changes(card.text) == {"normalization": None, "balancing": None,
                                         "knorm": {key: str(value) for key, value in recorded.items()}}
    assert recorded == {"compression_ratio": 0.5}
    assert "Unmodified" not in card.text  # it does not claim that nothing changed
    assert "hf_knorm" not in loading_snippet(card.text)
    assert load_as_the_card_says(card.text, REPO, tmp_path).config.hf_knorm["knorm"] == recorded

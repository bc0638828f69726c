"""push_to_hub / push_folder at the HTTP boundary: what reaches a loopback stand-in for the Hub, and what does not."""

import json
import warnings

import pytest
import transformers as tf
from huggingface_hub import ModelCard
from card_values import loading_snippet, stated_changes
from hub_helpers import hub, tiny_tokenizer  # noqa: F401 (fixture)
from hub_standin import Repo
from tiny_models import tiny_model

import hf_knorm
from hf_knorm.hub import push_folder
from hf_knorm.hub.card import BEGIN, END

REPO = "user/tiny-x3"


def _patched(normalization="x^3/16"):
    return hf_knorm.patch(tiny_model("llama"), normalization)


def _config(hub, repo=REPO) -> dict:
    return json.loads(hub.repos[repo].files["config.json"])


def _card(hub, repo=REPO) -> ModelCard:
    return ModelCard(hub.repos[repo].files["README.md"].decode())


def test_push_sends_weights_config_tokenizer_and_card_in_one_commit(hub, tmp_path):
    model = _patched()
    commit = hf_knorm.push_to_hub(model, REPO, tokenizer=tiny_tokenizer(), private=True)
    assert commit.oid == hub.repos[REPO].head
    assert len(hub.commits) == 1
    assert hub.commits[0]["summary"] == f"Upload x^3/16 model with hf_knorm {hf_knorm.__version__}"
    repo = hub.repos[REPO]
    assert repo.private
    assert set(repo.files) == {"README.md", "config.json", "generation_config.json", "hf_knorm_card.json",
                               "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert repo.lfs == {"model.safetensors"}  # the weights went through the LFS upload, the rest inline
    config = _config(hub)
    assert config["attn_implementation"] == "hf_knorm"
    assert config["hf_knorm"]["normalization"] == "x^3/16"
    assert config["hf_knorm"]["version"] == hf_knorm.__version__
    # the card that reached the Hub is the one save_pretrained writes locally for this repo
    local = hf_knorm.save_pretrained(model, tmp_path / "local", tokenizer=tiny_tokenizer(), repo_id=REPO)
    assert repo.files["README.md"] == (local / "README.md").read_bytes()
    assert repo.files["model.safetensors"] == (local / "model.safetensors").read_bytes()
    assert _card(hub).data.library_name == "hf_knorm"
    # nothing but the Hub API was called, in this order
    calls = hub.paths()
    assert calls == ["POST /api/repos/create", f"GET /api/models/{REPO}", "POST /api/validate-yaml",
                     f"POST /api/models/{REPO}/preupload/main", f"POST /{REPO}.git/info/lfs/objects/batch",
                     calls[5], f"POST /api/models/{REPO}/commit/main"]
    assert calls[5].startswith("PUT /lfs-upload/")


def test_push_of_a_plain_model_says_it_is_unmodified(hub):
    hf_knorm.push_to_hub(tiny_model("llama"), REPO, tokenizer=tiny_tokenizer())
    assert "hf_knorm" not in _config(hub) and "attn_implementation" not in _config(hub)
    card = _card(hub)
    assert card.data.library_name == "transformers"
    assert stated_changes(card.text) == {"normalization": None, "balancing": None, "knorm": None}
    assert "hf_knorm" not in loading_snippet(card.text) and f'.from_pretrained("{REPO}")' in loading_snippet(card.text)
    assert hub.commits[0]["summary"] == f"Upload model with hf_knorm {hf_knorm.__version__}"


def test_repush_keeps_what_the_user_wrote_on_the_hub(hub):
    hf_knorm.push_to_hub(_patched(), REPO, tokenizer=tiny_tokenizer())
    card = _card(hub)  # the user edits the card on the Hub
    card.data.license = "apache-2.0"
    card.text = card.text + "\n## Evaluation by the author\n\nWorks on my data.\n"
    hub.repos[REPO].files["README.md"] = str(card).encode()

    hf_knorm.push_to_hub(_patched("x/16"), REPO, tokenizer=tiny_tokenizer())
    again = _card(hub)
    assert len(hub.commits) == 2
    assert again.data.license == "apache-2.0"
    assert again.data.tags == ["hf-knorm", "normalization-x-16"]
    assert again.text.index(END) < again.text.index("## Evaluation by the author\n\nWorks on my data.")
    assert "**`x/16`**" in again.text and "x^3/16" not in again.text.split(BEGIN)[1].split(END)[0]
    assert _config(hub)["hf_knorm"]["normalization"] == "x/16"


def test_repush_removes_weight_shards_the_new_model_does_not_have(hub):
    hub.repos[REPO] = Repo(private=False, files={
        "model-00001-of-00002.safetensors": b"old", "model-00002-of-00002.safetensors": b"old",
        "model.safetensors.index.json": b"{}", "notes.txt": b"kept"})
    hf_knorm.push_to_hub(_patched(), REPO, tokenizer=tiny_tokenizer())
    files = hub.repos[REPO].files
    assert "model.safetensors" in files and files["notes.txt"] == b"kept"
    assert not any(name.startswith("model-0000") or name.endswith(".index.json") for name in files)
    assert sorted(hub.commits[0]["deleted"]) == ["model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


@pytest.mark.parametrize("repo_id, reason", [("tiny-x3", "namespace/name"), ("a/b/c", "namespace/name"),
                                             ("user/bad name", "Invalid repo id"), ("user/x--y", "Invalid repo id")])
def test_invalid_repo_id_is_refused_before_anything_is_sent(hub, repo_id, reason):
    with pytest.raises(ValueError, match=reason):
        hf_knorm.push_to_hub(_patched(), repo_id, tokenizer=tiny_tokenizer())
    assert hub.requests == []


def test_no_token_is_refused_before_anything_is_sent(hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ValueError, match="No Hugging Face token: pass token=.*HF_TOKEN.*hf auth login"):
        hf_knorm.push_to_hub(_patched(), REPO, tokenizer=tiny_tokenizer())
    assert hub.requests == []


def test_the_token_file_is_used_when_no_token_is_passed(hub, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "token").write_text(hub.token)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    hf_knorm.push_to_hub(_patched(), REPO, tokenizer=tiny_tokenizer())
    assert len(hub.commits) == 1


def test_a_refused_token_says_nothing_was_uploaded(hub):
    with pytest.raises(hf_knorm.HubPushError, match=r"failed while creating the repo: 401.*refused the token.*"
                                                      r"Nothing was uploaded"):
        hf_knorm.push_to_hub(_patched(), REPO, tokenizer=tiny_tokenizer(), token="hf_wrong")
    assert hub.commits == [] and hub.lfs_objects == {}


def test_missing_tokenizer_of_a_causal_lm_is_refused_unless_asked(hub):
    with pytest.raises(ValueError, match="causal LM without its tokenizer.*tokenizer=False"):
        hf_knorm.push_to_hub(_patched(), REPO)
    assert hub.requests == []
    hf_knorm.push_to_hub(_patched(), REPO, tokenizer=False)
    assert "tokenizer.json" not in hub.repos[REPO].files
    assert "This repo has no tokenizer" in _card(hub).text


def test_an_encoder_pushes_without_a_tokenizer(hub):
    hf_knorm.push_to_hub(hf_knorm.patch(tiny_model("bert"), "x^3/16"), REPO)
    assert _config(hub)["attn_implementation"] == "hf_knorm"


def test_a_server_error_at_the_commit_says_nothing_was_committed(hub):
    hf_knorm.push_to_hub(tiny_model("llama", seed=1), REPO, tokenizer=tiny_tokenizer())  # other weights, plain
    before = dict(hub.repos[REPO].files)
    hub.fail["commit"] = (500, "Internal Error")
    with pytest.raises(hf_knorm.HubPushError) as failure:
        hf_knorm.push_to_hub(_patched(), REPO, tokenizer=tiny_tokenizer())
    message = str(failure.value)
    assert "failed while creating the commit: 500" in message
    assert f"Nothing was committed: the push is a single commit, so {REPO} still holds the 7 files it had" in message
    assert "Not in the repo: README.md, config.json, generation_config.json" in message
    assert hub.repos[REPO].files == before and len(hub.commits) == 1  # unchanged
    assert len(hub.lfs_objects) == 2  # the new weights reached storage, but no commit refers to them
    del hub.fail["commit"]
    hf_knorm.push_to_hub(_patched(), REPO, tokenizer=tiny_tokenizer())  # the same push, run again, completes
    assert _config(hub)["hf_knorm"]["normalization"] == "x^3/16"


def test_a_refused_upload_midway_says_nothing_was_committed(hub):
    hub.fail["lfs_upload"] = (403, "Forbidden by storage")
    with pytest.raises(hf_knorm.HubPushError, match=r"failed while uploading the large files: Error while uploading "
                                                      r"'model.safetensors'.*403.*Nothing was committed.*"
                                                      r"holds no files, as before"):
        hf_knorm.push_to_hub(_patched(), REPO, tokenizer=tiny_tokenizer())
    assert hub.commits == [] and hub.repos[REPO].files == {}


def test_transformers_own_push_to_hub_keeps_the_marker_after_a_plain_load(hub, tmp_path):
    hf_knorm.save_pretrained(_patched(), tmp_path / "saved", tokenizer=tiny_tokenizer())
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")  # plain load, no forward pass
    loaded.push_to_hub(REPO)  # Transformers' own push, out of habit
    config = _config(hub)
    assert config["attn_implementation"] == "hf_knorm" and config["hf_knorm"]["normalization"] == "x^3/16"


def test_push_folder_pushes_a_saved_folder_with_the_card_for_the_repo(hub, tmp_path):
    folder = hf_knorm.save_pretrained(_patched(), tmp_path / "saved", tokenizer=tiny_tokenizer())
    push_folder(folder, REPO, commit_message="first version")
    assert hub.commits[0]["summary"] == "first version"
    card = _card(hub)
    assert f'hf_knorm.from_pretrained("{REPO}")' in card.text and str(tmp_path) not in card.text
    assert hub.repos[REPO].files["model.safetensors"] == (folder / "model.safetensors").read_bytes()


def test_push_folder_keeps_the_local_text_the_user_wrote(hub, tmp_path):
    folder = hf_knorm.save_pretrained(_patched(), tmp_path / "saved", tokenizer=tiny_tokenizer())
    push_folder(folder, REPO)
    card = ModelCard((folder / "README.md").read_text())
    card.text += "\n## Local notes\n\nWritten before the second push.\n"
    card.save(folder / "README.md")
    push_folder(folder, REPO)
    assert "Written before the second push." in _card(hub).text


def test_push_folder_refuses_a_config_that_lost_its_marker_and_says_how_to_resave(hub, tmp_path):
    folder = hf_knorm.save_pretrained(_patched(), tmp_path / "saved", tokenizer=tiny_tokenizer())
    config = json.loads((folder / "config.json").read_text())
    del config["attn_implementation"]  # as a plain re-save by an earlier hf_knorm left it
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"names the hf_knorm normalization x\^3/16 but lacks \"attn_implementation\".*"
                                         r"would run softmax.*hf_knorm.save_pretrained\(hf_knorm.from_pretrained"):
        push_folder(folder, REPO)
    assert hub.requests == []  # refused before anything was sent
    resaved = hf_knorm.save_pretrained(hf_knorm.from_pretrained(folder), tmp_path / "resaved",
                                       tokenizer=tiny_tokenizer())  # the fix the message gives
    push_folder(resaved, REPO)
    assert _config(hub)["attn_implementation"] == "hf_knorm"


def test_push_folder_refuses_what_is_not_a_saved_model(hub, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a saved model: it has no config.json"):
        push_folder(tmp_path / "empty", REPO)
    with pytest.raises(FileNotFoundError, match="No model folder"):
        push_folder(tmp_path / "missing", REPO)
    folder = hf_knorm.save_pretrained(_patched(), tmp_path / "saved", tokenizer=tiny_tokenizer())
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has a config.json but no weights"):
        push_folder(folder, REPO)
    sharded = tmp_path / "sharded"
    _patched().save_pretrained(sharded, max_shard_size="100KB")
    next(sharded.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(ValueError, match="incomplete sharded checkpoint"):
        push_folder(sharded, REPO, without_tokenizer=True)
    assert hub.requests == []


def test_push_folder_of_a_causal_lm_without_tokenizer(hub, tmp_path):
    folder = hf_knorm.save_pretrained(_patched(), tmp_path / "saved")
    with pytest.raises(ValueError, match=r"without its tokenizer.*--no-tokenizer"):
        push_folder(folder, REPO)
    assert hub.requests == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        push_folder(folder, REPO, without_tokenizer=True)
    assert len(hub.commits) == 1
    assert not [w for w in caught if "marker" in str(w.message)]

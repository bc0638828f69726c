"""Saved or pushed, then loaded in a fresh process: the same logits and the same greedy tokens, bit for bit.

The fresh process sees only this worktree's hf_knorm, an empty Hugging Face home, and (for Hub ids) the loopback
stand-in through ``HF_ENDPOINT``; a ``sitecustomize`` refuses any other connection.
"""

import json
import re
import subprocess
import textwrap

import torch
from hub_helpers import PYTHON, fresh_env, hub, tiny_tokenizer  # noqa: F401 (fixture)
from tiny_models import tiny_inputs, tiny_model

import hf_knorm

REPO = "user/tiny-x3"
LOAD_AND_RUN = textwrap.dedent("""
    import sys, torch, hf_knorm
    from transformers import AutoTokenizer
    source, inputs_path, out_path = sys.argv[1:]
    model = hf_knorm.from_pretrained(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    inputs = torch.load(inputs_path)
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.save({"logits": logits, "tokens": tokens, "normalization": hf_knorm.patched_normalization(model),
                "key_scales": hf_knorm.balancing.balance.key_scales(model.config), "pad": tokenizer.pad_token_id,
                "version": model.config.hf_knorm.get("version")}, out_path)
""")


def _balanced_patched_model():
    model = tiny_model("llama")
    calibration = [tiny_inputs("llama", batch=2, length=24, seed=seed) for seed in range(2)]
    hf_knorm.balance_kv(model, None, calibration, mode="channel", alpha=0.5, progress=False)
    return hf_knorm.patch(model, "x^3/16").eval()


def _run_fresh(tmp_path, source: str, endpoint=None) -> dict:
    inputs = {"input_ids": tiny_inputs("llama", batch=1, length=10)["input_ids"]}
    torch.save(inputs, tmp_path / "inputs.pt")
    result = subprocess.run([PYTHON, "-c", LOAD_AND_RUN, source, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                            env=fresh_env(tmp_path, endpoint), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"inputs": inputs, **torch.load(tmp_path / "out.pt")}


def _expected(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits, model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)


def _assert_same_model(model, fresh):
    logits, tokens = _expected(model, fresh["inputs"])
    assert torch.equal(fresh["logits"], logits)
    assert torch.equal(fresh["tokens"], tokens)
    assert fresh["normalization"] == "x^3/16" and fresh["version"] == hf_knorm.__version__
    for loaded, ours in zip(fresh["key_scales"], hf_knorm.balancing.balance.key_scales(model.config)):
        assert torch.equal(loaded, ours)
    assert fresh["pad"] == 0  # the tokenizer came along


def test_local_save_then_load_in_a_fresh_process_is_exact(tmp_path):
    model = _balanced_patched_model()
    hf_knorm.save_pretrained(model, tmp_path / "saved", tokenizer=tiny_tokenizer())
    _assert_same_model(model, _run_fresh(tmp_path, str(tmp_path / "saved")))


def test_push_then_load_from_the_hub_in_a_fresh_process_is_exact(hub, tmp_path):
    model = _balanced_patched_model()
    hf_knorm.push_to_hub(model, REPO, tokenizer=tiny_tokenizer(), private=True)
    fresh = _run_fresh(tmp_path, REPO, endpoint=hub.endpoint)
    _assert_same_model(model, fresh)
    head = hub.repos[REPO].head  # Transformers resolves main to the commit, then downloads at that commit
    assert f"GET /{REPO}/resolve/{head}/model.safetensors" in hub.paths()  # it really came from the stand-in


def test_plain_transformers_without_the_plugin_refuses_the_pushed_model(hub, tmp_path):
    hf_knorm.push_to_hub(hf_knorm.patch(tiny_model("llama"), "x^3/16"), REPO, tokenizer=tiny_tokenizer())
    script = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({REPO!r})"
    result = subprocess.run([PYTHON, "-c", script], env=fresh_env(tmp_path, hub.endpoint), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    assert 'attn_implementation="hf_knorm"' in result.stderr
    assert f"GET /{REPO}/resolve/{hub.repos[REPO].head}/config.json" in hub.paths()


def test_cli_push_of_a_saved_folder(hub, tmp_path):
    folder = hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x^3/16"), tmp_path / "saved",
                                      tokenizer=tiny_tokenizer())
    command = [PYTHON, "-m", "hf_knorm.cli", "push", str(folder), REPO, "--private", "--commit-message", "from the CLI"]
    result = subprocess.run(command, env=fresh_env(tmp_path, hub.endpoint), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert hub.commits[-1]["summary"] == "from the CLI" and hub.repos[REPO].private
    assert f"{hub.endpoint}/{REPO}/commit/{hub.repos[REPO].head}" in result.stdout
    assert hub.repos[REPO].files["model.safetensors"] == (folder / "model.safetensors").read_bytes()


CLI_CASES = textwrap.dedent("""
    import contextlib, io, json, sys
    from hf_knorm.cli import main
    results = []
    for arguments in json.loads(sys.argv[1]):  # each as `hf-knorm push ...` would run it: its status, its stderr
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                status = main(["push", *arguments])
            except SystemExit as exit:
                status = exit.code
        results.append([status, stderr.getvalue()])
    print(json.dumps(results))
""")


def test_cli_push_errors_are_reported_before_anything_is_sent(hub, tmp_path):
    """Each bad call exits with status 2 and says what is wrong, and nothing reaches the Hub (the calls run in one
    fresh process, with the stand-in's endpoint and no token in its environment)."""
    folder = hf_knorm.save_pretrained(hf_knorm.patch(tiny_model("llama"), "x/16"), tmp_path / "saved")
    env = fresh_env(tmp_path, hub.endpoint, token=None)
    cases = [([str(folder), REPO], "No Hugging Face token"),
             ([str(folder), "not-a-repo-id", "--token", "t"], "Invalid repo id"),
             ([str(tmp_path), REPO, "--token", "t"], "is not a saved model"),
             ([str(folder), REPO, "--token", "t"], "without its tokenizer")]
    run = subprocess.run([PYTHON, "-c", CLI_CASES, json.dumps([arguments for arguments, _ in cases])], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for (arguments, message), (status, stderr) in zip(cases, json.loads(run.stdout.splitlines()[-1]), strict=True):
        assert status == 2, (arguments, stderr[-2000:])
        assert re.search(rf"hf-knorm push: error: .*{re.escape(message)}", stderr), stderr[-2000:]
    assert hub.requests == []

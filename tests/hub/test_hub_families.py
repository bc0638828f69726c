"""Every family's learned values travel through the Hub: pushed with ``push_to_hub``, then loaded in a fresh process
(the stand-in Hub only, an empty Hugging Face home), the same logits and greedy tokens bit for bit, and the values
themselves."""

import subprocess
import textwrap

import pytest
import torch
from hub_helpers import PYTHON, fresh_env, hub, tiny_tokenizer  # noqa: F401 (fixture)
from tiny_models import tiny_inputs, tiny_model

import hf_knorm

LEARNED = ["sigmoid(bias=learned)", "softmax(sink=learned)", "ssmax(scale=learned)", "relu(x)^3/16 + softmax window 4"]
"""Each family that learns a value, and the window's mix beside a family."""

LOAD = textwrap.dedent("""
    import sys, torch, hf_knorm
    repo, inputs_path, out_path = sys.argv[1:]
    model = hf_knorm.from_pretrained(repo).eval()
    inputs = torch.load(inputs_path)
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    learned = {name: value.detach() for name, value in model.named_parameters() if "hf_knorm_" in name}
    torch.save({"logits": logits, "tokens": tokens, "learned": learned,
                "normalization": hf_knorm.patched_normalization(model)}, out_path)
""")


@pytest.mark.parametrize("spelling", LEARNED)
def test_a_pushed_learnable_family_loads_exactly_from_the_hub(hub, tmp_path, spelling):
    model = hf_knorm.patch(tiny_model("llama"), spelling).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # learned values away from their initial ones, so a lost value shows
        for name, value in model.named_parameters():
            if "hf_knorm_" in name:
                value.add_(torch.rand(value.shape, generator=generator) * 0.5)
    repo = "user/tiny-" + "".join(ch for ch in spelling if ch.isalnum())
    hf_knorm.push_to_hub(model, repo, tokenizer=tiny_tokenizer())
    inputs = {"input_ids": tiny_inputs("llama", batch=1, length=10)["input_ids"]}
    torch.save(inputs, tmp_path / "inputs.pt")
    result = subprocess.run([PYTHON, "-c", LOAD, repo, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                            env=fresh_env(tmp_path, hub.endpoint), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    fresh = torch.load(tmp_path / "out.pt")
    ours = {name: value.detach() for name, value in model.named_parameters() if "hf_knorm_" in name}
    assert ours and fresh["learned"].keys() == ours.keys()
    assert all(torch.equal(fresh["learned"][name], ours[name]) for name in ours)
    with torch.no_grad():
        assert torch.equal(fresh["logits"], model(**inputs).logits)
        assert torch.equal(fresh["tokens"], model.generate(**inputs, max_new_tokens=6, do_sample=False,
                                                           pad_token_id=0))
    assert fresh["normalization"] == hf_knorm.parse_normalization(spelling).name

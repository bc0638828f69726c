"""Helpers shared by the KNorm tests: tiny models whose key norms differ, and greedy generation of a fixed length."""

from __future__ import annotations

import copy

import torch
from tiny_models import tiny_model

from hf_knorm.compat import cache_kwargs

PROMPT, NEW = 24, 6
NO_EOS = 10**6  # an id no model produces: generation never stops early (None would fall back to the model default)


def knorm_model(model_type: str):
    """A tiny model whose key norms differ between tokens (QK-norm models get non-uniform k_norm weights, else every
    key has the same norm and the ranking is a tie decided by rounding)."""
    model = tiny_model(model_type)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("k_norm.weight"):
                param.copy_(torch.linspace(0.2, 3.0, param.numel()).reshape(param.shape))
    return model


def greedy(model, ids, cache, new=NEW):
    """Greedy generation of exactly ``new`` tokens (no end-of-sequence stop), with the raw logits of every step."""
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=NO_EOS, pad_token_id=0, max_new_tokens=new, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache),
                          generation_config=config)

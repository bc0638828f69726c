"""Helpers shared by the KNorm tests: tiny models whose key norms differ, and greedy generation of a fixed length."""

from __future__ import annotations

import copy

import torch
from tiny_models import tiny_config, tiny_model

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


def word_tokenizer():
    """An offline tokenizer for the tiny models: the text "w4 w17 ..." is the ids 4, 17, ... (pad 0, bos 1, eos 2)."""
    from tiny_models import VOCAB
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def word_text(length: int, seed: int = 0) -> str:
    """``length`` words of :func:`word_tokenizer`, drawn reproducibly."""
    ids = torch.randint(4, 128, (length,), generator=torch.Generator().manual_seed(seed))
    return " ".join(f"w{i}" for i in ids.tolist())


def tiny_pipeline():
    """The knorm-text-generation pipeline on a tiny random Llama with the default model's tokenizer (its padding side
    is right: the pipeline pads on the left itself)."""
    import transformers as tf

    from hf_knorm.assets.default_model import default_model_dir

    tokenizer = tf.AutoTokenizer.from_pretrained(default_model_dir())
    config = tiny_config("llama")
    config.update(dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    return tf.pipeline("knorm-text-generation", model=model, tokenizer=tokenizer)


def real_positions(positions: torch.Tensor) -> list:
    """(B, H_kv, S) kept positions as lists per (batch row, head), without the padding (-1) of shorter heads and dead
    slots."""
    return [[[p for p in head if p >= 0] for head in row] for row in positions.tolist()]


def kept_lists(cache, layer: int) -> list:
    """A KNorm layer's kept positions as lists per (batch row, head) (:func:`real_positions`)."""
    return real_positions(cache.kept_positions(layer))

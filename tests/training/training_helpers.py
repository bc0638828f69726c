"""Shared pieces of the training tests: tiny trainable models, datasets, Trainer arguments, a direct computation of
the statistics NormLoggerCallback logs, and a character tokenizer (no download)."""

from __future__ import annotations

import copy
import json
import string
import sys
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tiny_models.py
from tiny_models import VOCAB, tiny_config, tiny_model  # noqa: E402

import hf_knorm  # noqa: E402


def lm(normalization: str | None = None, seed: int = 0, attention_dropout: float = 0.0):
    """The tiny llama causal LM in train mode, patched with ``normalization`` (None: unpatched, SDPA)."""
    model = tiny_model("llama", seed=seed)
    for _, module in hf_knorm.models.architectures.attention_modules(model):
        module.attention_dropout = attention_dropout
    if normalization:
        hf_knorm.patch(model, normalization)
    return model.train()


def vit(normalization: str | None = None, seed: int = 0):
    """A tiny ViT image classifier (2 layers, 16x16x3 images, 16 patches + CLS, 3 classes) in train mode."""
    config = tiny_config("vit")
    config.num_labels = 3
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.ViTForImageClassification(config)
    with torch.no_grad():  # as tiny_model does: weights large enough for the normalizations to differ
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "emb" not in name:
                param.mul_(4.0)
    if normalization:
        hf_knorm.patch(model, normalization)
    return model.train()


def lm_data(count: int = 32, length: int = 16, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (count, length), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def vit_data(count: int = 32, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(count, 3, 16, 16, generator=generator)
    labels = torch.randint(0, 3, (count,), generator=generator)
    return [{"pixel_values": p, "labels": int(y)} for p, y in zip(pixels, labels)]


def args(out, **overrides) -> tf.TrainingArguments:
    settings = dict(output_dir=str(out), max_steps=6, logging_steps=2, per_device_train_batch_size=4,
                    learning_rate=1e-3, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
                    seed=0, data_seed=0)
    settings.update(overrides)
    return tf.TrainingArguments(**settings)


def history_lines(path) -> list[dict]:
    """The lines of a norms.jsonl, parsed strictly (a bare NaN/Infinity fails)."""
    def reject(name):
        raise ValueError(f"bare {name}")

    return [json.loads(line, parse_constant=reject) for line in Path(path).read_text().splitlines()]


class CaptureStep(tf.TrainerCallback):
    """Keeps, for optimizer step ``step``, the weights it starts from and every micro-batch the model receives."""

    def __init__(self, step: int):
        self.step = step
        self.state_dict = None
        self.batches: list[dict] = []
        self._hook = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            self.state_dict = copy.deepcopy(model.state_dict())
            self._hook = model.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module, positional, kwargs):
        self.batches.append({k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})

    def on_step_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def direct_statistics(model, state_dict, batches) -> list[dict[str, float]]:
    """The logged statistics recomputed from the attention weights (``output_attentions``) of the same batches.

    ``model`` is a fresh model of the same kind; an unpatched one is switched to eager attention, which returns
    its softmax weights. Key/value norms come from the k_proj/v_proj outputs, per head: RoPE rotates channel pairs,
    which leaves a head's key norm unchanged. No padding: every query row is real.
    """
    model.load_state_dict(state_dict)
    model.eval()
    if hf_knorm.patched_normalization(model) is None:
        model.set_attn_implementation("eager")
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", heads)
    projections = {"k": [], "v": []}
    hooks = [
        module.register_forward_hook(lambda m, a, out, kind=name[-6]: projections[kind].append(out.detach()))
        for name, module in model.named_modules() if name.endswith(("k_proj", "v_proj"))
    ]
    fro, fro_sqrtn = None, None
    with torch.no_grad():
        for batch in batches:
            attentions = model(**batch, output_attentions=True).attentions
            norms = [a.double().square().sum(dim=(-2, -1)).sqrt().flatten() for a in attentions]  # (B * H,) each
            rows = attentions[0].shape[-2]
            fro = norms if fro is None else [torch.cat([f, n]) for f, n in zip(fro, norms)]
            scaled = [n / rows**0.5 for n in norms]
            fro_sqrtn = scaled if fro_sqrtn is None else [torch.cat([f, n]) for f, n in zip(fro_sqrtn, scaled)]
    for hook in hooks:
        hook.remove()
    layers = len(fro)

    def per_head_norms(kind, layer):
        outputs = projections[kind][layer::layers]  # one per batch
        return torch.cat([o.double().reshape(*o.shape[:2], kv_heads, -1).norm(dim=-1).flatten() for o in outputs])

    result = []
    for layer in range(layers):
        keys, values = per_head_norms("k", layer), per_head_norms("v", layer)
        result.append({
            "attn_fro": fro[layer].mean().item(),
            "attn_fro_max": fro[layer].max().item(),
            "attn_fro_sqrtn": fro_sqrtn[layer].mean().item(),
            "attn_fro_sqrtn_max": fro_sqrtn[layer].max().item(),
            "key_norm": keys.mean().item(),
            "value_norm": values.mean().item(),
            "kv_ratio": keys.mean().item() / values.mean().item(),
        })
    return result


def char_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A character-level tokenizer of printable ASCII (101 ids, below the tiny models' vocabulary of 128)."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for char in string.printable:
        if char not in "\x0b\x0c\r":
            vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>", unk_token="<unk>")


def save_tiny_lm(folder):
    """The tiny llama (max 256 positions) with a character tokenizer, saved in ``folder`` as a checkpoint."""
    lm().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder

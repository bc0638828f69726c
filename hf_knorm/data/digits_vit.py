"""A miniature of the paper's ViT-Tiny setting: a 12-layer ViT from a config, on scikit-learn's 8x8 digits.

Why this model and data for the "attention norms across 12 layers" figure: the paper's figure is a ViT-Tiny (12
layers, width 192, 3 heads) trained from scratch on images with each normalization. scikit-learn's ``load_digits``
(1,797 grey 8x8 images of 10 digits) ships inside the scikit-learn wheel (no download), and with patches of 2x2 a
ViT sees 16 patches plus the class token, a full encoder attention over N = 17 tokens; the same 12 x 192 x 3
architecture trains an epoch in seconds on a CPU. The other candidate, a 12-layer causal LM on the embedded text,
would put causal masks (rows of different lengths) into a figure whose claims are about unmasked encoder attention.

Data: images scaled to [-1, 1]; a stratified split of 1,437 training and 360 held-out images, fixed by ``seed``.
"""

from __future__ import annotations

import torch

from ..extras import require


def digits_splits(seed: int = 0, test_fraction: float = 0.2):
    """``(train, test)`` lists of ``{"pixel_values": (1, 8, 8) float32, "labels": int}``; stratified, seeded."""
    require("sklearn", "hf-knorm attention-norms (scikit-learn's 8x8 digits)")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0 * 2.0 - 1.0  # (1797, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_index, test_index = train_test_split(
        range(len(labels)), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    return ([{"pixel_values": images[i], "labels": int(labels[i])} for i in train_index],
            [{"pixel_values": images[i], "labels": int(labels[i])} for i in test_index])


def digits_vit_config(layers: int = 12, hidden: int = 192, heads: int = 3, patch_size: int = 2):
    """A ``ViTConfig`` for 8x8 one-channel digits: ViT-Tiny's depth, width and heads by default, MLP 4x width."""
    from transformers import ViTConfig

    return ViTConfig(image_size=8, patch_size=patch_size, num_channels=1, hidden_size=hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden, num_labels=10)


def accuracy(model, examples, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` on ``examples`` (eval mode, no gradient)."""
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = examples[start:start + batch_size]
            pixels = torch.stack([example["pixel_values"] for example in batch]).to(model.device)
            labels = torch.tensor([example["labels"] for example in batch], device=model.device)
            correct += int((model(pixel_values=pixels).logits.argmax(-1) == labels).sum())
    model.train(was_training)
    return correct / len(examples)

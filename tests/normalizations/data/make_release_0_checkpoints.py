"""Write the checkpoints of tests/normalizations/test_release_0_checkpoints.py with the release before the
normalization families (commit c14563d, hf_knorm 0.1.0: a window mix kept in the config, no learnable parameters).

Run with that release on the path, not this checkout (the script refuses otherwise)::

    git -C <repo> worktree add --detach /tmp/old-release c14563d
    PYTHONPATH=/tmp/old-release python tests/normalizations/data/make_release_0_checkpoints.py
    git -C <repo> worktree remove --force /tmp/old-release

It writes, under ``release_0_checkpoints/`` beside it: ``windowed/`` (a tiny llama patched with
``x^3/16 + softmax window 4 + sinks 1``, a window mix set with that release's ``set_window_mix``), ``plain/``
(``x^3/16``), each saved with Transformers' ``save_pretrained`` (as that release wrote them, the marker included), and
``logits.safetensors``: the input ids and each model's logits for them, computed by that release.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import save_file

import hf_knorm

OUT = Path(__file__).resolve().parent / "release_0_checkpoints"
MIX = [[0.25, -0.5, 1.5, 0.0], [2.0, 0.75, -1.25, 0.5]]  # per layer, per query head: every kind of value
CHECKPOINTS = {"windowed": "x^3/16 + softmax window 4 + sinks 1", "plain": "x^3/16"}


def tiny_llama(seed: int = 0):
    """A tiny random llama (hidden 32, 2 layers, 4 query heads over 2 KV heads, vocabulary 64), weights scaled x4 as
    tests/tiny_models.py does so that the normalizations differ."""
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "emb" not in name:
                param.mul_(4.0)
    return model.eval()


def main() -> None:
    if importlib.util.find_spec("hf_knorm.normalizations") is not None:
        sys.exit(f"{hf_knorm.__file__} has the normalization families: run this with the release before them "
                 "(PYTHONPATH=<a worktree of c14563d>).")
    from hf_knorm.models.window_mix import set_window_mix

    input_ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    tensors = {"input_ids": input_ids}
    for name, spelling in CHECKPOINTS.items():
        model = hf_knorm.patch(tiny_llama(), spelling)
        if hf_knorm.models.patching.patched_normalization(model) != spelling:
            sys.exit(f"patched with {hf_knorm.models.patching.patched_normalization(model)}, not {spelling}")
        if "window" in spelling:
            set_window_mix(model, MIX)
        model.save_pretrained(OUT / name)
        with torch.no_grad():
            tensors[name] = model(input_ids=input_ids).logits.contiguous()
    metadata = {"release": "c14563d", "hf_knorm": hf_knorm.__version__, "transformers": tf.__version__,
                "torch": torch.__version__}
    save_file(tensors, str(OUT / "logits.safetensors"), metadata=metadata)
    print(f"wrote {OUT} with hf_knorm {hf_knorm.__version__} from {Path(hf_knorm.__file__).parent}")


if __name__ == "__main__":
    main()

"""``scripts/distant_part_ceiling.py``: its split at the window is exact, and its hooks recompute the model's own
attention (so its figures are the original's, not an artefact of the recomputation)."""

import importlib.util
from pathlib import Path

import torch

from tiny_models import tiny_inputs, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("distant_part_ceiling", ROOT / "scripts" / "distant_part_ceiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _split(script, window=4, sinks=2, length=20, heads=3, dim=5):
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(heads, length, length, generator=generator, dtype=torch.float64) * 3
    value = torch.randn(heads, length, dim, generator=generator, dtype=torch.float64)
    rows = torch.arange(length)
    return script.split_at_window(scores, value, rows, window, sinks), scores, value


def test_the_split_at_the_window_is_the_softmax_output_exactly():
    script = _script()
    split, scores, value = _split(script)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    want = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ value
    torch.testing.assert_close(split.o, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(split.o_win + split.alpha * (split.o_old - split.o_win), want, rtol=0, atol=1e-12)
    assert split.older[:6].sum() == 0 and split.older[19].sum() == 20 - 4 - 2  # window 4 and 2 sinks read


def test_the_joint_normalization_with_exp_weights_is_softmax():
    """LoLCATs' joint normalization with the older keys weighted by ``e^s`` (m = 1) gives back what softmax puts
    beyond the window: the form the script searches is the right one, only its weights differ."""
    script = _script()
    split, scores, _ = _split(script)
    part = script.joint_part(split, scores.exp() * split.older, torch.ones(3, 1, 1, dtype=torch.float64))
    torch.testing.assert_close(part, split.o - split.o_win, rtol=0, atol=1e-12)


def test_the_hooks_recompute_the_models_attention():
    """Replacing every layer's attention output by the script's recomputed ``o`` (fp64, RoPE and GQA redone) leaves
    the logits of a tiny GQA Llama as they were; so does the window alone where no key is older than the window."""
    script = _script()
    model = tiny_model("llama")
    inputs = tiny_inputs("llama", batch=2, length=12)
    with torch.no_grad():
        want = model(**inputs).logits
        splitter = script.WindowSplitter(model, window=64, sinks=4)
        for name in ("original", "window alone"):
            splitter.replacing = name
            torch.testing.assert_close(model(**inputs).logits, want, rtol=1e-4, atol=1e-4)
        splitter.replacing = "original"
        splitter.window = 4  # older keys exist now: the window alone must differ, the original must not
        torch.testing.assert_close(model(**inputs).logits, want, rtol=1e-4, atol=1e-4)
        splitter.replacing = "window alone"
        assert not torch.allclose(model(**inputs).logits, want, rtol=1e-3, atol=1e-3)

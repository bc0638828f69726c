"""A softmax window in patched models: ``hf_knorm.patch(model, "x^3/16", softmax_window=W)``.

- The whole model against the same model whose attention is the plain reference (explicit masks), fp64: logits and
  every parameter's gradient within 1e-9 of their largest entry; left padding, GQA, the model's own sliding window
  (mistral, gemma2, gemma3: 5 positions, shorter and longer than the softmax window) and softcap (gemma2).
- Token-by-token decoding with the K/V cache equals the full forward (fp32, 1e-4 as tests/models/test_generation.py).
- ``W = 0`` is the pure normalization bit for bit; a window longer than the text is softmax.
- The window travels with the model: config, save and reload, the card; bad windows are refused.
"""

import pytest
import torch
from card_values import expected_normalization, stated_normalization
from tiny_models import assert_same_step, logits_and_grads, tiny_inputs, tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import hf_knorm
from hf_knorm.attention.interface import normalization_of
from hf_knorm.attention.masks import explicit_bool_mask
from hf_knorm.attention.paths import attention_paths
from hf_knorm.attention.reference import reference_window_attention
from hf_knorm.models.parameters import add_parameters, hold_normalization
from hf_knorm.models.patching import held_normalization
from hf_knorm.models.window_mix import distant_part_off, set_window_mix, window_mixes
from hf_knorm.recurrent.window_cache import WindowStateLayer
from hf_knorm.compat import cache_kwargs, output_cache

REFERENCE = "test_reference_window"
WINDOW_TYPES = ("llama", "mistral", "gemma2", "gemma3_text", "qwen3", "gpt2", "phi3")
SLIDING_TYPES = ("mistral", "gemma2", "gemma3_text")  # with layers of their own sliding window (tests/tiny_models.py)
ATOL = 1e-4  # fp32 decoding against the full forward (logits of size ~10)


def reference_window(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The plain reference of the model's windowed normalization, as an ``AttentionInterface`` function."""
    normalization = normalization_of(module)
    params = normalization.values_on(module)
    output, _ = reference_window_attention(query, key, value, attention_mask, normalization, scaling=scaling,
                                           softcap=kwargs.get("softcap"), mix=params.get("window_mix"), params=params)
    return output, None


AttentionInterface.register(REFERENCE, reference_window)
AttentionMaskInterface.register(REFERENCE, explicit_bool_mask)


def _twins(model_type, spelling, window, dtype=torch.float64):
    model = hf_knorm.patch(tiny_model(model_type, dtype=dtype), spelling, softmax_window=window)
    reference = tiny_model(model_type, dtype=dtype)
    reference.config.hf_knorm = dict(model.config.hf_knorm)
    hold_normalization(reference, held_normalization(model))  # what the attention reads (hf_knorm.attention.held)
    add_parameters(reference, held_normalization(model))  # the mix at 1
    reference.set_attn_implementation(REFERENCE)
    return model, reference




@pytest.mark.parametrize("model_type, spelling, window", [
    (model_type, spelling, window) for model_type in WINDOW_TYPES
    for spelling, window in [("x^3/16", 3), ("x/1", 4), ("x/sqrtN", 7), ("x^3/sqrtN", 2),
                             ("x^3/16 + softmax window 3 + sinks 2", 3), ("x/1 + softmax window 4 + sinks 1", 4)]
    if "sinks" not in spelling or model_type not in SLIDING_TYPES  # refused there: below
])
def test_models_equal_the_reference_attention(model_type, spelling, window):
    model, reference = _twins(model_type, spelling, window)
    inputs = tiny_inputs(model_type, length=14)
    inputs["attention_mask"][1, :4] = 0  # left padding: its queries attend nothing on either side
    got = logits_and_grads(model, inputs)  # eval mode: no dropout (gpt2 has some), gradients all the same
    want = logits_and_grads(reference, inputs)
    assert_same_step(got, want, logits_atol=1e-9 * want[0].abs().max().item(), grads_relative=1e-9, grads_floor=1e-15)


@pytest.mark.compat
@pytest.mark.parametrize("model_type, spelling", [
    (model_type, spelling) for model_type in ("llama", "mistral", "gemma2", "gemma3_text")
    for spelling in ("x^3/16", "x/1", "x/sqrtN", "x^3/16 + softmax window 3 + sinks 2",
                     "x/1 + softmax window 3 + sinks 2")
    if "sinks" not in spelling or model_type not in SLIDING_TYPES
])
def test_token_by_token_decoding_with_the_kv_cache_equals_the_full_forward(model_type, spelling):
    model = hf_knorm.patch(tiny_model(model_type), spelling, softmax_window=3)
    ids = tiny_inputs(model_type, batch=1, length=14)["input_ids"]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :4], use_cache=True, **cache_kwargs(_kv_cache(model)))
        steps = [out.logits]
        for position in range(4, 14):
            out = model(input_ids=ids[:, position: position + 1], **cache_kwargs(output_cache(out)), use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=ATOL)


@pytest.mark.parametrize("model_type", SLIDING_TYPES)
def test_sinks_are_refused_on_a_models_own_sliding_window(model_type):
    """The sinks are each sequence's first tokens; a layer with its own sliding window (5 positions here) leaves them
    behind, in its mask and in its cache. ``patch`` refuses them, saying what to do; a model whose saved config names
    sinks (a plain ``from_pretrained`` runs no ``patch``) refuses them at its first forward and in ``generate``. The
    window alone runs (and equals the reference: above)."""
    with pytest.raises(ValueError, match="their own sliding window .*5 positions.*Patch it without attention_sinks"):
        hf_knorm.patch(tiny_model(model_type), "x^3/16", softmax_window=3, attention_sinks=2)
    alone = hf_knorm.patch(tiny_model(model_type), "x^3/16", softmax_window=3)
    inputs = tiny_inputs(model_type, length=14)
    with torch.no_grad():
        assert torch.isfinite(alone(**inputs).logits).all()
    sunk = alone  # its config as a saved one with sinks would load (every module holds the model's one config)
    sunk.config.hf_knorm = {**sunk.config.hf_knorm, "normalization": "x^3/16 + softmax window 3 + sinks 2"}
    hold_normalization(sunk, hf_knorm.parse_normalization("x^3/16 + softmax window 3 + sinks 2"))  # as built
    refusal = "own sliding window of 5 positions.*Patch this model without attention_sinks"
    with torch.no_grad(), pytest.raises(ValueError, match=refusal):
        sunk(**inputs)
    with torch.no_grad(), pytest.raises(ValueError, match=refusal):
        sunk.generate(**inputs, max_new_tokens=2, do_sample=False)


def test_the_default_conversion_on_a_sliding_window_model_names_both_flags_to_drop():
    """``hf-knorm convert``'s defaults (sinks and a sparse cache) on a model with its own sliding window: the refusal
    names both flags, so that following it works the first time."""
    model_type = SLIDING_TYPES[0]
    with pytest.raises(ValueError, match="Patch it without attention_sinks and without the sparse cache "
                                         r"\(hf-knorm convert --attention-sinks 0 --sparse-cache 0"):
        hf_knorm.patch(tiny_model(model_type), "x/1 + softmax window 3 + sinks 2 + sparse 4 (value_over_key)")
    with pytest.raises(ValueError, match=r"without the sparse cache \(hf-knorm convert --sparse-cache 0\)"):
        hf_knorm.patch(tiny_model(model_type), "x/1 + softmax window 3 + sparse 4 (value_over_key)")


def _kv_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def test_a_window_of_zero_is_the_pure_normalization_bit_for_bit():
    inputs = tiny_inputs("llama", length=20)
    pure = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    zero = hf_knorm.patch(tiny_model("llama"), "x^3/16", softmax_window=0)
    assert zero.config.hf_knorm["normalization"] == "x^3/16"
    with torch.no_grad():
        assert torch.equal(zero(**inputs).logits, pure(**inputs).logits)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_a_window_longer_than_the_text_is_softmax(model_type):
    inputs = tiny_inputs(model_type, length=12)
    softmax = hf_knorm.patch(tiny_model(model_type), "softmax")
    windowed = hf_knorm.patch(tiny_model(model_type), "x^3/16", softmax_window=12)
    with torch.no_grad():
        torch.testing.assert_close(windowed(**inputs).logits, softmax(**inputs).logits, rtol=0, atol=1e-5)


def test_the_p1_hybrid_runs_in_linear_time_in_a_model():
    model = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=16)
    inputs = tiny_inputs("llama", length=200)
    with attention_paths() as taken, torch.no_grad():
        model(**inputs)
    assert dict(taken) == {"linear": model.config.num_hidden_layers}
    cubic = hf_knorm.patch(tiny_model("llama"), "x^3/16", softmax_window=16)
    with attention_paths() as taken, torch.no_grad():
        cubic(**inputs)
    assert dict(taken) == {"quadratic": model.config.num_hidden_layers}


def test_the_window_travels_with_the_model(tmp_path):
    model = hf_knorm.patch(tiny_model("qwen3"), "x^3/16", softmax_window=4)
    assert model.config.hf_knorm["normalization"] == "x^3/16 + softmax window 4"
    assert hf_knorm.patched_normalization(model) == "x^3/16 + softmax window 4"
    hf_knorm.save_pretrained(model, tmp_path / "model")
    loaded = hf_knorm.from_pretrained(tmp_path / "model").eval()
    assert loaded.config.hf_knorm["normalization"] == "x^3/16 + softmax window 4"
    inputs = tiny_inputs("qwen3", length=12)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model.eval()(**inputs).logits)
    card = (tmp_path / "model" / "README.md").read_text()
    assert "x^3/16 + softmax window 4" in card and "normalization-x3-16-softmax-window-4" in card
    assert stated_normalization(card) == expected_normalization("x^3/16 + softmax window 4")
    assert stated_normalization(card)["window"] == 4


def test_the_sinks_travel_with_the_model(tmp_path):
    """Saved in the spelling, reloaded exactly, said by the card; the reloaded p = 1 model generates the full
    forward's greedy tokens (with its recurrent cache: tests/recurrent/test_window_cache.py)."""
    model = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=4, attention_sinks=2).eval()
    assert model.config.hf_knorm["normalization"] == "x/1 + softmax window 4 + sinks 2"
    hf_knorm.save_pretrained(model, tmp_path / "model")
    loaded = hf_knorm.from_pretrained(tmp_path / "model").eval()
    assert hf_knorm.patched_normalization(loaded) == "x/1 + softmax window 4 + sinks 2"
    inputs = tiny_inputs("llama", batch=1, length=12)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    stated = stated_normalization((tmp_path / "model" / "README.md").read_text())
    assert stated == expected_normalization("x/1 + softmax window 4 + sinks 2") and stated["sinks"] == 2
    ids = inputs["input_ids"]
    with torch.no_grad():
        generated = loaded.generate(ids, max_new_tokens=10, do_sample=False)
        for _ in range(10):
            ids = torch.cat([ids, loaded(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids)
    with pytest.raises(ValueError, match="without a softmax window"):
        hf_knorm.patch(tiny_model("llama"), "x/1", attention_sinks=2)


def test_patching_with_another_window_or_a_bad_one_is_refused():
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16", softmax_window=4)
    with pytest.raises(ValueError, match="unpatch"):
        hf_knorm.patch(model, "x^3/16", softmax_window=8)
    with pytest.warns(UserWarning, match="already patched"):
        hf_knorm.patch(model, "x^3/16 + softmax window 4")
    with pytest.raises(ValueError, match="integer >= 0"):
        hf_knorm.patch(tiny_model("llama"), "x^3/16", softmax_window=-1)
    with pytest.raises(ValueError, match="already weighted by softmax"):
        hf_knorm.patch(tiny_model("llama"), "softmax", softmax_window=4)
    with pytest.raises(ValueError, match="attends both ways"):
        hf_knorm.patch(tiny_model("bert"), "x^3/16", softmax_window=4)
    with pytest.raises(ValueError, match="contradicts"):
        hf_knorm.patch(tiny_model("llama"), "x^3/16 + softmax window 8", softmax_window=4)
    hf_knorm.unpatch(model)
    assert hf_knorm.patched_normalization(hf_knorm.patch(model, "x^3/16", softmax_window=8)) == \
        "x^3/16 + softmax window 8"


@pytest.mark.parametrize("spelling", ["x^3/16", "x/1"])
def test_returned_attentions_are_both_parts_and_change_nothing(spelling):
    """``output_attentions=True`` takes the explicit route (weights materialized): the same logits as key padding,
    rows whose window holds every key they attend sum to 1 (softmax alone)."""
    model = hf_knorm.patch(tiny_model("llama"), spelling, softmax_window=4)
    inputs = tiny_inputs("llama", length=12)
    inputs["attention_mask"][1, :3] = 0
    with torch.no_grad():
        plain = model(**inputs).logits
        out = model(**inputs, output_attentions=True)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(out.logits[real], plain[real], rtol=0, atol=1e-5)
    weights = out.attentions[0]  # (B, H, q, kv)
    assert weights.shape == (2, 4, 12, 12)
    torch.testing.assert_close(weights[0, :, :4].sum(-1), torch.ones(4, 4), rtol=0, atol=1e-6)
    assert weights[0, :, 6, :3].abs().sum() > 0  # keys older than the window: the polynomial weights


def test_knorm_eviction_is_refused_with_a_window():
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16", softmax_window=4)
    with pytest.raises(ValueError, match="no longer holds those positions"):
        hf_knorm.KNormCache(0.5, config=model.config)


@pytest.mark.parametrize("padded", [False, True])
def test_the_p1_hybrid_builds_no_n_by_n_tensor(padded):
    """600 tokens, window 16, forward and backward: every tensor any op returns has at most one axis of 200 or more
    (no mask, score or weight matrix of the sequence's length; the logits have one, the vocabulary is 128)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.large = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and sum(size >= 200 for size in tensor.shape) >= 2:
                    self.large.append((str(func), tuple(tensor.shape)))
            return out

    model = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=16).train()
    inputs = tiny_inputs("llama", batch=1, length=600)
    if padded:
        inputs["attention_mask"][0, :5] = 0
    with attention_paths() as taken, Shapes() as shapes:
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
    assert dict(taken) == {"linear": model.config.num_hidden_layers}
    assert shapes.large == []


@pytest.mark.parametrize("spelling", ["x/1", "x^3/16"])
def test_recorded_attention_norms_are_the_whole_matrixs(spelling):
    """record_norms gives the Frobenius norm of the weights that output_attentions returns (both parts), per batch
    item and head. The rows of the polynomial part are normalized one by one, so a recorded call materializes them
    on the quadratic kernel, and the path counted says so (x/1 too: a fallback from the linear path)."""
    model = hf_knorm.patch(tiny_model("llama"), spelling, softmax_window=8)
    inputs = tiny_inputs("llama", length=140)
    with hf_knorm.record_norms(model) as recorder, torch.no_grad(), attention_paths() as taken:
        model(**inputs)
    assert dict(taken) == {"quadratic": model.config.num_hidden_layers}
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    assert len(recorder.layers) == len(attentions) == model.config.num_hidden_layers
    for layer, weights in zip(recorder.layers, attentions):
        expected = weights.square().sum(dim=(-2, -1)).sqrt().flatten()
        torch.testing.assert_close(layer.attention_frobenius(), expected, rtol=1e-5, atol=0)


# --- the per-head mix of the polynomial part (a conversion's, saved in the config) -----------------------------------

def _random_mix(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    heads = model.config.num_attention_heads
    return [torch.randn(heads, generator=generator, dtype=torch.float64) for _ in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("spelling", ["x^3/16", "x/1"])
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3"])
def test_a_saved_mix_scales_each_heads_polynomial_part_as_the_reference_does(model_type, spelling):
    model, reference = _twins(model_type, spelling, 3)
    set_window_mix(model, _random_mix(model))
    set_window_mix(reference, window_mixes(model))
    inputs = tiny_inputs(model_type, length=14)
    inputs["attention_mask"][1, :4] = 0
    got, want = logits_and_grads(model, inputs), logits_and_grads(reference, inputs)
    assert_same_step(got, want, logits_atol=1e-9 * want[0].abs().max().item(), grads_relative=1e-9, grads_floor=1e-15)
    with torch.no_grad():
        unmixed = hf_knorm.patch(tiny_model(model_type, dtype=torch.float64), spelling, softmax_window=3)(
            **tiny_inputs(model_type, length=14)).logits
    assert (got[0] - unmixed).abs().max() > 1e-3  # the mix changed the function


def test_the_window_alone_is_the_mix_at_zero_and_the_mix_comes_back():
    model = hf_knorm.patch(tiny_model("llama", dtype=torch.float64), "x^3/16", softmax_window=3)
    mix = _random_mix(model)
    set_window_mix(model, mix)
    ids = tiny_inputs("llama", batch=1, length=14)["input_ids"]
    with torch.no_grad():
        mixed = model(input_ids=ids).logits
        with distant_part_off(model):
            alone = model(input_ids=ids).logits
        assert window_mixes(model) == [m.tolist() for m in mix]
        torch.testing.assert_close(model(input_ids=ids).logits, mixed, rtol=0, atol=0)
        set_window_mix(model, [torch.zeros_like(m) for m in mix])
        torch.testing.assert_close(model(input_ids=ids).logits, alone, rtol=0, atol=0)
        # the window alone: the first W tokens see only their window, so they match whatever the mix
        torch.testing.assert_close(alone[:, :3], mixed[:, :3], rtol=0, atol=1e-12)


def test_a_mix_is_saved_reloaded_exactly_and_removed_by_unpatch(tmp_path):
    model = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=4)
    set_window_mix(model, _random_mix(model))
    ids = tiny_inputs("llama", batch=1, length=14)["input_ids"]
    model.save_pretrained(tmp_path)
    reloaded = hf_knorm.from_pretrained(tmp_path)
    assert window_mixes(reloaded) == window_mixes(model)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
        # the reloaded model decodes with the constant-size state (window keys + state) and the same mix as the
        # original's full forward; without the mix the logits would be others
        generated = reloaded.generate(input_ids=ids[:, :6], max_new_tokens=8, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        layers = output_cache(generated).layers
        assert len(layers) == reloaded.config.num_hidden_layers
        assert all(isinstance(layer, WindowStateLayer) for layer in layers)
        decoded = torch.stack(generated.logits, dim=1)
        full = model(input_ids=generated.sequences[:, :-1]).logits[:, 5:]
        torch.testing.assert_close(decoded, full, rtol=0, atol=ATOL)
        unmixed = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=4)(
            input_ids=generated.sequences[:, :-1]).logits[:, 5:]
        assert (unmixed - decoded).abs().max() > 100 * ATOL
    hf_knorm.unpatch(model)
    assert "window_mix" not in (getattr(model.config, "hf_knorm", None) or {})


@pytest.mark.parametrize("mix, message", [
    ([[1.0] * 4], "attention layers"),
    ("heads", "query heads"),
    ("nan", "not finite"),
])
def test_a_bad_mix_is_refused(mix, message):
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16", softmax_window=3)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    if mix == "heads":
        mix = [[1.0] * (heads + 1)] * layers
    elif mix == "nan":
        mix = [[float("nan")] * heads] * layers
    with pytest.raises(ValueError, match=message):
        set_window_mix(model, mix)
    with pytest.raises(ValueError, match="softmax window"):
        set_window_mix(hf_knorm.patch(tiny_model("llama"), "x^3/16"), None)


# --- host synchronizations per decoded token -------------------------------------------------------------------------

class _HostReads:
    """Counts what reads a tensor's values to the host (a synchronization on an accelerator) in the plugin's
    attention code (a frame of ``hf_knorm/attention`` on the stack): ``item``, ``bool``, ``int``, ``float``
    (``aten._local_scalar_dense``), ``torch.equal``, ``nonzero`` and ``tolist``."""

    OPS = ("aten._local_scalar_dense", "aten.equal", "aten.nonzero", "aten.is_nonzero")

    def __init__(self):
        self.where = []

    def note(self):
        import traceback

        frames = [f"{frame.filename.split('hf_knorm/')[-1]}:{frame.lineno}" for frame in traceback.extract_stack()
                  if "hf_knorm/attention/" in frame.filename.replace("\\", "/")]
        if frames:
            self.where.append(frames[-1])

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if str(func).rsplit(".", 1)[0] in reads.OPS:  # "aten.equal.default" -> "aten.equal"
                    reads.note()
                return func(*args, **(kwargs or {}))

        self._tolist = torch.Tensor.tolist

        def tolist(tensor):
            reads.note()
            return reads._tolist(tensor)

        torch.Tensor.tolist = tolist
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist


@pytest.mark.parametrize("spelling, cache, reads", [
    ("x/1 + softmax window 4 + sinks 2", "state", 1),  # whether the step's keys are all real
    ("x^3/16 + softmax window 4 + sinks 2", "kv", 2),  # that, and whether its older keys are (the batch is padded)
])
def test_a_decoded_token_reads_the_device_once_per_forward_not_per_layer(spelling, cache, reads):
    """One decoding step of a tiny windowed model with sinks, on a left-padded batch (the sinks complete since the
    prefill): the plugin reads values to the host ``reads`` times in the whole forward, whatever the number of
    layers (the answers about the mask every layer shares are remembered for the forward; the path is chosen once per
    call; a single query row gives the kernels nothing to trim). Before: 3 reads per layer with the state (6 here),
    4 per layer with the K/V cache (8)."""
    from hf_knorm.recurrent.cache import RecurrentStateCache
    from transformers import DynamicCache

    model = hf_knorm.patch(tiny_model("llama"), spelling)
    inputs = tiny_inputs("llama", length=12)
    inputs["attention_mask"][1, :3] = 0
    kept = RecurrentStateCache(config=model.config) if cache == "state" else DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(**inputs, use_cache=True, **cache_kwargs(kept))
        if cache == "state":
            assert len(kept.layers) == model.config.num_hidden_layers
            assert all(layer.sinks_complete for layer in kept.layers)
        step = dict(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **cache_kwargs(output_cache(out)),
                    attention_mask=torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1))
        with _HostReads() as host:
            model(**step)
    assert model.config.num_hidden_layers >= 2
    assert len(host.where) == reads, host.where


# --- the GPU kernels ------------------------------------------------------------------------------------------------

@pytest.fixture
def gpu_kernels(monkeypatch):
    """The CUDA choices of ``backends.py`` on the CPU (its device seam set to "cuda", the packages importable), with
    the Triton and flash-linear-attention entry points replaced by spies that note each call and compute it with the
    PyTorch kernels (the same contract): which part of a windowed call reaches which GPU kernel, and with what. The
    tiny models are fp32: TF32 is asked for, as fla takes fp32 calls only then (``backends.tf32_blocker``)."""
    from hf_knorm.attention import backends, fla_linear, triton_kernel
    from hf_knorm.attention.kernel import chunked_attention
    from hf_knorm.attention.linear_kernel import linear_attention

    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    monkeypatch.setattr(backends, "_device_type", lambda tensor: "cuda")
    monkeypatch.setattr(backends, "_importable", lambda module: True)
    backends._CHOSEN.set({"quadratic": "auto", "linear": "auto"})
    monkeypatch.setattr(backends, "verdict", lambda *args: "")  # proven (the self-check is test_backends.py's)
    calls = []

    def triton(query, key, value, allowed, normalization, **options):
        calls.append(("triton", normalization.name, allowed is not None, options.get("causal")))
        return chunked_attention(query, key, value, allowed, normalization, **options)[0]

    def fla(query, key, value, key_valid, normalization, **options):
        calls.append(("fla", normalization.name, options.get("initial_state") is not None, options.get("return_state")))
        return linear_attention(query, key, value, key_valid, normalization, **options)

    monkeypatch.setattr(triton_kernel, "triton_attention", triton)
    monkeypatch.setattr(fla_linear, "fla_linear_attention", fla)
    return calls


@pytest.mark.parametrize("model_type, spelling, length, kernel", [
    ("llama", "x^3/16 + softmax window 4 + sinks 2", 12, "triton"),  # key padding: the band and the older keys
    ("mistral", "x^3/sqrtN + softmax window 3", 12, "triton"),  # the model's own sliding window: explicit masks
    ("llama", "x/1 + softmax window 8 + sinks 2", 140, "fla"),  # the linear path
])
def test_the_polynomial_part_runs_on_the_gpu_kernel_the_pure_normalization_would(gpu_kernels, model_type, spelling,
                                                                                   length, kernel):
    """A windowed call takes the kernel choice of the pure normalization for its polynomial part (and the softmax part
    that of a pure softmax call: the PyTorch kernel today); ``attention_paths()`` counts the kernel that ran. The
    spies compute what the PyTorch kernels would: the logits are those of the PyTorch run."""
    model = hf_knorm.patch(tiny_model(model_type), spelling)
    inputs = tiny_inputs(model_type, length=length)
    inputs["attention_mask"][1, :3] = 0
    with torch.no_grad(), attention_paths() as taken:
        logits = model(**inputs).logits
    layers = model.config.num_hidden_layers
    assert dict(taken) == {kernel: layers}
    polynomial = normalization_of(model.model.layers[0].self_attn).without_window.name
    assert [call[:2] for call in gpu_kernels] == [(kernel, polynomial)] * layers
    from hf_knorm.attention import backends

    backends._CHOSEN.set({**backends.chosen_kernels(), "quadratic": "pytorch", "linear": "pytorch"})
    with torch.no_grad():
        torch.testing.assert_close(logits, model(**inputs).logits, rtol=0, atol=0)


def test_decoding_continues_the_state_on_the_gpu_kernel(gpu_kernels):
    """``generate`` on a p = 1 windowed model with sinks: every step's polynomial part goes to flash-linear-attention
    with the state of the keys older than the window, and returns the new one (to the window cache)."""
    model = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=4, attention_sinks=2)
    ids = tiny_inputs("llama", batch=1, length=8)["input_ids"]
    with torch.no_grad(), attention_paths() as taken:
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    layers = model.config.num_hidden_layers
    assert dict(taken) == {"fla": 3 * layers}  # the prompt and two decoded tokens, each layer
    assert gpu_kernels == [("fla", "x/1", step > 0, True) for step in range(3) for _ in range(layers)]


def test_a_forced_gpu_kernel_serves_the_polynomial_part_and_leaves_the_softmax_part_alone(gpu_kernels):
    """``kernels(quadratic="triton")`` on a windowed model: the polynomial part runs on Triton and the softmax
    part on the PyTorch kernel (Triton computes no softmax, so the forced kernel is not asked to and does not refuse)."""
    from hf_knorm.attention import backends

    backends._CHOSEN.set({**backends.chosen_kernels(), "quadratic": "triton"})
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16 + softmax window 4 + sinks 2")
    with torch.no_grad(), attention_paths() as taken:
        model(**tiny_inputs("llama", length=12))
    layers = model.config.num_hidden_layers
    assert dict(taken) == {"triton": layers}
    assert [call[:2] for call in gpu_kernels] == [("triton", "x^3/16")] * layers

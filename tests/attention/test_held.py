"""The typed normalization is what the attention reads at run time (``hf_knorm/attention/held.py``): held by every
attention module from ``patch`` or a load on, never parsed per call; modes are context variables, so two threads
running one model in different modes (or with different kernels) each get their own results."""

import threading

import pytest
import torch
from tiny_models import tiny_inputs, tiny_model

import hf_knorm
from hf_knorm.attention import backends
from hf_knorm.attention.held import HELD, held_by
from hf_knorm.models.architectures import attention_modules
from hf_knorm.models.cluster_codebook import clusters_off, fit_cluster_codebook
from hf_knorm.models.patching import held_normalization
from hf_knorm.normalizations import registry

CLUSTERED = "x/1 + softmax window 3 + sinks 1 + sparse 2 (key_norm) + clusters 4"


def _no_parsing(monkeypatch):
    def refuse(spelling):
        raise AssertionError(f"parsed {spelling!r} during a forward")

    monkeypatch.setattr(registry, "_parse_text", refuse)


def test_patch_holds_the_typed_object_and_a_forward_parses_nothing(monkeypatch):
    normalization = hf_knorm.Sigmoid()
    model = hf_knorm.patch(tiny_model("llama"), normalization)
    assert all(held_by(module) == normalization for _, module in attention_modules(model))
    _no_parsing(monkeypatch)
    with torch.no_grad():
        assert torch.isfinite(model(**tiny_inputs("llama", length=9)).logits).all()
    hf_knorm.unpatch(model)
    assert all(HELD not in vars(module) for _, module in attention_modules(model))


def test_a_loaded_model_holds_what_its_config_names(tmp_path, monkeypatch):
    """Parsed once, when Transformers builds the model (the build hook), not in its forwards."""
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16 + softmax window 3 + sinks 1")
    model.save_pretrained(tmp_path)
    loaded = hf_knorm.from_pretrained(tmp_path)
    assert held_normalization(loaded) == held_normalization(model)
    _no_parsing(monkeypatch)
    inputs = tiny_inputs("llama", length=9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_a_config_edited_by_hand_is_refused_with_the_fix():
    model = tiny_model("llama")
    model.config.hf_knorm = {"normalization": "x^3/16"}
    model.set_attn_implementation("hf_knorm")
    with torch.no_grad(), pytest.raises(RuntimeError, match="holds no hf_knorm normalization.*'x\\^3/16'.*hf_knorm.patch"):
        model(**tiny_inputs("llama", length=5))


def _run_in_threads(first, second):
    """Run ``first`` and ``second`` in two threads that overlap: each enters its mode, waits for the other, then runs
    its forward while the other's mode is active. Returns their results."""
    barrier = threading.Barrier(2, timeout=60)
    results, errors = {}, []

    def run(name, job):
        try:
            results[name] = job(barrier)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(name, job)) for name, job in (("first", first), ("second", second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results["first"], results["second"]


def test_two_threads_run_one_model_with_and_without_its_clusters():
    model = fit_cluster_codebook(hf_knorm.patch(tiny_model("llama"), CLUSTERED),
                                 torch.randint(3, 128, (3, 16), generator=torch.Generator().manual_seed(5)))
    inputs = tiny_inputs("llama", length=14)
    with torch.no_grad():
        plain = model(**inputs).logits
        with clusters_off(model):
            without = model(**inputs).logits
    assert not torch.equal(plain, without)  # the clusters change the output: the test can tell the modes apart

    def off(barrier):
        with clusters_off(model), torch.no_grad():
            barrier.wait()  # the other thread runs its forward while this block is open
            logits = model(**inputs).logits
            barrier.wait()
            return logits

    def on(barrier):
        barrier.wait()
        with torch.no_grad():
            logits = model(**inputs).logits
        barrier.wait()
        return logits

    got_off, got_on = _run_in_threads(off, on)
    torch.testing.assert_close(got_off, without, rtol=0, atol=0)
    torch.testing.assert_close(got_on, plain, rtol=0, atol=0)
    assert model.config.hf_knorm["normalization"] == CLUSTERED  # the config was never rewritten


def test_two_threads_choose_their_kernels():
    """``kernels()`` is a context variable: a thread inside ``kernels(quadratic="pytorch")`` runs the chunked kernel
    while another runs SDPA (the automatic choice for softmax on the CPU), at the same time."""
    model = hf_knorm.patch(tiny_model("llama"), "softmax")
    inputs = tiny_inputs("llama", length=9)
    layers = model.config.num_hidden_layers

    def forced(barrier):
        with backends.kernels(quadratic="pytorch"), hf_knorm.attention_paths() as paths, torch.no_grad():
            barrier.wait()
            model(**inputs)
            barrier.wait()
            return dict(paths), backends.chosen_kernels()

    def automatic(barrier):
        barrier.wait()
        with hf_knorm.attention_paths() as paths, torch.no_grad():
            model(**inputs)
        barrier.wait()
        return dict(paths), backends.chosen_kernels()

    (forced_paths, forced_choice), (auto_paths, auto_choice) = _run_in_threads(forced, automatic)
    assert forced_paths == {"quadratic": layers} and forced_choice["quadratic"] == "pytorch"
    assert auto_paths == {"sdpa": layers} and auto_choice["quadratic"] == "auto"

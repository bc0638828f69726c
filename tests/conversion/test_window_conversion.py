"""Conversion with a softmax window (the default): the mix solved in closed form, saved and reloaded, the twin left
out; the evaluation beyond the window (1,024-token blocks from position 256, retrieval, the window alone) in
``convert.json`` and the card."""

from __future__ import annotations

import json
from dataclasses import replace
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from card_values import stated_beyond_window, two_decimals  # noqa: E402
from training_helpers import lm  # noqa: E402

import hf_knorm  # noqa: E402
from hf_knorm.conversion.beyond_window import START  # noqa: E402
from hf_knorm.conversion.state import STATE_FILE  # noqa: E402
from hf_knorm.jobs.convert import RESULT_FILE, run_convert  # noqa: E402
from hf_knorm.conversion.settings import ConvertSettings  # noqa: E402
from hf_knorm.conversion.transfer import AttentionTransfer  # noqa: E402
from hf_knorm.evaluation.needle import is_correct  # noqa: E402
from hf_knorm.models.window_mix import distant_part_off, set_window_mix, window_mixes  # noqa: E402

from test_conversion import _ids, _settings, texts, tiny_lm_dir  # noqa: E402,F401


def _transfer_error(model, transfer, ids) -> float:
    with torch.no_grad(), transfer.teaching():
        model(input_ids=ids)
        return float(transfer.loss())


@pytest.mark.parametrize("normalization", ["x^3/16", "x/1"])
def test_match_mix_is_each_heads_least_squares_optimum_and_leaves_the_projections(normalization):
    model = lm().eval()
    transfer = AttentionTransfer(model)
    hf_knorm.patch(model, normalization, softmax_window=4)
    ids = _ids(length=40)
    weights = {name: p.clone() for name, p in model.named_parameters()}
    at_one = _transfer_error(model, transfer, ids)
    with distant_part_off(model):
        alone = _transfer_error(model, transfer, ids)
    mixes = transfer.match_mix(model, ids)
    solved = _transfer_error(model, transfer, ids)
    assert solved < min(at_one, alone)
    assert window_mixes(model) == [mix.tolist() for mix in mixes]
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters()  # q/k/v/o untouched
               if "hf_knorm_window_mix" not in name)  # the mix is the parameter it solves
    for layer in range(len(mixes)):  # moving any head's mix away from the solution raises the error
        for sign in (-1, 1):
            moved = [mix.clone() for mix in mixes]
            moved[layer][0] += sign * 0.05 * (moved[layer][0].abs() + 1e-3)
            set_window_mix(model, moved)
            assert _transfer_error(model, transfer, ids) > solved - 1e-7
    set_window_mix(model, mixes)
    again = transfer.match_mix(model, ids)  # solved from m = 1 each time: the same mix
    for first, second in zip(mixes, again):
        torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-9)


def test_match_scale_refuses_a_window():
    model = lm().eval()
    transfer = AttentionTransfer(model)
    hf_knorm.patch(model, "x^3/16", softmax_window=4)
    with pytest.raises(ValueError, match="match_mix"):
        transfer.match_scale(model, _ids())


def test_a_windowed_conversion_saves_its_mix_and_measures_beyond_the_window(tiny_lm_dir, texts, tmp_path):
    out = tmp_path / "run"
    settings = _settings(tiny_lm_dir, texts, out, softmax_window=8, eval_domains=("essays",), eval_tokens=512,
                         retrieval_lengths=(400,), beyond_window_block=768)  # not the default 1,024: it is used
    summary = run_convert(settings)
    record = json.loads((out / RESULT_FILE).read_text())
    assert record["normalization"] == "x^3/16 + softmax window 8 + sinks 4"
    assert record["trained_as"] == record["normalization"]  # no twin: the constant would scale the window's scores
    transfer = record["stages"]["transfer"]
    assert len(transfer["initial_window_mix"]) == 2 and transfer["window_mix"] != transfer["initial_window_mix"]
    reloaded = hf_knorm.from_pretrained(out)
    assert window_mixes(reloaded) == transfer["window_mix"]  # the mix solved after the transfer, kept by recovery

    beyond = record["beyond_window"]
    assert beyond["block_size"] == 768 and beyond["first_scored_position"] == START
    essays = beyond["domains"]["essays"]
    assert essays["ratio_to_original"] == pytest.approx(essays["perplexity"] / essays["original_perplexity"])
    for who in ("original", "converted", "window_only"):  # each count is a recount of the saved answers' texts
        hits, cells = beyond["retrieval"][who]["passkey"]["400"]
        answers = beyond["answers"][who]
        assert cells == len(answers) == 8 and {(a["task"], a["length"]) for a in answers} == {("passkey", 400)}
        assert hits == sum(is_correct(a["answer"], a["expected"]) for a in answers)
    assert summary["beyond_window"]["worst_ratio"] == essays["ratio_to_original"]
    assert beyond["window_only_is_converted"] is False  # the mix is not 0: the ablation was measured
    card = (out / "README.md").read_text()
    assert stated_beyond_window(card) == {
        "worst_domain": beyond["worst_domain"], "worst_ratio": two_decimals(beyond["worst_ratio"]),
        "window_only_worst_ratio": two_decimals(beyond["window_only_worst_ratio"])}

    # the reloaded model's beyond-window perplexity is what the record says: scored from position START only
    from hf_knorm.conversion.beyond_window import beyond_window_blocks, beyond_window_perplexities

    tokenizer = hf_knorm.models.persistence.load_model(str(out))[1]
    blocks = beyond_window_blocks(["essays"], tokenizer, 512, 768)  # one block: max(eval tokens, block) tokens
    assert len(blocks["essays"]) == 1 and len(blocks["essays"][0]["input_ids"]) == 768
    assert all(label == -100 for label in blocks["essays"][0]["labels"][:START])
    assert all(label != -100 for label in blocks["essays"][0]["labels"][START:])
    assert beyond_window_perplexities(reloaded.eval(), blocks, "reloaded")["essays"] == pytest.approx(
        essays["perplexity"], rel=1e-5)
    # ... and the window alone's is the reloaded model's with every head's mix set to 0
    set_window_mix(reloaded, [[0.0] * len(layer) for layer in transfer["window_mix"]])
    assert beyond_window_perplexities(reloaded, blocks, "mix 0")["essays"] == pytest.approx(
        essays["window_only_perplexity"], rel=1e-5)


@pytest.mark.parametrize("block", [START, 0, 1024.5, True])
def test_a_beyond_window_block_with_nothing_to_score_is_refused_before_anything_runs(tiny_lm_dir, texts, tmp_path,
                                                                                     block):
    settings = _settings(tiny_lm_dir, texts, tmp_path / "run", softmax_window=8, eval_domains=("essays",),
                         beyond_window_block=block)
    with pytest.raises(ValueError, match=f"beyond_window_block must be an integer above {START}"):
        run_convert(settings)
    assert not (tmp_path / "run").exists()
    assert ConvertSettings().beyond_window_block == 1024  # convert's default, as its results are quoted


def test_the_window_and_the_spelling_must_agree(tiny_lm_dir, texts, tmp_path):
    settings = _settings(tiny_lm_dir, texts, tmp_path / "run", normalization="x^3/16 + softmax window 32",
                         softmax_window=64)
    with pytest.raises(ValueError, match="contradicts"):
        run_convert(settings)
    assert ConvertSettings().target().name == "x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff) + " \
        "clusters 600"


def test_the_sinks_are_resolved_once_from_the_flag_and_the_spelling():
    from hf_knorm.conversion.settings import DEFAULT_ATTENTION_SINKS

    default = ConvertSettings().target()
    assert (default.window, default.sinks) == (64, DEFAULT_ATTENTION_SINKS)
    cubic = dict(normalization="x^3/16", sparse_cache=0)
    assert ConvertSettings(attention_sinks=2, **cubic).target().name == "x^3/16 + softmax window 64 + sinks 2"
    assert ConvertSettings(softmax_window=0).target().name == "x/1"  # no window: no default sinks, no sparse cache
    spelled = ConvertSettings(normalization="x/1 + softmax window 64 + sinks 3").target()
    assert spelled.sinks == 3  # the spelling's sinks kept when the flag is not given
    with pytest.raises(ValueError, match="without a softmax window"):
        ConvertSettings(softmax_window=0, attention_sinks=4).target()
    with pytest.raises(ValueError, match="contradicts"):
        ConvertSettings(normalization="x/1 + softmax window 64 + sinks 3", attention_sinks=1).target()


def test_the_sparse_cache_is_resolved_once_from_the_flags_and_the_spelling():
    from hf_knorm.conversion.settings import DEFAULT_SPARSE_CACHE, DEFAULT_SPARSE_SCORE

    default = ConvertSettings().target()
    assert (default.sparse, default.score) == (DEFAULT_SPARSE_CACHE, DEFAULT_SPARSE_SCORE)
    assert ConvertSettings(sparse_cache=0).target().name == "x/1 + softmax window 64 + sinks 4"  # one flag away
    assert ConvertSettings(sparse_cache=32, sparse_score="key_norm", clusters=0).target().name == \
        "x/1 + softmax window 64 + sinks 4 + sparse 32 (key_norm)"
    spelled = "relu(x)^2/n + softmax window 64 + sinks 4 + sparse 16 (key_norm)"
    assert ConvertSettings(normalization=spelled).target().name == spelled  # the spelling's cache kept
    assert ConvertSettings(normalization=spelled, sparse_cache=16, sparse_score="key_norm").target().name == spelled
    for overrides, message in [
        (dict(normalization=spelled, sparse_cache=8), "already has a sparse cache of 16 pairs"),
        (dict(normalization=spelled, sparse_score="value_over_key"), "contradict it"),
        (dict(softmax_window=0, sparse_cache=8), "without a softmax window"),
        (dict(sparse_cache=0, sparse_score="key_norm"), "without a sparse cache"),
        (dict(sparse_score="kv_diff"), "cannot be chosen the same way"),
        (dict(sparse_cache=-1), "integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            ConvertSettings(**overrides).target()


def test_the_clusters_are_resolved_once_beside_a_sparse_cache_the_spelling_does_not_give():
    from hf_knorm.conversion.settings import DEFAULT_CLUSTERS

    default = ConvertSettings()
    assert default.target().name == f"x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters " \
        f"{DEFAULT_CLUSTERS}"
    assert default.resolved(default.target()).clusters == DEFAULT_CLUSTERS  # recorded: a resumed run keeps them
    assert ConvertSettings(clusters=0).target().name == "x/1 + softmax window 64 + sinks 4 + sparse 256 " \
        "(prefix_kv_diff)"  # the sparse cache alone: one flag away
    assert ConvertSettings(sparse_cache=32).target().clusters == DEFAULT_CLUSTERS  # a cache from the flags
    assert ConvertSettings(sparse_cache=0).target().clusters == 0  # no cache for them to sit beside
    assert ConvertSettings(softmax_window=0).target().name == "x/1"
    spelled = "x/1 + softmax window 64 + sinks 4 + sparse 16 (key_norm)"
    assert ConvertSettings(normalization=spelled).target().name == spelled  # the spelling says what it holds
    assert ConvertSettings(normalization=spelled, clusters=8).target().clusters == 8


def test_clusters_on_a_model_with_a_softcap_are_refused_before_it_loads(texts, tmp_path):
    """Gemma 2 bends each score by a softcap, where a cluster's mean key does not give its pairs' mean score: the
    default's clusters are refused with what to pass instead, before the model or the data are read."""
    from training_helpers import char_tokenizer, tiny_model

    folder = tmp_path / "gemma2"
    tiny_model("gemma2").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    with pytest.raises(ValueError, match=r"softcap .*Pass --clusters 0"):
        run_convert(_settings(folder, texts, tmp_path / "out", normalization="x/1", softmax_window=8, sparse_cache=4))
    assert not (tmp_path / "out").exists()


def test_the_default_recipe_converts_with_a_sparse_cache_that_holds_every_older_key_of_a_training_block(
        tiny_lm_dir, texts, tmp_path):
    """The defaults' sparse cache (256 pairs) holds every key older than the window of a training block (here 32
    tokens, window 8, 4 sinks): no key is left to the distant part, its mix solves to exactly 0 and the converted
    model is its window alone (the clusters off: the cache alone); a cache smaller than the older keys leaves the
    distant part work."""
    from hf_knorm.conversion.settings import DEFAULT_NORMALIZATION

    out = tmp_path / "default"
    run_convert(_settings(tiny_lm_dir, texts, out, normalization=DEFAULT_NORMALIZATION, sparse_cache=None,
                          softmax_window=8, clusters=0, eval_domains=("essays",), eval_tokens=512,
                          retrieval_lengths=(400,)))
    record = json.loads((out / RESULT_FILE).read_text())
    assert record["normalization"] == "x/1 + softmax window 8 + sinks 4 + sparse 256 (prefix_kv_diff)"
    transfer = record["stages"]["transfer"]
    assert torch.tensor(transfer["initial_window_mix"]).abs().max() == 0
    assert torch.tensor(transfer["window_mix"]).abs().max() == 0
    reloaded = hf_knorm.from_pretrained(out)
    assert hf_knorm.patched_normalization(reloaded) == record["normalization"]
    essays = record["beyond_window"]["domains"]["essays"]
    beyond = record["beyond_window"]
    assert essays["perplexity"] == essays["window_only_perplexity"]  # the mix is 0: the same model, measured once
    assert beyond["window_only_is_converted"] and beyond["answers"]["window_only"] == beyond["answers"]["converted"]

    smaller = tmp_path / "sparse4"
    run_convert(_settings(tiny_lm_dir, texts, smaller, normalization=DEFAULT_NORMALIZATION, sparse_cache=4,
                          clusters=0, softmax_window=8, beyond_window=False))
    record = json.loads((smaller / RESULT_FILE).read_text())
    assert record["normalization"] == "x/1 + softmax window 8 + sinks 4 + sparse 4 (prefix_kv_diff)"
    assert torch.tensor(record["stages"]["transfer"]["window_mix"]).abs().max() > 0


def test_a_run_started_before_the_sparse_default_is_not_resumed_with_it(tiny_lm_dir, texts, tmp_path):
    """A run whose settings record predates ``--sparse-cache`` had no sparse cache unless it spelled one; resumed
    with today's default (256 pairs) it would train another model: refused as a change of settings. One that spelled
    its cache resumes."""
    from hf_knorm.conversion.state import write_state
    from hf_knorm.jobs.convert import check_settings
    from hf_knorm.runs.run_folder import settings_record

    out = tmp_path / "old"
    old = _settings(tiny_lm_dir, texts, out, softmax_window=8, sparse_cache=None, resume=True)
    record = {name: value for name, value in settings_record(old.resolved(old.target())).items()
              if name not in ("sparse_cache", "sparse_score", "clusters")}
    out.mkdir()
    write_state(out, {"settings": record})
    with pytest.raises(ValueError, match="these differ: sparse_cache: 0 then, None now"):
        check_settings(old)
    assert check_settings(replace(old, sparse_cache=0)).name == "x^3/16 + softmax window 8 + sinks 4"
    cached = {**record, "sparse_cache": 256, "sparse_score": "prefix_kv_diff"}  # before the clusters' default
    write_state(out, {"settings": cached})
    with pytest.raises(ValueError, match="these differ: clusters: 0 then, 600 now"):
        check_settings(replace(old, sparse_cache=256))
    assert check_settings(replace(old, sparse_cache=256, clusters=0)).name.endswith("sparse 256 (prefix_kv_diff)")
    spelled = replace(old, normalization="x/1 + softmax window 8 + sparse 4 (key_norm)")
    write_state(out, {"settings": {**record, "normalization": spelled.normalization}})
    assert check_settings(spelled).name == "x/1 + softmax window 8 + sinks 4 + sparse 4 (key_norm)"


def test_a_run_resumes_with_the_sparse_score_it_started_with(tiny_lm_dir, texts, tmp_path, monkeypatch):
    """A run records its sparse cache's score resolved, so a later default cannot resume it with another score. A
    record from before that (``sparse_score`` left at ``None``) ran with ``value_over_key``, the default then: under
    another default it is refused, and resumes with ``--sparse-score value_over_key``."""
    from hf_knorm.conversion import settings as settings_module
    from hf_knorm.conversion.state import write_state
    from hf_knorm.jobs.convert import check_settings
    from hf_knorm.runs.run_folder import settings_record

    out = tmp_path / "scored"
    run = _settings(tiny_lm_dir, texts, out, normalization="x/1", softmax_window=8, sparse_cache=None, resume=True)
    record = settings_record(run.resolved(run.target()))
    assert record["sparse_score"] == settings_module.DEFAULT_SPARSE_SCORE
    out.mkdir()
    write_state(out, {"settings": {**record, "sparse_score": None}})
    monkeypatch.setattr(settings_module, "DEFAULT_SPARSE_SCORE", "key_norm")  # a later default
    with pytest.raises(ValueError, match="sparse_score: 'value_over_key' then, 'key_norm' now"):
        check_settings(run)
    assert check_settings(replace(run, sparse_score="value_over_key")).score == "value_over_key"
    write_state(out, {"settings": record})  # recorded resolved: the same check, without the migration
    with pytest.raises(ValueError, match=f"sparse_score: '{record['sparse_score']}' then, 'key_norm' now"):
        check_settings(run)


def test_clusters_are_fitted_before_the_recovery_saved_and_ablated_with_the_distant_part(tiny_lm_dir, texts,
                                                                                         tmp_path):
    """``--clusters 4``: the transfer trains without them (``trained_as``), their codebooks are fitted on the
    transferred model's keys (the essays' first ``--cluster-tokens``), the recovery trains and evaluates with them
    (its 32-token blocks are longer than W + S + K = 16: they hold pairs) and they are saved; every figure of the record
    is the clustered model's, and the window alone is the model with its mix at 0 and its clusters off."""
    from hf_knorm.conversion.beyond_window import beyond_window_blocks, beyond_window_perplexities
    from hf_knorm.conversion.clusters import add_clusters
    from hf_knorm.conversion.settings import DEFAULT_NORMALIZATION
    from hf_knorm.models.cluster_codebook import clusters_off

    out = tmp_path / "clustered"
    run_convert(_settings(tiny_lm_dir, texts, out, normalization=DEFAULT_NORMALIZATION, sparse_cache=4, clusters=4,
                          softmax_window=8, eval_domains=("essays",), eval_tokens=512, retrieval_lengths=(400,),
                          beyond_window_block=768, cluster_tokens=600))
    record = json.loads((out / RESULT_FILE).read_text())
    assert record["normalization"] == "x/1 + softmax window 8 + sinks 4 + sparse 4 (prefix_kv_diff) + clusters 4"
    assert record["trained_as"] == "x/1 + softmax window 8 + sinks 4 + sparse 4 (prefix_kv_diff)"
    reloaded = hf_knorm.from_pretrained(out).eval()
    assert hf_knorm.patched_normalization(reloaded) == record["normalization"]
    codebooks = [value.clone() for name, value in reloaded.named_parameters() if name.endswith("cluster_codebook")]
    tokenizer = hf_knorm.models.persistence.load_model(str(out))[1]
    transferred = hf_knorm.from_pretrained(out / "transfer" / "model")
    assert hf_knorm.patched_normalization(transferred) == record["trained_as"]
    refitted = lambda: [value for name, value in transferred.named_parameters() if name.endswith("cluster_codebook")]
    add_clusters(transferred, tokenizer, 4, tokens=600)  # fitted again on the transferred model's keys: the same
    assert all(torch.equal(a, b) for a, b in zip(codebooks, refitted()))
    add_clusters(transferred, tokenizer, 4)  # the default's 2,048 tokens: other codebooks (the flag was read)
    assert not all(torch.equal(a, b) for a, b in zip(codebooks, refitted()))
    state = json.loads((out / STATE_FILE).read_text())  # the recovery's step 0: evaluated again, with the clusters
    assert state["recovery"]["curves"]["essays"][0][0] == 0
    assert state["recovery"]["curves"]["essays"][0][2] != pytest.approx(state["transfer"]["curves"]["essays"][-1][2])
    essays = record["beyond_window"]["domains"]["essays"]
    assert record["beyond_window"]["window_only_is_converted"] is False
    blocks = beyond_window_blocks(["essays"], tokenizer, 512, 768)
    assert beyond_window_perplexities(reloaded, blocks, "reloaded")["essays"] == pytest.approx(
        essays["perplexity"], rel=1e-5)
    with distant_part_off(reloaded):
        from hf_knorm.attention.interface import normalization_of

        running = normalization_of(reloaded.model.layers[0].self_attn)  # what the attention computes now
        assert running.name.endswith("sparse 4 (prefix_kv_diff)")  # the clusters off, in this context only
        assert hf_knorm.patched_normalization(reloaded) == record["normalization"]  # the config is not rewritten
        assert beyond_window_perplexities(reloaded, blocks, "window only")["essays"] == pytest.approx(
            essays["window_only_perplexity"], rel=1e-5)
    with clusters_off(reloaded):
        without = beyond_window_perplexities(reloaded, blocks, "no clusters")["essays"]
    assert without != pytest.approx(essays["perplexity"], rel=1e-4)  # the clusters are in the figures
    for overrides, message in [(dict(clusters=4, sparse_cache=0), "sparse cache leaves"),
                               (dict(normalization=record["normalization"], clusters=8), "already has 4 clusters")]:
        with pytest.raises(ValueError, match=message):
            ConvertSettings(**overrides).target()


def test_cluster_tokens_size_the_codebooks_fit_and_bad_values_are_refused(tiny_lm_dir, texts, tmp_path):
    from hf_knorm.conversion.clusters import calibration_ids
    from hf_knorm.jobs.convert import check_settings
    from hf_knorm.models.persistence import load_model

    tokenizer = load_model(str(tiny_lm_dir))[1]
    assert [len(ids) for ids in calibration_ids(tokenizer, 8, 1500)] == [1024, 476]
    assert [len(ids) for ids in calibration_ids(tokenizer, 300)] == [1024, 1024, 352]  # max(2048, 8 C) = 2,400
    with pytest.raises(ValueError, match="at least 8 calibration tokens"):
        calibration_ids(tokenizer, 8, 7)
    base = _settings(tiny_lm_dir, texts, tmp_path / "run", sparse_cache=4, clusters=8, softmax_window=8)
    with pytest.raises(ValueError, match=r"at least the number of clusters \(8"):
        check_settings(replace(base, cluster_tokens=7))
    with pytest.raises(ValueError, match="has no clusters"):
        check_settings(replace(base, clusters=0, cluster_tokens=512))
    assert check_settings(replace(base, cluster_tokens=8)).clusters == 8

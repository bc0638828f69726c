"""Conversion: attention transfer (loss falls, teacher outputs handed on, closed-form scale), LoRA merged before
saving, the converted folder reloads exactly, bad input refused before training, an interrupted run resumes."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from card_values import stated_twin  # noqa: E402
from training_helpers import char_tokenizer, lm, save_tiny_lm  # noqa: E402

import hf_knorm  # noqa: E402
from hf_knorm.assets.texts import SAMPLE_TEXT  # noqa: E402
from hf_knorm.jobs.convert import RESULT_FILE, STATE_FILE, run_convert  # noqa: E402
from hf_knorm.conversion.settings import ConvertSettings  # noqa: E402
from hf_knorm.conversion.trainers import DistillationTrainer, distillation_kl  # noqa: E402
from hf_knorm.conversion.transfer import AttentionTransfer  # noqa: E402
from hf_knorm.evaluation.perplexity import perplexity_of_windows  # noqa: E402
from hf_knorm.data.heldout import held_out_blocks  # noqa: E402
from hf_knorm.data.text_data import load_text_dataset  # noqa: E402


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    (folder / "train.txt").write_text((SAMPLE_TEXT + "\n") * 6)
    (folder / "heldout.txt").write_text(SAMPLE_TEXT[::-1] + "\n" + SAMPLE_TEXT + "\n")
    return folder


def _settings(tiny_lm_dir, texts, out, **overrides) -> ConvertSettings:
    values = dict(model=str(tiny_lm_dir), dataset=str(texts / "train.txt"), eval_dataset=str(texts / "heldout.txt"),
                  out=str(out), block_size=32, batch_size=2, eval_tokens=128, eval_steps=2, transfer_steps=4,
                  recovery_steps=4, logging_steps=2, save_steps=2, warmup_steps=0, report_to=("none",),
                  transfer_learning_rate=1e-2, recovery_learning_rate=1e-2, eval_domains=("none",), probe=False,
                  softmax_window=0, normalization="x^3/16", sparse_cache=0)
    # the pure x^3/16 (the defaults' window and sparse cache: test_window_conversion.py)
    values.update(overrides)
    return ConvertSettings(**values)


def _ids(seed=0, batch=4, length=24):
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- attention transfer ------------------------------------------------------------------------------------------

def test_inside_teaching_the_student_model_computes_the_original_models_logits():
    original = lm().eval()
    student = copy.deepcopy(original)
    transfer = AttentionTransfer(student)
    hf_knorm.patch(student, "x^3/16")
    ids = _ids()
    with torch.no_grad():
        expected = original(input_ids=ids).logits
        patched = student(input_ids=ids).logits
        with transfer.teaching():
            taught = student(input_ids=ids).logits
    assert not torch.allclose(patched, expected, atol=1e-3)  # the patch alone changes the model
    torch.testing.assert_close(taught, expected, atol=1e-5, rtol=1e-5)
    assert sorted(transfer.layer_errors) == list(range(len(hf_knorm.models.architectures.attention_modules(student))))


@pytest.mark.parametrize("batch", [1, 3])
def test_the_teacher_attends_causally_over_the_real_keys_of_a_padded_batch(batch):
    """The student's attention receives key padding (B, kv); the teacher (SDPA) must get the mask it stands for: a
    (1, kv) mask read as is would broadcast to bidirectional attention."""
    original = lm().eval()
    student = copy.deepcopy(original)
    transfer = AttentionTransfer(student)
    hf_knorm.patch(student, "x^3/16")
    ids = _ids(batch=batch)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        expected = original(input_ids=ids, attention_mask=mask).logits
        with transfer.teaching():
            taught = student(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(taught[:, 5:], expected[:, 5:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normalization", ["x^3/16", "relu(x)^2/n", "sigmoid(bias=-log n)", "softpick",
                                           "ssmax(scale=0.144)"])
def test_match_scale_is_the_least_squares_optimum_and_lowers_the_error(normalization):
    model = lm().eval()
    transfer = AttentionTransfer(model)
    hf_knorm.patch(model, normalization)
    ids = _ids()
    with torch.no_grad(), transfer.teaching():
        model(input_ids=ids)
        before = float(transfer.loss())
    transfer.match_scale(model, ids)
    with torch.no_grad(), transfer.teaching():
        model(input_ids=ids)
        after = float(transfer.loss())
    assert after < before
    again = transfer.match_scale(model, ids)  # already optimal: every head's best scale is now 1
    for scales in again:
        torch.testing.assert_close(scales, torch.ones_like(scales), atol=1e-4, rtol=0)


def _scaled_both_ways(normalization):
    """``(original, folded into o_proj, asked to fold into the scores, the latter's transfer, scales of the o_proj
    fold, ids)``: two copies of a tiny GQA model (4 query heads on 2 key/value heads) patched with ``normalization``,
    each head scale solved (each transfer built before patching: it keeps the original attention as the teacher)."""
    original = lm().eval()
    into_output, into_scores = copy.deepcopy(original), copy.deepcopy(original)
    transfers = {"output": AttentionTransfer(into_output), "scores": AttentionTransfer(into_scores)}
    hf_knorm.patch(into_output, normalization)
    hf_knorm.patch(into_scores, normalization)
    ids = _ids()
    scales = transfers["output"].match_scale(into_output, ids, fold="output")
    transfers["scores"].match_scale(into_scores, ids, fold="scores")
    return original, into_output, into_scores, transfers["scores"], scales, ids


@pytest.mark.parametrize("normalization", ["x^3/16", "x/1", "x^2/4", "x^3/sqrtN", "relu(x)^2/n", "relu(x)^3/16"])
def test_folding_the_scale_into_the_scores_computes_what_folding_it_into_o_proj_computes(normalization):
    original, into_output, into_scores, transfer, scales, ids = _scaled_both_ways(normalization)
    with torch.no_grad():
        torch.testing.assert_close(into_scores(input_ids=ids).logits, into_output(input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)
    module, untouched = hf_knorm.models.architectures.attention_modules(into_scores)[0][1], hf_knorm.models.architectures.attention_modules(original)[0][1]
    # o_proj keeps its size (only signs flip); the scale is in q and k
    torch.testing.assert_close(module.o_proj.weight.abs(), untouched.o_proj.weight.abs())
    assert not torch.allclose(module.q_proj.weight, untouched.q_proj.weight)
    assert not torch.allclose(module.k_proj.weight, untouched.k_proj.weight)
    if normalization in ("x^3/16", "x/1", "x^3/sqrtN"):  # odd powers: some heads start anti-aligned
        assert any(bool((layer < 0).any()) for layer in scales)  # signs were exercised
    again = transfer.match_scale(into_scores, ids)
    for layer in again:
        torch.testing.assert_close(layer, torch.ones_like(layer), atol=1e-4, rtol=0)


@pytest.mark.parametrize("normalization", ["sigmoid(bias=-log n)", "softpick"])
def test_a_family_not_homogeneous_in_the_scores_takes_its_scale_in_o_proj(normalization):
    """Scaling q by a factor does not scale sigmoid's or softpick's weights by a power of it: ``fold="scores"``
    leaves q and k alone and scales o_proj's columns, as ``fold="output"`` does."""
    original, into_output, asked_scores, _, _, _ = _scaled_both_ways(normalization)
    for (_, module), (_, same) in zip(hf_knorm.models.architectures.attention_modules(asked_scores),
                                      hf_knorm.models.architectures.attention_modules(into_output)):
        for name in ("q_proj", "k_proj", "o_proj"):
            assert torch.equal(getattr(module, name).weight, getattr(same, name).weight)
    untouched = hf_knorm.models.architectures.attention_modules(original)[0][1]
    changed = hf_knorm.models.architectures.attention_modules(asked_scores)[0][1]
    assert torch.equal(changed.q_proj.weight, untouched.q_proj.weight)
    assert not torch.equal(changed.o_proj.weight, untouched.o_proj.weight)


def test_match_scale_refuses_an_unpatched_student_and_an_unknown_fold():
    model = lm().eval()
    transfer = AttentionTransfer(model)
    with pytest.raises(ValueError, match="patched with a normalization other than softmax"):
        transfer.match_scale(model, _ids())
    hf_knorm.patch(model, "x^3/16")
    with pytest.raises(ValueError, match="fold must be one of"):
        transfer.match_scale(model, _ids(), fold="values")


@pytest.mark.parametrize("trainable", ["qk", "qkvo"])
def test_the_transfer_loss_falls_and_only_the_chosen_projections_change(trainable):
    model = lm().eval()
    transfer = AttentionTransfer(model, trainable)
    hf_knorm.patch(model, "x^3/16")
    ids = _ids(length=32)
    transfer.match_scale(model, ids)
    transfer.freeze_all_but_trainable(model)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.Adam(transfer.trainable_parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        with transfer.teaching():
            model(input_ids=ids, use_cache=False)
            loss = transfer.loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    for name, parameter in model.named_parameters():
        if name in frozen:
            assert torch.equal(parameter, frozen[name]), name
    changed = {name.split(".")[-2] for name, p in model.named_parameters() if p.requires_grad}
    assert changed == {f"{letter}_proj" for letter in trainable}


def test_transfer_rejects_unknown_projection_letters():
    with pytest.raises(ValueError, match="letters of 'qkvo'"):
        AttentionTransfer(lm(), "qz")


# --- distillation --------------------------------------------------------------------------------------------------

def test_distillation_kl_is_the_per_token_mean_of_the_textbook_sum():
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=generator), torch.randn(2, 5, 11, generator=generator)
    p = teacher.double().softmax(-1)
    expected = (p * (p.log() - student.double().log_softmax(-1))).sum(-1).mean()  # KL(teacher || student) per token
    assert float(distillation_kl(student, teacher)) == pytest.approx(float(expected), rel=1e-5)
    assert float(distillation_kl(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)
    labels = torch.tensor([[1, 2, -100, 4, 5], [-100, 6, 7, 8, -100]])  # position t counts when label t+1 is scored
    kept = [(0, 0), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    per_position = (p * (p.log() - student.double().log_softmax(-1))).sum(-1)
    assert float(distillation_kl(student, teacher, labels)) == pytest.approx(
        float(sum(per_position[i, t] for i, t in kept) / len(kept)), rel=1e-5)
    assert float(distillation_kl(student, teacher, labels, reduction="sum")) == pytest.approx(
        float(sum(per_position[i, t] for i, t in kept)), rel=1e-5)


def test_the_recovery_loss_is_the_next_token_loss_plus_the_weighted_kl_to_the_teacher(tmp_path):
    student, teacher = hf_knorm.patch(lm(), "x^3/16").train(), lm().eval()
    ids = _ids()
    inputs = {"input_ids": ids, "labels": ids}
    args = tf.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with torch.no_grad():
        plain = DistillationTrainer(model=student, args=args).compute_loss(student, dict(inputs))
        distilled = DistillationTrainer(model=student, args=args, teacher=teacher, distill_weight=0.5).compute_loss(
            student, dict(inputs))
        reference = student(input_ids=ids, labels=ids)
        kl = distillation_kl(reference.logits, teacher(input_ids=ids).logits, ids)
    assert float(plain) == pytest.approx(float(reference.loss), rel=1e-5)
    assert float(kl) > 0.01
    assert float(distilled) == pytest.approx(float(plain + 0.5 * kl), rel=1e-5)
    with pytest.raises(ValueError, match="needs the original model as teacher"):
        DistillationTrainer(model=student, args=args, distill_weight=1.0)


def test_the_kl_is_scaled_like_the_next_token_loss_under_gradient_accumulation(tmp_path):
    """Two micro-batches of an accumulated batch add up to the loss of the whole batch: the Trainer hands each the
    scored-token count of the whole batch (num_items_in_batch), and the KL must be divided by it as the loss is."""
    student, teacher = hf_knorm.patch(lm(), "x^3/16").train(), lm().eval()
    ids = _ids(batch=4)
    labels = ids.clone()
    labels[1, 5:9] = -100  # rows of different scored-token counts
    args = tf.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = DistillationTrainer(model=student, args=args, teacher=teacher, distill_weight=0.7)
    assert trainer.model_accepts_loss_kwargs
    with torch.no_grad():
        whole = trainer.compute_loss(student, {"input_ids": ids, "labels": labels})
        items = int((labels[:, 1:] != -100).sum())
        halves = sum(trainer.compute_loss(student, {"input_ids": ids[rows], "labels": labels[rows]},
                                          num_items_in_batch=torch.tensor(items)) for rows in (slice(0, 2), slice(2, 4)))
    assert float(halves) == pytest.approx(float(whole), rel=1e-5)


# --- the job -------------------------------------------------------------------------------------------------------

def test_the_recovery_starts_with_the_transfers_last_evaluation_the_same_as_evaluating_again(tiny_lm_dir, texts,
                                                                                             tmp_path, monkeypatch):
    """The recovery's step 0 is the model the transfer evaluated last (LoRA's adapters start at zero): copied, it is
    the perplexity the recovery measures when made to evaluate at its start, to the last bit."""
    from hf_knorm.conversion import stages

    copied = run_convert(_settings(tiny_lm_dir, texts, tmp_path / "copied", recovery="lora"))
    monkeypatch.setattr(stages, "transferred_evaluation", lambda state, eval_sets: None)
    evaluated = run_convert(_settings(tiny_lm_dir, texts, tmp_path / "evaluated", recovery="lora"))
    for summary in (copied, evaluated):
        assert summary["stages"]["recovery"]["curve"][0] == [0, 0, summary["stages"]["transfer"]["curve"][-1][2]]
    assert copied["stages"]["recovery"]["curves"] == evaluated["stages"]["recovery"]["curves"]
    assert copied["evaluation"]["perplexity"] == evaluated["evaluation"]["perplexity"]


def test_the_recovery_evaluates_at_its_start_where_the_transfer_did_not_evaluate_its_model():
    """Without a finished transfer, with a window mix solved again to another value after the transfer's last
    evaluation, or with a held-out set the transfer did not evaluate, the recovery evaluates at its start."""
    from hf_knorm.conversion.stages import transferred_evaluation

    sets = {"essays": None, "plays": None}
    curves = {"essays": [[0, 0, 30.0], [25, 100, 20.0]], "plays": [[0, 0, 40.0], [25, 100, 25.0]]}
    done = {"done": True, "steps": 25, "curves": curves}
    assert transferred_evaluation({"transfer": done}, sets) == {"essays": 20.0, "plays": 25.0}
    same_mix = dict(done, initial_window_mix=[[0.0, 0.0]], window_mix=[[0.0, 0.0]])
    assert transferred_evaluation({"transfer": same_mix}, sets) == {"essays": 20.0, "plays": 25.0}
    assert transferred_evaluation({}, sets) is None  # no transfer (--transfer-steps 0)
    assert transferred_evaluation({"transfer": dict(done, done=False)}, sets) is None
    assert transferred_evaluation({"transfer": dict(same_mix, window_mix=[[0.0, 0.1]])}, sets) is None
    # resumed from a transfer checkpoint in another process: the mix it evaluated with is not on record
    assert transferred_evaluation({"transfer": dict(done, window_mix=[[0.0]])}, sets) is None
    assert transferred_evaluation({"transfer": done}, {**sets, "conversation": None}) is None
    assert transferred_evaluation({"transfer": dict(done, steps=30)}, sets) is None  # its last step not evaluated


def test_the_copied_start_is_added_only_to_a_curve_without_one():
    """A recovery resumed from a checkpoint that evaluated its start (an earlier release) keeps its own step 0."""
    from hf_knorm.conversion.stages import with_start

    curves = {"essays": [[2, 64, 21.0], [4, 128, 19.0]], "plays": [[0, 0, 26.0], [2, 64, 24.0]]}
    assert with_start(curves, {"essays": 20.0, "plays": 25.0}) == {
        "essays": [[0, 0, 20.0], [2, 64, 21.0], [4, 128, 19.0]], "plays": [[0, 0, 26.0], [2, 64, 24.0]]}


@pytest.mark.parametrize("recovery_mode", ["full", "lora"])
def test_a_converted_model_reloads_with_its_normalization_and_its_measured_perplexity(tiny_lm_dir, texts, tmp_path,
                                                                                       recovery_mode):
    out = tmp_path / "run"
    summary = run_convert(_settings(tiny_lm_dir, texts, out, recovery=recovery_mode))
    record = json.loads((out / RESULT_FILE).read_text())
    assert record["normalization"] == "x^3/16" and record["evaluation"]["perplexity"] == summary["evaluation"]["perplexity"]
    assert record["trained_as"] == "x^3/1"  # trained as the twin, the constant folded into the queries at the end
    assert list(record["evaluation"]["domains"]) == ["held_out"]  # --eval-dataset alone: the headline is its figure
    transfer, recovery = record["stages"]["transfer"], record["stages"]["recovery"]
    assert [point[0] for point in transfer["curve"]] == [0, 2, 4] and recovery["curve"][0][0] == 0
    assert recovery["curve"][0] == [0, 0, transfer["curve"][-1][2]]  # the transfer's last evaluation, not a second
    (trainer_state,) = (out / "recovery").glob("checkpoint-*/trainer_state.json")
    evaluated = [entry["step"] for entry in json.loads(trainer_state.read_text())["log_history"]
                 if any(key.endswith("_runtime") for key in entry)]
    assert evaluated == [2, 4]
    assert recovery["mode"] == recovery_mode
    if recovery_mode == "full":  # every weight trains in full recovery
        assert transfer["trainable_parameters"] < recovery["trainable_parameters"]
    assert len(transfer["errors"]["layers"]) == 2 and len(transfer["errors"]["by_position"][0]) == 8

    reloaded = hf_knorm.from_pretrained(out)
    assert hf_knorm.patched_normalization(reloaded) == "x^3/16"
    assert not any("lora" in name for name, _ in reloaded.named_parameters())  # adapters merged before saving
    tokenizer = tf.AutoTokenizer.from_pretrained(out)
    blocks = held_out_blocks(load_text_dataset(str(texts / "heldout.txt")), tokenizer, 32, 128)
    windows = [torch.tensor(block["input_ids"]) for block in blocks]
    again = perplexity_of_windows(reloaded.eval(), windows, progress=False).perplexity
    assert again == pytest.approx(record["evaluation"]["perplexity"], rel=1e-5)
    # the card carries both perplexities; the original's is the unpatched model's on the same blocks
    original = tf.AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    assert record["evaluation"]["original_perplexity"] == pytest.approx(
        perplexity_of_windows(original, windows, progress=False).perplexity, rel=1e-5)
    card = (out / "README.md").read_text()
    assert "held-out perplexity" in card and "model-index" in card
    assert (out / "norms.png").is_file() and (out / "transfer" / "norms.jsonl").is_file()


@pytest.mark.parametrize(("fold", "trained"), [(True, "x^3/1"), (False, "x^3/16")])
def test_the_stages_train_the_twin_unless_told_to_train_the_constant_itself(tiny_lm_dir, texts, tmp_path, fold,
                                                                            trained):
    out = tmp_path / "run"
    summary = run_convert(_settings(tiny_lm_dir, texts, out, transfer_steps=2, recovery_steps=2, fold_constant=fold))
    assert summary["trained_as"] == trained and summary["normalization"] == "x^3/16"
    stage_model = hf_knorm.from_pretrained(out / "recovery" / "model")
    assert hf_knorm.patched_normalization(stage_model) == trained  # the stages' own models are the trained form
    assert hf_knorm.patched_normalization(hf_knorm.from_pretrained(out)) == "x^3/16"
    assert stated_twin((out / "README.md").read_text()) == ("x^3/1" if fold else None)  # named where it trained


def test_lora_adapters_merge_into_an_identical_plain_model():
    from peft import LoraConfig, get_peft_model

    model = hf_knorm.patch(lm(), "x^3/16")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                    "o_proj"]))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)  # trained-looking adapters (B starts at zero)
    ids = _ids()
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=ids).logits
        merged = peft_model.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert type(merged).__name__ == "LlamaForCausalLM" and hf_knorm.patched_normalization(merged) == "x^3/16"


@pytest.mark.parametrize("overrides, message", [
    ({"normalization": "softmax"}, "Converting to softmax changes nothing"),
    ({"normalization": "x^2.5/3"}, "Unknown normalization"),
    ({"recovery": "qlora"}, "recovery must be one of"),
    ({"scale_fold": "values"}, "scale_fold must be one of"),
    ({"transfer_steps": 0, "recovery": "none"}, "nothing to convert"),
    ({"eval_tokens": 100_000}, "fewer than the"),
    ({"resume": True}, "no conversion to continue"),
    ({"eval_domains": ("poetry",)}, "Unknown held-out domain 'poetry'"),
    ({"next_token_weight": 0, "distill_weight": 0}, "has no loss"),
    ({"non_attention_lr_scale": 0}, "non_attention_lr_scale must be > 0"),
    ({"recovery_trainable": "mlp"}, "recovery_trainable must be one of all, no-embeddings, attention"),
    ({"teacher_tokens": -1}, "teacher_tokens must be >= 0"),
])
def test_bad_input_is_refused_before_training(tiny_lm_dir, texts, tmp_path, overrides, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        run_convert(_settings(tiny_lm_dir, texts, out, **overrides))
    assert not list(out.glob("*/checkpoint-*"))


def test_only_the_main_process_refuses_a_started_folder(tiny_lm_dir, texts, tmp_path, monkeypatch):
    """In a launch of several processes the main one writes the state file early (after the original's
    evaluation); a slower process checking the folder afterwards must not take it for an interrupted run. The role
    is accelerate's (PartialState), not read from RANK, which srun without torchrun does not set."""
    import accelerate

    from hf_knorm.jobs.convert import check_settings

    out = tmp_path / "run"
    out.mkdir()
    (out / STATE_FILE).write_text("{}")
    settings = _settings(tiny_lm_dir, texts, out)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(accelerate.PartialState, "is_main_process", property(lambda self: False))
    check_settings(settings)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="holds an interrupted conversion"):
        check_settings(settings)


def test_an_already_patched_model_and_a_missing_file_are_refused(tiny_lm_dir, texts, tmp_path):
    patched = tmp_path / "patched"
    hf_knorm.save_pretrained(hf_knorm.patch(lm(), "x/16"), patched, tokenizer=char_tokenizer())
    with pytest.raises(ValueError, match="already patched with x/16"):
        run_convert(_settings(patched, texts, tmp_path / "a"))
    with pytest.raises(FileNotFoundError, match="No such file"):
        run_convert(_settings(tiny_lm_dir, texts, tmp_path / "b", dataset=str(texts / "missing.txt")))


def test_an_interrupted_conversion_resumes_and_a_finished_one_is_not_overwritten(tiny_lm_dir, texts, tmp_path,
                                                                                 monkeypatch):
    from hf_knorm.conversion import trainers

    out = tmp_path / "run"
    settings = _settings(tiny_lm_dir, texts, out, recovery_steps=6)
    calls = {"n": 0}
    original_step = trainers.DistillationTrainer.training_step

    def interrupted_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # after the checkpoint of step 2 of the recovery
            raise KeyboardInterrupt
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(trainers.DistillationTrainer, "training_step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        run_convert(settings)
    assert (out / STATE_FILE).is_file() and not (out / RESULT_FILE).exists()
    assert json.loads((out / STATE_FILE).read_text())["transfer"]["done"]
    with pytest.raises(ValueError, match="pass --resume"):
        run_convert(settings)
    with pytest.raises(ValueError, match=r"these differ: normalization: 'x\^3/16' then, 'x/16' now"):
        run_convert(_settings(tiny_lm_dir, texts, out, recovery_steps=6, resume=True, normalization="x/16"))
    data = texts / "train.txt"
    original_text = data.read_text()
    data.write_text(original_text.replace("a", "o", 1))  # the same file, edited: the examples differ
    try:
        with pytest.raises(ValueError, match="these changed since: the training examples"):
            run_convert(_settings(tiny_lm_dir, texts, out, recovery_steps=6, resume=True))
    finally:
        data.write_text(original_text)
    monkeypatch.setattr(trainers.DistillationTrainer, "training_step", original_step)
    transfer_trained = []
    monkeypatch.setattr(trainers.TransferTrainer, "training_step",
                        lambda *a, **k: transfer_trained.append(1) or pytest.fail("transfer ran again"))
    summary = run_convert(_settings(tiny_lm_dir, texts, out, recovery_steps=6, resume=True))
    assert summary["stages"]["recovery"]["steps"] == 6 and not transfer_trained
    assert hf_knorm.patched_normalization(hf_knorm.from_pretrained(out)) == "x^3/16"
    with pytest.raises(ValueError, match="finished conversion"):
        run_convert(_settings(tiny_lm_dir, texts, out, resume=True))


@pytest.mark.parametrize("stage", ["transfer", "recovery"])
def test_a_non_finite_gradient_stops_the_conversion_with_an_error_and_saves_no_model(tiny_lm_dir, texts, tmp_path,
                                                                                  monkeypatch, stage):
    from hf_knorm.conversion.trainers import TransferTrainer
    from hf_knorm.training.finite_gradients import NonFiniteGradientError

    trainer_class = TransferTrainer if stage == "transfer" else DistillationTrainer
    compute_loss = trainer_class.compute_loss

    def poisoned(self, model, inputs, *args, **kwargs):
        result = compute_loss(self, model, inputs, *args, **kwargs)
        if not model.training:
            return result
        return (result[0] * float("nan"), result[1]) if isinstance(result, tuple) else result * float("nan")

    monkeypatch.setattr(trainer_class, "compute_loss", poisoned)
    out = tmp_path / "run"
    flag = "--transfer-learning-rate" if stage == "transfer" else "--recovery-learning-rate"
    with pytest.raises(NonFiniteGradientError, match=rf"step 1 \(of 4\).*lower {flag}"):
        run_convert(_settings(tiny_lm_dir, texts, out))
    assert not (out / RESULT_FILE).exists() and not (out / stage / "model").exists()


def test_a_conversion_with_the_teachers_top_k_cache_records_it_and_reads_it_back(tiny_lm_dir, texts, tmp_path,
                                                                                  monkeypatch):
    from hf_knorm.conversion import teacher_logits

    monkeypatch.setenv("HF_KNORM_CACHE", str(tmp_path / "cache"))
    run_convert(_settings(tiny_lm_dir, texts, tmp_path / "first", teacher_top_k=16))
    record = json.loads((tmp_path / "first" / RESULT_FILE).read_text())["stages"]["recovery"]["teacher_top_k"]
    assert record["k"] == 16 and record["positions"] > 0
    assert len(list((tmp_path / "cache" / "teacher_logits").glob("*.pt"))) == 1

    def no_compute(*args, **kwargs):
        raise AssertionError("computed again")

    monkeypatch.setattr(teacher_logits, "_compute", no_compute)  # the same teacher and data: read from the cache
    run_convert(_settings(tiny_lm_dir, texts, tmp_path / "second", teacher_top_k=16, seed=1))
    with pytest.raises(ValueError, match="--distill-weight 0 has no KL"):
        run_convert(_settings(tiny_lm_dir, texts, tmp_path / "third", teacher_top_k=16, distill_weight=0.0))

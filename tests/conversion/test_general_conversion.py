"""The general conversion: teacher samples (cached, costed), the general mixture, held-out domains with the worst as
the headline, the ability probe, and a converted model's record and card carrying them all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from card_values import stated_data_format, stated_held_out, stated_probe_agreement, two_decimals  # noqa: E402
from training_helpers import char_tokenizer, lm  # noqa: E402

import hf_knorm  # noqa: E402
from hf_knorm.conversion import teacher_text  # noqa: E402
from hf_knorm.jobs.convert import RESULT_FILE, run_convert  # noqa: E402
from hf_knorm.conversion.mixture import general_mixture  # noqa: E402
from hf_knorm.conversion.settings import ConvertSettings  # noqa: E402
from hf_knorm.evaluation import probe  # noqa: E402
from hf_knorm.evaluation.domains import DOMAINS, domain  # noqa: E402
from hf_knorm.data.heldout import domains_record, held_out_domain_blocks  # noqa: E402
from hf_knorm.runs.precision import has_accelerator  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def chat_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


SHORT_MEASURES = dict(beyond_window_block=300, retrieval_lengths=(300,), cluster_tokens=600)
"""The measures after training, shortened: 300-token blocks and contexts, clusters fitted on 600 tokens."""


@pytest.fixture(scope="module")
def chat_lm_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_lm")
    lm().save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache for the teacher samples (the PyPI distributions stay in the shared cache)."""
    monkeypatch.setattr(teacher_text, "_cache_root", lambda: tmp_path / "teacher_text")


# --- teacher samples and the mixture ------------------------------------------------------------------------------

def test_teacher_samples_are_drawn_once_then_read_from_the_cache_with_their_cost(chat_lm_dir, cache, monkeypatch):
    model, tokenizer = lm().eval(), chat_tokenizer()
    texts = teacher_text.teacher_samples(model, tokenizer, 300, chat_lm_dir, progress=False)
    prompts = [text for text in texts if text.startswith(teacher_text.OPENINGS[0])]
    assert prompts and any("assistant:" in text for text in texts)  # plain openings and chat turns alternate
    cost = teacher_text.sampling_cost(chat_lm_dir, 300)
    assert 300 <= cost["new_tokens"] < 300 + teacher_text.NEW_TOKENS_PER_SAMPLE and cost["samples"] == len(texts)
    assert cost["seconds"] > 0 and cost["tokens_per_second"] > 0
    monkeypatch.setattr(teacher_text, "_sample", lambda *a, **k: pytest.fail("sampled again instead of the cache"))
    assert teacher_text.teacher_samples(model, tokenizer, 300, chat_lm_dir, progress=False) == texts
    with pytest.raises(ValueError, match="no chat template"):
        teacher_text.teacher_samples(model, char_tokenizer(), 400, chat_lm_dir, progress=False)


def test_the_general_mixture_holds_teacher_samples_and_the_training_essays(chat_lm_dir, cache):
    from hf_knorm.assets.texts import paul_graham_essays

    tokenizer = chat_tokenizer()
    texts, description = general_mixture(lm().eval(), tokenizer, chat_lm_dir, 300)
    parts = description["parts"]
    assert parts["essays"]["texts"] == len(texts["essays"]) == 40
    assert parts["teacher_samples"]["texts"] == len(texts["teacher_samples"]) >= 2
    assert parts["teacher_samples"]["tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in texts["teacher_samples"])
    assert not set(paul_graham_essays()[40:]) & set(texts["essays"])  # the essays domain stays held out
    assert description["teacher_sampling"]["asked"] == 300


def test_unpacked_teacher_samples_start_at_position_zero_and_pad_without_loss(chat_lm_dir, cache):
    import datasets

    from hf_knorm.jobs.convert import _general_training_data
    from hf_knorm.data.text_data import sequence_dataset

    tokenizer = chat_tokenizer()
    examples = sequence_dataset(datasets.Dataset.from_dict({"text": ["abc", "x" * 40]}), tokenizer, 8)
    assert examples["input_ids"][0][:3] == tokenizer("abc")["input_ids"] and examples["labels"][0][3:] == [-100] * 5
    assert examples["attention_mask"][0] == [1, 1, 1, 0, 0, 0, 0, 0] and examples["attention_mask"][1] == [1] * 8
    settings = ConvertSettings(model=str(chat_lm_dir), teacher_tokens=300, block_size=32, pack_teacher_samples=False)
    train, description = _general_training_data(lm().eval(), tokenizer, chat_lm_dir, settings)
    samples = description["parts"]["teacher_samples"]["texts"]
    starts = [row[:5] for row in train["input_ids"][-samples:]]
    assert starts[0] == tokenizer(teacher_text.OPENINGS[0])["input_ids"][:5]  # the first sample, from its first token
    assert all(len(row) == 32 for row in train["input_ids"]) and set(train.column_names) == {
        "input_ids", "attention_mask", "labels"}
    packed, _ = _general_training_data(lm().eval(), tokenizer, chat_lm_dir,
                                       ConvertSettings(model=str(chat_lm_dir), teacher_tokens=300, block_size=32,
                                                       pack_teacher_samples=True))
    assert "attention_mask" not in packed.column_names and all(-100 not in row for row in packed["labels"])


# --- held-out domains ----------------------------------------------------------------------------------------------

def test_every_domain_gives_the_blocks_asked_for_and_an_unknown_one_is_refused():
    blocks = held_out_domain_blocks([d.name for d in DOMAINS], char_tokenizer(), 32, 256)
    assert list(blocks) == ["essays", "plays", "technical", "conversation"]
    assert all(len(b) == 8 and all(len(ids) == 32 for ids in b["input_ids"]) for b in blocks.values())
    assert "A: " in domain("conversation").texts()[0] and "\nB: " in domain("conversation").texts()[0]
    with pytest.raises(ValueError, match="Unknown held-out domain 'poetry'; the domains are essays, plays"):
        held_out_domain_blocks(["poetry"], char_tokenizer(), 32, 256)


def test_the_headline_is_the_worst_domain_by_ratio_to_the_original():
    two_blocks = {"input_ids": [[0] * 8] * 2, "labels": [[0] * 8] * 2}
    blocks = {"essays": two_blocks, "plays": two_blocks, "held_out": two_blocks}
    record = domains_record(blocks, 8, {"essays": 10.0, "plays": 100.0, "held_out": 5.0},
                            {"essays": 12.0, "plays": 300.0, "held_out": 5.5}, {"held_out": "my text"})
    assert record["worst_domain"] == "plays" and record["ratio_to_original"] == pytest.approx(3.0)
    assert record["perplexity"] == 300.0 and record["original_perplexity"] == 100.0
    assert record["domains"]["held_out"]["text"] == "my text" and record["domains"]["essays"]["ratio_to_original"] == 1.2


# --- the ability probe ---------------------------------------------------------------------------------------------

def test_the_probe_reproduces_itself_and_counts_disagreements():
    tokenizer = chat_tokenizer()
    original = probe.ask(lm().eval(), tokenizer)
    assert len(original) == len(probe.CLOZE) + len(probe.INSTRUCTIONS) == 40
    itself = probe.compare(probe.ask(lm().eval(), tokenizer), original)
    assert itself["agreement"] == 1.0 and itself["first_token_agreement"] == 1.0
    other = probe.compare(probe.ask(lm(seed=1).eval(), tokenizer), original)
    assert other["agreement"] == sum(answer["same"] for answer in other["answers"]) / 40 < 1.0
    assert other["original_cloze_accuracy"] == itself["cloze_accuracy"]
    with pytest.raises(ValueError, match="chat template"):
        probe.ask(lm().eval(), char_tokenizer())
    with pytest.raises(ValueError, match="different prompts"):
        probe.compare(original[:3], original[:2] + original[3:4])


def test_the_probe_compares_normalized_first_words():
    assert probe.normalize(" Paris.\n\nThe answer", 1) == "paris"
    assert probe.normalize("The capital of England is London.", 3) == "the capital of"


@pytest.mark.parametrize("trainable, frozen", [
    ("all", []), ("no-embeddings", ["model.embed_tokens.weight"]),
    ("attention", ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]),
])
def test_recovery_trains_what_recovery_trainable_names(trainable, frozen):
    from hf_knorm.conversion.stages import _set_recovery_trainable

    model = lm()
    _set_recovery_trainable(model, trainable)
    training = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert not training & set(frozen)
    assert "model.layers.1.self_attn.q_proj.weight" in training and "model.layers.0.self_attn.o_proj.weight" in training
    if trainable == "attention":
        assert all(".self_attn." in name for name in training)


def test_weights_outside_the_attention_get_the_scaled_learning_rate_through_the_schedule(tmp_path):
    import transformers as tf

    from hf_knorm.conversion.trainers import DistillationTrainer

    model = lm()
    args = tf.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, learning_rate=1e-3,
                                max_steps=4, warmup_steps=2, lr_scheduler_type="cosine")
    trainer = DistillationTrainer(model=model, args=args, non_attention_lr_scale=0.1)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    attention = {id(p) for name, p in model.named_parameters() if ".self_attn." in name}
    rates = {}
    for group in trainer.optimizer.param_groups:
        kinds = {id(p) in attention for p in group["params"]}
        assert len(kinds) == 1  # a group holds attention weights or others, never both
        rates[kinds.pop()] = group["initial_lr"]
    assert rates == {True: pytest.approx(1e-3), False: pytest.approx(1e-4)}
    assert sum(len(group["params"]) for group in trainer.optimizer.param_groups) == len(list(model.parameters()))
    for _ in range(2):
        trainer.optimizer.step()  # no gradients: nothing moves; the schedule advances as in training
        trainer.lr_scheduler.step()
    attention_lr, other_lr = (group["lr"] for group in sorted(trainer.optimizer.param_groups,
                                                               key=lambda g: -g["initial_lr"])[:2])
    assert other_lr == pytest.approx(0.1 * attention_lr) and attention_lr == pytest.approx(1e-3)


# --- the job -------------------------------------------------------------------------------------------------------

def test_a_general_conversion_records_every_domain_the_probe_and_its_mixture(chat_lm_dir, cache, tmp_path):
    out = tmp_path / "run"
    settings = ConvertSettings(
        model=str(chat_lm_dir), out=str(out), teacher_tokens=300, eval_domains=("plays", "conversation"),
        block_size=32, batch_size=2, eval_tokens=64, eval_steps=2, transfer_steps=2, recovery_steps=2,
        logging_steps=1, save_steps=2, warmup_steps=0, report_to=("none",), recovery_trainable="no-embeddings",
        pack_teacher_samples=False, **SHORT_MEASURES)
    summary = run_convert(settings)
    record = json.loads((out / RESULT_FILE).read_text())
    evaluation = record["evaluation"]
    assert list(evaluation["domains"]) == ["plays", "conversation"]
    worst = max(evaluation["domains"], key=lambda name: evaluation["domains"][name]["ratio_to_original"])
    assert evaluation["worst_domain"] == worst and evaluation["perplexity"] == evaluation["domains"][worst]["perplexity"]
    assert record["stages"]["recovery"]["curve"] == record["stages"]["recovery"]["curves"][worst]
    assert record["training_data"]["parts"]["teacher_samples"]["texts"] >= 2
    assert 0.0 <= summary["probe"]["agreement"] <= 1.0 and len(summary["probe"]["answers"]) == 40
    card = (out / "README.md").read_text()
    stated = stated_held_out(card)
    assert stated["worst_domain"] == worst and stated["worst_ratio"] == two_decimals(evaluation["ratio_to_original"])
    assert stated["domains"] == {name: tuple(two_decimals(domain[key]) for key in
                                             ("original_perplexity", "perplexity", "ratio_to_original"))
                                 for name, domain in evaluation["domains"].items()}
    assert stated_probe_agreement(card) == int(f"{100 * summary['probe']['agreement']:.0f}")  # as printed
    reloaded = hf_knorm.from_pretrained(out)
    original_embedding = lm().get_input_embeddings().weight
    assert reloaded.get_input_embeddings().weight.equal(original_embedding)  # frozen in recovery and in transfer


def test_a_conversion_on_conversations_trains_and_scores_the_replies(chat_lm_dir, tmp_path):
    chats = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                           {"role": "assistant", "content": f"{a + b}." + " Yes." * b}]} for a in range(6) for b in range(5)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    out = tmp_path / "run"
    summary = run_convert(ConvertSettings(
        model=str(chat_lm_dir), out=str(out), dataset=str(data), eval_domains=("none",), probe=False,
        block_size=64, batch_size=4, eval_tokens=64, eval_steps=2, transfer_steps=2, recovery_steps=2,
        logging_steps=1, save_steps=2, warmup_steps=0, report_to=("none",)))
    assert summary["data_format"] == {"format": "conversational", "loss_on": "the assistant turns"}
    held_out = summary["evaluation"]["domains"]["held_out"]  # the last 3 records, fewer than 64 reply tokens: all
    replies = [" 7." + " Yes." * b + "\n" for b in (2, 3, 4)]  # examples of several lengths, the only held-out set
    assert held_out["text"].endswith("scored on the assistant turns") and held_out["tokens"] == sum(map(len, replies))
    assert summary["stages"]["recovery"]["tokens"] < 2 * 4 * 64  # examples are shorter than a block
    card = (out / "README.md").read_text()
    assert stated_data_format(card) == summary["data_format"]
    with pytest.raises(ValueError, match="--dataset chatterbot trains on the conversation domain"):
        run_convert(ConvertSettings(model=str(chat_lm_dir), out=str(tmp_path / "other"), dataset="chatterbot"))


def test_a_tokenizer_without_a_chat_template_is_refused_before_the_model_loads(tmp_path):
    folder = tmp_path / "plain"
    lm().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    with pytest.raises(ValueError, match="no chat template.*--no-probe"):
        run_convert(ConvertSettings(model=str(folder), out=str(tmp_path / "run"), eval_domains=("none",),
                                    block_size=32))  # the tiny model holds 256 positions, below the default blocks


@pytest.mark.device  # on a CUDA machine the Trainer trains there: the teachers must follow the model
@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.skipif(
    not has_accelerator(), reason="--fp16 is refused without an accelerator (test_precision.py)"))])
def test_a_mixed_precision_conversion_trains_under_autocast_and_saves_an_fp32_model(chat_lm_dir, tmp_path, precision):
    import torch

    out = tmp_path / precision
    summary = run_convert(ConvertSettings(
        model=str(chat_lm_dir), out=str(out), dataset="paul-graham", eval_domains=("essays",), probe=False,
        block_size=32, batch_size=2, eval_tokens=64, eval_steps=2, transfer_steps=2, recovery_steps=2, max_blocks=16,
        logging_steps=1, save_steps=2, warmup_steps=0, report_to=("none",), **SHORT_MEASURES, **{precision: True}))
    losses = [entry["loss"] for entry in json.loads((out / "recovery" / "checkpoint-2" / "trainer_state.json")
                                                     .read_text())["log_history"] if "loss" in entry]
    assert losses and all(map(lambda value: value == value and abs(value) < 1e4, losses))  # finite
    for stage in ("transfer", "recovery"):
        arguments = torch.load(out / stage / "checkpoint-2" / "training_args.bin", weights_only=False)
        assert getattr(arguments, precision) and arguments.use_cpu == (not has_accelerator())
    assert summary["evaluation"]["perplexity"] < summary["stages"]["transfer"]["curves"]["essays"][0][2]
    reloaded = hf_knorm.from_pretrained(out)
    assert all(parameter.dtype == torch.float32 for parameter in reloaded.parameters())  # autocast keeps fp32 weights

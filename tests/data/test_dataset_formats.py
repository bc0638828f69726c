"""The three dataset formats: detection, the checks on records, and the loss masks against the rendered template."""

from __future__ import annotations

import json
import re

import datasets
import pytest
import transformers
from training_helpers import char_tokenizer, lm, save_tiny_lm

from hf_knorm.cli import main
from hf_knorm.data.dataset_formats import (CONVERSATIONAL, LANGUAGE_MODELING, PROMPT_COMPLETION, check_records,
                                               detect_format, tokenize_with_loss_mask)
from hf_knorm.data.text_data import pack_dataset

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def chat_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def turns(*pairs):
    return [{"role": role, "content": content} for role, content in pairs]


CONVERSATION = turns(("system", "Be brief."), ("user", "Capital of France?"), ("assistant", "Paris."),
                     ("user", "And of Italy?"), ("assistant", "Rome."))


def _text(tokenizer, ids) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(ids))  # the character tokenizer has no decoder


def _trained_text(tokenizer, example) -> list[str]:
    """The runs of consecutive tokens that carry the loss, decoded."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [_text(tokenizer, run) for run in runs]


@pytest.mark.parametrize("columns, expected", [
    (["text"], LANGUAGE_MODELING), (["messages"], CONVERSATIONAL), (["prompt", "completion"], PROMPT_COMPLETION),
    (["messages", "text"], CONVERSATIONAL), (["id", "prompt", "completion"], PROMPT_COMPLETION)])
def test_the_format_is_detected_from_the_columns(columns, expected):
    assert detect_format(columns) == expected


@pytest.mark.parametrize("columns, message", [
    (["title", "body"], "fit no format: found body, title; expected 'text'"),
    (["prompt", "answer"], "it has 'prompt' but no 'completion'"),
    (["prompt", "chosen", "rejected"], "preference dataset .* DPOTrainer")])
def test_columns_that_fit_no_format_are_named_with_the_formats_expected(columns, message):
    with pytest.raises(ValueError, match=message):
        detect_format(columns)


def test_the_loss_falls_on_every_assistant_turn_with_its_end_of_turn_tokens():
    tokenizer = chat_tokenizer()
    example = tokenize_with_loss_mask(datasets.Dataset.from_dict({"messages": [CONVERSATION]}), CONVERSATIONAL,
                                      tokenizer, max_length=512)[0]
    assert _text(tokenizer, example["input_ids"]) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert _trained_text(tokenizer, example) == ["Paris.</s>\n", "Rome.</s>\n"]
    everything = tokenize_with_loss_mask(datasets.Dataset.from_dict({"messages": [CONVERSATION]}), CONVERSATIONAL,
                                         tokenizer, max_length=512, train_on_prompt=True)[0]
    assert everything["labels"] == everything["input_ids"]


def test_prompt_completion_pairs_train_on_the_completion_plain_or_conversational():
    tokenizer = chat_tokenizer()
    plain = tokenize_with_loss_mask(datasets.Dataset.from_dict({"prompt": ["2 + 2 ="], "completion": [" 4"]}),
                                    PROMPT_COMPLETION, tokenizer, max_length=64)[0]
    assert _text(tokenizer, plain["input_ids"]) == "2 + 2 = 4</s>"
    assert _trained_text(tokenizer, plain) == [" 4</s>"]
    chat = tokenize_with_loss_mask(datasets.Dataset.from_dict({
        "prompt": [turns(("user", "2 + 2?"))], "completion": [turns(("assistant", "4"))]}),
        PROMPT_COMPLETION, tokenizer, max_length=64)[0]
    assert _text(tokenizer, chat["input_ids"]) == "[user] 2 + 2?</s>\n[assistant] 4</s>\n"
    assert _trained_text(tokenizer, chat) == ["4</s>\n"]


def test_examples_are_cut_at_the_block_size_and_those_left_without_loss_dropped():
    tokenizer = chat_tokenizer()
    records = datasets.Dataset.from_dict({"prompt": ["x" * 40, "short"], "completion": ["yes", "no"]})
    kept = tokenize_with_loss_mask(records, PROMPT_COMPLETION, tokenizer, max_length=30)
    assert len(kept) == 1 and _text(tokenizer, kept[0]["input_ids"]) == "shortno</s>"
    with pytest.raises(ValueError, match="No example is left .* Raise --block-size"):
        tokenize_with_loss_mask(records.select([0]), PROMPT_COMPLETION, tokenizer, max_length=30)


@pytest.mark.parametrize("records, message", [
    ({"messages": [turns(("user", "hi"), ("robot", "beep"))]}, "Record 0: unknown role 'robot'"),
    ({"messages": [turns(("user", "hi"))]}, "Record 0: the conversation has no assistant turn"),
    ({"messages": [[{"role": "user"}]]}, "Record 0: a user turn in 'messages' has no text content"),
    ({"prompt": ["a", "b"], "completion": ["c", " "]}, "Record 1: its completion is missing or empty"),
    ({"prompt": ["a"], "completion": [None]}, "Record 0: its completion is missing or empty"),
    ({"prompt": [turns(("user", "a"))], "completion": ["b"]}, "Record 0: one side is text and the other"),
    ({"prompt": [7, 8], "completion": [9, 10]}, "Record 0: its prompt is int, neither text"),
])
def test_bad_records_are_refused_with_their_index(records, message):
    dataset = datasets.Dataset.from_list([dict(zip(records, values)) for values in zip(*records.values())])
    with pytest.raises(ValueError, match=message):
        check_records(dataset, detect_format(dataset.column_names), chat_tokenizer())


def test_a_conversational_dataset_needs_a_chat_template():
    dataset = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        check_records(dataset, CONVERSATIONAL, char_tokenizer())


def test_packing_through_trl_equals_the_plain_reference():
    """``pack_dataset`` (TRL's wrapped packing, short rests dropped) against run_clm's grouping, written out."""
    import random

    tokenizer = char_tokenizer()
    rng = random.Random(0)
    texts = ["".join(rng.choice("ab c\n") for _ in range(rng.randint(0, 120))) for _ in range(2300)]
    packed = pack_dataset(datasets.Dataset.from_dict({"text": texts}), tokenizer, 32)
    expected = []
    for start in range(0, len(texts), 1000):  # every 1,000 texts, as run_clm's map batches
        tokens = [t for ids in tokenizer(texts[start:start + 1000], add_special_tokens=False)["input_ids"]
                  for t in ids + [tokenizer.eos_token_id]]
        expected += [tokens[i:i + 32] for i in range(0, len(tokens) - len(tokens) % 32, 32)]
    assert packed["input_ids"] == expected and packed["labels"] == expected


def bos_tokenizer():
    """The character tokenizer with a post-processor that puts ``<s>`` in front of every text, as Llama's and Gemma's
    tokenizers do (built here, nothing downloaded)."""
    from tokenizers import processors

    tokenizer = char_tokenizer()
    backend = tokenizer.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    assert tokenizer("ab")["input_ids"][0] == tokenizer.bos_token_id
    return tokenizer


def _trl_examples(records, tokenizer, tmp_path):
    """What TRL's own ``SFTTrainer`` makes of ``records`` (its dataset preparation, not packed), the oracle."""
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, packing=False, max_length=None,
                       bf16=False)
    trainer = SFTTrainer(model=lm(), args=config, train_dataset=datasets.Dataset.from_list(records),
                         processing_class=tokenizer)
    return trainer.train_dataset


def test_records_are_tokenized_as_trl_tokenizes_them_bos_included(tmp_path):
    """A tokenizer that adds ``<bos>`` (Llama, Gemma): text blocks, plain prompt/completion pairs and conversations
    carry exactly the tokens and loss mask TRL's ``SFTTrainer`` gives them (they used to lose ``<bos>``)."""
    tokenizer = bos_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    texts = ["To be, or not", "to be", "that is the question"]
    trl_text = _trl_examples([{"text": text} for text in texts], tokenizer, tmp_path / "text")
    stream = [token for ids in trl_text["input_ids"] for token in ids]
    assert stream.count(bos) == 3 and stream.count(eos) == 3
    packed = pack_dataset(datasets.Dataset.from_dict({"text": texts}), tokenizer, 8)
    assert [token for ids in packed["input_ids"] for token in ids] == stream[:len(stream) // 8 * 8]

    pairs = [{"prompt": "Capital of France?", "completion": " Paris."}, {"prompt": "2+2=", "completion": "4"}]
    trl_pairs = _trl_examples(pairs, tokenizer, tmp_path / "pairs")
    ours = tokenize_with_loss_mask(datasets.Dataset.from_list(pairs), PROMPT_COMPLETION, tokenizer, max_length=64)
    assert ours["input_ids"] == trl_pairs["input_ids"] and ours["labels"] == trl_pairs["labels"]
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in ours["input_ids"])

    trl_chat = _trl_examples([{"messages": CONVERSATION}], tokenizer, tmp_path / "chat")
    chat = tokenize_with_loss_mask(datasets.Dataset.from_dict({"messages": [CONVERSATION]}), CONVERSATIONAL,
                                   tokenizer, max_length=256)
    assert chat["input_ids"] == trl_chat["input_ids"]


GENERATION_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}[assistant] {% generation %}"
                       "{{ m['content'] }}</s>\n{% endgeneration %}{% else %}[{{ m['role'] }}] {{ m['content'] }}</s>\n"
                       "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def test_a_template_with_generation_blocks_is_masked_as_trls_assistant_only_loss(tmp_path):
    """A chat template with ``{% generation %}`` gives its own assistant mask, which TRL's SFTTrainer takes with
    assistant_only_loss: the same labels here; and the same as the prefix rule finds in the unmarked template."""
    from trl import SFTConfig, SFTTrainer

    tokenizer = chat_tokenizer()
    tokenizer.chat_template = GENERATION_TEMPLATE
    config = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, packing=False, max_length=None,
                       bf16=False, assistant_only_loss=True)
    trl = SFTTrainer(model=lm(), args=config, train_dataset=datasets.Dataset.from_dict({"messages": [CONVERSATION]}),
                     processing_class=tokenizer).train_dataset
    records = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    ours = tokenize_with_loss_mask(records, CONVERSATIONAL, tokenizer, max_length=256)
    assert ours["input_ids"] == trl["input_ids"] and ours["labels"] == trl["labels"]
    by_prefix = tokenize_with_loss_mask(records, CONVERSATIONAL, chat_tokenizer(), max_length=256)
    assert ours["labels"] == by_prefix["labels"]
    assert _trained_text(tokenizer, ours[0]) == ["Paris.</s>\n", "Rome.</s>\n"]


def test_a_text_already_starting_with_bos_gets_no_second_one():
    """A teacher sample rendered through a chat template that writes ``<s>`` itself starts with one ``<s>``."""
    from hf_knorm.data.text_data import sequence_dataset

    tokenizer = bos_tokenizer()
    examples = sequence_dataset(datasets.Dataset.from_dict({"text": ["<s>[user] hi", "plain"]}), tokenizer, 16)
    starts = [ids[:2] for ids in examples["input_ids"]]
    assert starts == [[tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("[")],
                      [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("p")]]


@pytest.fixture(scope="module")
def chat_lm_dir(tmp_path_factory):
    folder = save_tiny_lm(tmp_path_factory.mktemp("chat_lm"))
    tokenizer = chat_tokenizer()
    tokenizer.save_pretrained(folder)
    return folder


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


QUESTIONS = [(f"What is {a} + {b}?", f"{a + b}.") for a in range(6) for b in range(5)]


@pytest.mark.parametrize("kind", ["messages", "prompt_completion", "conversational_prompt_completion"])
def test_finetune_trains_each_format_on_its_replies_and_records_it(tmp_path, chat_lm_dir, kind):
    if kind == "messages":
        records = [{"messages": turns(("user", q), ("assistant", a))} for q, a in QUESTIONS]
    elif kind == "prompt_completion":
        records = [{"prompt": q, "completion": " " + a} for q, a in QUESTIONS]
    else:
        records = [{"prompt": turns(("user", q)), "completion": turns(("assistant", a))} for q, a in QUESTIONS]
    data = _write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(chat_lm_dir), "--dataset", str(data), "--out", str(out),
                 "--normalization", "x^3/16", "--max-steps", "3", "--eval-steps", "3", "--batch-size", "4",
                 "--logging-steps", "1", "--block-size", "64", "--eval-tokens", "6", "--report-to", "none"]) == 0
    summary = json.loads((out / "finetune.json").read_text())
    expected_format = "conversational" if kind == "messages" else "prompt_completion"
    assert summary["data_format"]["format"] == expected_format
    assert summary["data_format"]["loss_on"] == ("the assistant turns" if kind == "messages" else "the completions")
    evaluation = summary["evaluation"]  # the last 3 of 30 records held out; scored on their replies only
    assert evaluation["text"] == f"the last 3 of 30 texts of {data} (not trained on)"
    reply_tokens = [len(a) + 2 for _, a in QUESTIONS[-3:]]  # + "</s>\n" (chat), " " + ... + "</s>" (plain)
    assert evaluation["tokens"] == sum(reply_tokens[:2])  # the first records carrying eval_tokens=6 loss tokens
    assert evaluation["perplexity"] > 0 and evaluation["original_perplexity"] > 0
    assert len((out / "norms.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("bad, found", [(None, "missing \\(null\\)"), (7, "int, not text"),
                                        (["a"], "list, not text")])
def test_every_text_record_is_checked_and_the_bad_one_named(tmp_path, chat_lm_dir, capsys, bad, found):
    """Not only the first record: a missing or non-text value in record 2 is refused by index and field before the
    model loads (it used to end in the tokenizer's TypeError, with no record named)."""
    data = _write_jsonl(tmp_path / "bad.jsonl", [{"body": "first text"}, {"body": "second"}, {"body": bad},
                                                 {"body": "fourth"}])
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(chat_lm_dir), "--dataset", str(data), "--text-column", "body",
                 "--out", str(out), "--report-to", "none"]) == 2
    assert re.search(f"Record 2 of {re.escape(str(data))}: its 'body' is {found}", capsys.readouterr().err)
    assert not out.exists()


def test_finetune_refuses_bad_chat_data_before_the_model_loads(tmp_path, chat_lm_dir, capsys):
    data = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": turns(("user", "hi"))}])
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(chat_lm_dir), "--dataset", str(data), "--out", str(out)]) == 2
    assert "Record 0: the conversation has no assistant turn" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_every_format_runs_end_to_end_with_the_default_models_chat_template(tmp_path):
    """Two steps of each format with SmolLM2-135M-Instruct's tokenizer and chat template, on a tiny llama of its
    vocabulary (the 135M weights add nothing to what the formats check, and cost a minute); the labels of a
    conversation are checked against the template's rendering: the replies and their end-of-turn tokens, nothing
    else."""
    from tiny_models import tiny_config
    from transformers import AutoTokenizer

    from hf_knorm.assets.default_model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    chat = turns(("user", "What is the capital of France?"), ("assistant", "Paris."))
    example = tokenize_with_loss_mask(datasets.Dataset.from_dict({"messages": [chat]}), CONVERSATIONAL, tokenizer,
                                      max_length=128)[0]
    trained = [token for token, label in zip(example["input_ids"], example["labels"]) if label != -100]
    assert tokenizer.decode(trained) == "Paris.<|im_end|>\n"
    assert tokenizer.decode(example["input_ids"]) == tokenizer.apply_chat_template(chat, tokenize=False)

    config = tiny_config("llama")
    config.update(dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model_dir = tmp_path / "tiny_smollm2_vocab"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    records = {
        "text": [{"text": f"{q} {a}"} for q, a in QUESTIONS],
        "messages": [{"messages": turns(("user", q), ("assistant", a))} for q, a in QUESTIONS],
        "pairs": [{"prompt": turns(("user", q)), "completion": turns(("assistant", a))} for q, a in QUESTIONS],
    }
    for kind, rows in records.items():
        data = _write_jsonl(tmp_path / f"{kind}.jsonl", rows)
        out = tmp_path / kind
        block = "16" if kind == "text" else "64"
        assert main(["finetune", "--model", str(model_dir), "--dataset", str(data), "--out", str(out),
                     "--normalization", "softmax",
                     "--max-steps", "2", "--batch-size", "2", "--eval-steps", "2", "--logging-steps", "1",
                     "--block-size", block, "--eval-tokens", "16", "--report-to", "none"]) == 0
        summary = json.loads((out / "finetune.json").read_text())
        assert summary["global_step"] == 2 and summary["evaluation"]["perplexity"] > 0


def test_the_trainers_held_out_perplexity_is_a_mean_over_scored_tokens(tmp_path):
    """Examples of several lengths: the Trainer's eval_perplexity (batches of 4, padded) equals the plain count,
    every scored token weighing the same (the Trainer alone would average batch means)."""
    import torch
    import transformers as tf
    from training_helpers import lm
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_knorm.data.heldout import PerplexityTrainer, held_out_perplexity

    tokenizer = chat_tokenizer()
    chats = [turns(("user", q), ("assistant", a * (1 + i % 5))) for i, (q, a) in enumerate(QUESTIONS)]
    examples = tokenize_with_loss_mask(datasets.Dataset.from_dict({"messages": chats}), CONVERSATIONAL, tokenizer,
                                       max_length=128)
    model = lm().eval()
    trainer = PerplexityTrainer(
        model=model, args=tf.TrainingArguments(str(tmp_path), per_device_eval_batch_size=4, report_to="none",
                                               use_cpu=True, prediction_loss_only=True),
        eval_dataset=examples, data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
    metrics = trainer.evaluate()
    expected = held_out_perplexity(model, examples)
    assert metrics["eval_perplexity"] == pytest.approx(expected, rel=1e-5)
    with torch.no_grad():  # and the unweighted mean of batch means differs: the weighting matters here
        trainer._examples_per_token = None
        unweighted = trainer.evaluation_loop(trainer.get_eval_dataloader(), "plain", True).metrics["eval_loss"]
    assert abs(unweighted - metrics["eval_loss"]) > 1e-3

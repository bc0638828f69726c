"""The fine-tuning job behind ``hf-knorm finetune``: a causal LM, a normalization, any dataset, norms logged.

Steps, in order (everything that can be wrong with the input is checked before the model is loaded):

1. the normalization, the data source, the extras and the run folder are checked (an unknown normalization, a
   missing file, a missing ``datasets``/``trl``/``tensorboard``, checkpoints already in ``out`` without ``resume``,
   ``resume`` without checkpoints, without the record of the settings it started with, or with settings that shape
   the model changed);
2. the model's config and tokenizer are read: a block size above the model's maximum is refused;
3. the dataset is loaded, its format detected from its columns (:mod:`hf_knorm.data.dataset_formats`: text,
   conversations or prompt/completion pairs), split into training and held-out records
   (:mod:`hf_knorm.data.heldout`) and tokenized: text packed into blocks, every token trained on; the others one
   example per record, the loss on the replies (columns that fit no format, a bad record, a missing chat template,
   an empty dataset, too few tokens, a held-out text shorter than ``eval_tokens``); on ``resume``, the examples and
   the model folder are compared with those the run started from (:func:`~.run_folder.check_same_inputs`);
4. the model is loaded; with ``balance`` its keys and values are balanced first (exact, on the first training
   examples; not again on resume, whose checkpoint holds the balanced weights); then it is patched with the
   normalization (``softmax`` keeps the model's own attention);
5. its held-out perplexity is measured on the tokens that carry the loss (the starting point of the model card's
   comparison), on the device the Trainer trains on and in its precision (``bf16``: autocast), once: on the main
   process, the others waiting for its figure; TRL's ``SFTTrainer`` (:class:`~hf_knorm.runs.sft.SFTPerplexityTrainer`: ``eval_perplexity``
   beside ``eval_loss``, token-weighted, at step 0 and every ``eval_steps``) trains it with
   :class:`~hf_knorm.training.callback.NormLoggerCallback` and the TensorBoard integration, saving checkpoints
   (``resume`` continues from the last one); in several processes (torchrun, accelerate launch) the main process
   alone writes;
6. the run folder ends with the model saved so that it reloads with its normalization, with its model card
   (:func:`hf_knorm.save_pretrained`, as ``convert`` saves: the held-out section, the data format, the norm figure),
   its tokenizer, ``norms.jsonl``, ``norms.png`` (the per-layer figure) and ``finetune.json`` (settings and outcome,
   with the ``evaluation`` record: held-out perplexity before and after, and the curve), written last.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

from ..normalizations import parse_normalization
from ..runs.arguments import job_arguments
from ..runs.precision import BF16_HELP, FP16_HELP, check_precision, run_precision, weights_dtype
from ..runs.run_folder import (check_same_inputs, check_same_settings, inputs_fingerprint, is_main_process,
                               on_main_process, process_state, settings_record, write_json)
from ..runs.sharding import check_fsdp, fsdp_requested, gathered_state_dict
from ..runs.sources import causal_lm_source, check_extras, check_sources

RESULT_FILE = "finetune.json"
SETTINGS_FILE = "finetune_settings.json"
"""The settings a run started with and the fingerprint of its inputs (``"inputs"``), compared on ``--resume``."""


@dataclass
class FinetuneSettings:
    """What ``hf-knorm finetune`` runs: each field is a flag (``--block-size`` or ``--block_size``), and its
    ``metadata["help"]`` is that flag's help, so the command line and this class cannot disagree."""

    dataset: str = field(default="shakespeare", metadata={
        "help": "shakespeare | paul-graham | chatterbot (embedded) | local file(s), comma-separated (.txt, "
                ".json/.jsonl, .csv, .parquet) | a datasets name (namespace/name); text, 'messages' (conversations) "
                "or 'prompt' + 'completion' columns, detected"})
    out: str = field(default="outputs/finetune", metadata={
        "help": "the run folder: checkpoints, TensorBoard logs, norms.jsonl, finally the model"})
    model: str = field(default="default", metadata={
        "help": "'default' (SmolLM2-135M-Instruct, embedded), a checkpoint folder of a causal LM, or its Hub id (org/name) "
                "if it is in the local Hub cache (nothing is downloaded)"})
    normalization: str = field(default="x^3/16", metadata={
        "help": "the attention normalization to train with (softmax keeps the model's own attention)"})
    balance: str | None = field(default=None, metadata={
        "help": "balance keys and values (exact) before fine-tuning: one scale per layer or per channel",
        "choices": ("layer", "channel")})
    text_column: str = field(default="text", metadata={"help": "the column holding the text"})
    split: str = field(default="train", metadata={"help": "the split to read (datasets names and local files)"})
    train_on_prompt: bool = field(default=False, metadata={
        "help": "conversations and prompt/completion pairs: the loss on every token, not only on the replies"})
    block_size: int = field(default=256, metadata={"help": "tokens per example (text blocks; the longest record)"})
    batch_size: int = field(default=4, metadata={"help": "examples per device and micro-batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_steps: int = field(default=200, metadata={"help": "optimizer steps"})
    learning_rate: float = field(default=5e-5, metadata={"help": "peak learning rate"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    seed: int = field(default=0, metadata={"help": "random seed (weights of new layers, data order)"})
    bf16: bool = field(default=False, metadata={"help": BF16_HELP})
    fp16: bool = field(default=False, metadata={"help": FP16_HELP})
    logging_steps: int = field(default=10, metadata={"help": "log the loss and the per-layer norms every N steps"})
    save_steps: int = field(default=50, metadata={"help": "a checkpoint every N steps (the last two are kept)"})
    max_blocks: int | None = field(default=None, metadata={"help": "use at most N blocks of the dataset"})
    eval_dataset: str | None = field(default=None, metadata={
        "help": "held-out records (same forms and format as --dataset); default: paul-graham essays 40-48, "
                "shakespeare's Hamlet and sonnets, every tenth chatterbot conversation, else the last --eval-fraction "
                "of the records"})
    eval_fraction: float = field(default=0.1, metadata={"help": "share of texts held out of other datasets"})
    eval_tokens: int = field(default=8192, metadata={"help": "held-out tokens scored at each evaluation"})
    eval_steps: int = field(default=50, metadata={"help": "held-out perplexity every N steps (and at step 0)"})
    report_to: tuple[str, ...] = field(default=("tensorboard",), metadata={
        "help": "Trainer integrations, comma-separated ('none': no logs besides norms.jsonl)"})
    stop_on_nonfinite_loss: bool = field(default=True, metadata={
        "help": "stop at the first optimizer step with a non-finite loss (--no-stop-on-nonfinite-loss goes on)"})
    resume: bool = field(default=False, metadata={"help": "continue from the last checkpoint in --out"})


def check_settings(settings: FinetuneSettings) -> Path | None:
    """The checks that need neither the model nor the data; returns the checkpoint to resume from (or ``None``).

    Raises:
        ValueError: unknown normalization or balance mode, non-positive sizes, a run folder in the wrong state.
        FileNotFoundError: a missing data file or model folder.
        MissingExtraError: ``report_to`` names TensorBoard and it is not installed (the ``train`` extra).
    """
    parse_normalization(settings.normalization)
    if settings.balance not in (None, "layer", "channel"):
        raise ValueError(f"balance must be 'layer' or 'channel', not {settings.balance!r}.")
    for name in ("block_size", "batch_size", "gradient_accumulation_steps", "max_steps", "logging_steps", "save_steps",
                 "eval_tokens", "eval_steps"):
        if getattr(settings, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(settings, name)}.")
    check_sources(settings.dataset, settings.eval_dataset, settings.model)
    check_extras("hf-knorm finetune", settings.report_to)
    check_fsdp("hf-knorm finetune", supported=True)
    check_precision(settings.bf16, settings.fp16)
    out = Path(settings.out)
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    if settings.resume and last is None:
        raise ValueError(f"--resume: no checkpoint-* folder in {out} to resume from.")
    if not settings.resume and last is not None:
        raise ValueError(f"{out} already holds {Path(last).name}: pass --resume to continue it, or another --out.")
    if settings.resume:
        check_same_settings(_stored_record(out), settings)
    return Path(last) if last else None


def _stored_record(out: Path) -> dict | None:
    path = out / SETTINGS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def run_finetune(settings: FinetuneSettings) -> dict:
    """Fine-tune as ``settings`` say (see the module docstring); returns what ``finetune.json`` records.

    Raises:
        ValueError, FileNotFoundError: bad input, always before the first training step.
    """
    import transformers

    from ..hub.saving import save_pretrained
    from ..models.patching import patch, patched_normalization, unpatch
    from ..models.persistence import from_pretrained
    from ..training.callback import NormLoggerCallback
    from ..data.heldout import (evaluation_record, held_out_perplexity, mean_example_tokens, perplexity_curve,
                                    training_and_held_out)
    from ..training.history import HISTORY_FILE
    from ..training.norm_figure import plot_norm_history
    from ..runs.sft import SFTPerplexityTrainer, sft_config

    checkpoint = check_settings(settings)
    normalization = parse_normalization(settings.normalization).name
    model_dir, _ = causal_lm_source(settings.model, settings.block_size, "finetune trains")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with process_state().main_process_first():  # its datasets.map calls fill the cache once, the others read it
        data = training_and_held_out(
            settings.dataset, tokenizer, settings.block_size, settings.eval_tokens, settings.text_column,
            settings.split, settings.eval_dataset, settings.eval_fraction, settings.max_blocks, settings.train_on_prompt)
    train, held_out = data.train, data.held_out
    inputs = inputs_fingerprint(model_dir, {"training": train, "held-out": held_out})
    if checkpoint is not None:  # the data and the model folder as the run started, checked before the model loads
        check_same_inputs(_stored_record(Path(settings.out)).get("inputs"), inputs, settings.out)

    model = from_pretrained(model_dir, model_class=transformers.AutoModelForCausalLM, dtype=weights_dtype())  # fp32
    device = process_state().device  # where the Trainer will train it: measured there, in its precision, once
    if not fsdp_requested():  # under FSDP the whole model may not fit one device: the Trainer shards it from here
        model.to(device)
    else:
        device = next(model.parameters()).device

    def measure(desc: str) -> float:
        with run_precision(device, settings.bf16, settings.fp16):
            return held_out_perplexity(model, held_out, desc=desc)

    original_perplexity = on_main_process(lambda: measure("starting model"))
    if patched_normalization(model) not in (None, normalization):
        unpatch(model)
    if settings.balance and checkpoint is None:  # a resumed run loads the balanced, trained weights
        from ..balancing.balance import balance_kv

        calibration = [tokenizer.decode(ids) for ids in train[:64]["input_ids"]]
        report = balance_kv(model, tokenizer, calibration, settings.balance, progress=False)
        print(f"K/V balanced ({settings.balance}): max |logit change| {report.max_logit_change:.2e}")
    if normalization != "softmax" and patched_normalization(model) is None:
        patch(model, normalization)
    model.train()

    args = sft_config(settings.block_size, **job_arguments(
        settings.out, steps=settings.max_steps, batch_size=settings.batch_size, learning_rate=settings.learning_rate,
        warmup_steps=settings.warmup_steps, logging_steps=settings.logging_steps, save_steps=settings.save_steps,
        eval_steps=settings.eval_steps, report_to=settings.report_to, seed=settings.seed, bf16=settings.bf16,
        fp16=settings.fp16, gradient_accumulation_steps=settings.gradient_accumulation_steps,
        weight_decay=settings.weight_decay))
    if checkpoint is None and is_main_process():
        Path(settings.out).mkdir(parents=True, exist_ok=True)
        write_json(Path(settings.out) / SETTINGS_FILE, {**settings_record(settings), "inputs": inputs})
    callback = NormLoggerCallback(stop_on_nonfinite_loss=settings.stop_on_nonfinite_loss)
    trainer = SFTPerplexityTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                                   processing_class=tokenizer, callbacks=[callback])
    output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    tokens_per_step = round(settings.batch_size * mean_example_tokens(train) * settings.gradient_accumulation_steps
                            * args.world_size)  # the global batch: every process's
    curve = perplexity_curve(trainer.state.log_history, tokens_per_step)
    if curve and curve[-1][0] == trainer.state.global_step:  # the Trainer evaluates the last step itself
        final_perplexity = curve[-1][2]
    elif callback.stopped_at_step is not None:  # stopped at a non-finite loss: the model has diverged
        final_perplexity = math.nan
    else:
        final_perplexity = (measure("fine-tuned model") if trainer.is_fsdp_enabled  # sharded: every process's forward
                            else on_main_process(lambda: measure("fine-tuned model")))

    summary = {
        "settings": {**asdict(settings), "report_to": list(settings.report_to)},
        "model_dir": str(model_dir),
        "normalization": normalization,
        "data_format": data.format,
        "blocks": len(train),
        "global_step": trainer.state.global_step,
        "train_loss": output.training_loss,
        "evaluation": dict(evaluation_record(data.description, held_out, settings.block_size, original_perplexity,
                                             final_perplexity),
                           stages={"fine-tuning": curve}, data_format=data.format),
        "first_nonfinite": callback.first_nonfinite,
        "stopped_at_step": callback.stopped_at_step,
    }
    state_dict = gathered_state_dict(trainer)  # under FSDP: a collective, so before the main-process check
    if not is_main_process():  # under torchrun or accelerate launch, one process writes the run folder
        return summary
    history = Path(settings.out) / HISTORY_FILE
    figure = None
    if history.is_file() and history.stat().st_size > 0:  # at least one logging step
        figure = plot_norm_history(settings.out, Path(settings.out) / "norms.png",
                                   title=f"||A||_F per layer, fine-tuning with {normalization}")
        summary["norms_figure"] = str(figure)
    evaluation = summary["evaluation"]
    save_pretrained(model, settings.out, tokenizer=tokenizer, norm_history=figure,
                    evaluation=evaluation if evaluation["perplexity"] > 0 else None,  # no card figure for NaN
                    **({"state_dict": state_dict} if state_dict is not None else {}))
    write_json(Path(settings.out) / RESULT_FILE, summary)
    return summary

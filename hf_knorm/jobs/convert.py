"""``hf_knorm.convert`` / ``hf-knorm convert``: a pretrained softmax model converted to another normalization.

The recipe is LoLCATs' (Zhang et al., arXiv 2410.10254) applied to "Rethinking Softmax"'s normalizations
(arXiv 2410.18613); the paper itself only trains from scratch. Steps, in order (everything that can be wrong with
the input is checked before the model is loaded):

1. the settings, the data sources, the model folder and the run folder are checked: an unknown normalization or
   ``softmax`` (nothing to convert), a model already patched (conversion starts from the softmax original), a
   finished run in ``out``, an interrupted one without ``resume``;
2. the texts are split into training and held-out texts (:mod:`hf_knorm.data.heldout`) and packed into blocks;
   a held-out text too short for ``eval_tokens`` is refused;
3. the original model's held-out perplexity is measured: the reference line of every curve;
4. **attention transfer** (``out/transfer``, :mod:`.transfer`): the model is patched, each head's output scale is
   matched in closed form, then the chosen attention projections train to reproduce the original attention output
   layer by layer; a Trainer run with :class:`~hf_knorm.NormLoggerCallback` and held-out evaluation. The
   transferred model is saved in ``out/transfer/model``, with the transfer error per layer and position;
5. **recovery** (``out/recovery``): next-token training through LoRA adapters on q/k/v/o (peft; the default, the
   MLPs and embeddings frozen) or of the whole model (``recovery="full"``), distilled from the original model
   (``distill_weight``; 0 turns it off; by default against its top 256 tokens, computed once and cached, where
   the recovery reads at least half the training set: ``teacher_top_k``); LoRA adapters are merged before saving;
   ``x^p/c`` with a constant ``c`` is trained in both stages as its twin ``x^p/1`` and the constant folded into the
   queries at the end (:mod:`.twin`: the same function; ``fold_constant=False`` trains ``x^p/c`` itself);
   with ``clusters`` (``... + sparse K + clusters C``) the transfer trains the model without them, their codebooks
   are then fitted on the transferred model's keys (:mod:`hf_knorm.conversion.clusters`), and the recovery trains
   with them (where its blocks are longer than ``W + S + K``: shorter ones leave no pair to them), as does every
   figure after;
6. ``out`` ends with the converted model (an ordinary hf_knorm checkpoint: ``hf_knorm.from_pretrained(out)``), its
   tokenizer, its model card with the held-out perplexities, ``norms.png`` and ``convert.json`` (settings,
   each stage's curve, tokens, trainable parameters, throughput). ``convert.json`` is written last: its presence
   means the run finished.

``resume=True`` continues an interrupted run: a finished stage is not run again (the transfer's model is reloaded
from ``out/transfer/model``), an interrupted one continues from its last checkpoint.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict
from pathlib import Path

from ..normalizations import Normalization, parse_normalization, with_clusters
from ..conversion.mixture import GENERAL
from ..conversion.settings import RECOVERY_MODES, RECOVERY_TRAINABLE, SCALE_FOLDS, ConvertSettings
from ..conversion.state import STATE_FILE, read_state, write_state
from ..conversion.twin import fold_constant, training_normalization
from ..models.patching import held_normalization
from ..data.dataset_formats import LANGUAGE_MODELING, format_description
from ..evaluation.domains import domain
from ..runs.precision import check_precision, run_precision, weights_dtype
from ..runs.run_folder import (check_same_inputs, check_same_settings, inputs_fingerprint, is_main_process,
                               on_main_process, process_state, settings_record, write_json)
from ..runs.sharding import check_fsdp
from ..runs.sources import causal_lm_source, check_extras, check_sources
from ..training.window_dropout import check_window_dropout

RESULT_FILE = "convert.json"


def check_settings(settings: ConvertSettings) -> Normalization:
    """The checks that need neither the model nor the data; returns the normalization the run converts to (its
    spelling parsed once, here: :meth:`ConvertSettings.target`).

    Raises:
        ValueError: an unknown or softmax normalization, a bad number, a run folder in the wrong state.
        FileNotFoundError: a missing data file or model folder.
        MissingExtraError: TensorBoard logs or LoRA asked for and their package not installed (the ``train`` extra).
    """
    target = settings.target()
    if target.is_softmax:
        raise ValueError("Converting to softmax changes nothing: the original model is softmax. Pass another "
                         "--normalization (x/1, x/16, x^3/1, x^3/16, x^3/sqrtN, x^p/c).")
    if settings.recovery not in RECOVERY_MODES:
        raise ValueError(f"recovery must be one of {', '.join(RECOVERY_MODES)}, not {settings.recovery!r}.")
    if settings.recovery_trainable not in RECOVERY_TRAINABLE:
        raise ValueError(f"recovery_trainable must be one of {', '.join(RECOVERY_TRAINABLE)}, not "
                         f"{settings.recovery_trainable!r}.")
    if settings.scale_fold not in SCALE_FOLDS:
        raise ValueError(f"scale_fold must be one of {', '.join(SCALE_FOLDS)}, not {settings.scale_fold!r}.")
    for name in ("block_size", "batch_size", "gradient_accumulation_steps", "eval_tokens", "eval_steps",
                 "logging_steps", "save_steps", "lora_rank"):
        if getattr(settings, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(settings, name)}.")
    for name in ("transfer_steps", "recovery_steps", "warmup_steps", "teacher_tokens", "distill_weight",
                 "next_token_weight", "teacher_top_k"):
        if (getattr(settings, name) or 0) < 0:  # teacher_top_k None: its default
            raise ValueError(f"{name} must be >= 0, not {getattr(settings, name)}.")
    if not settings.budget > 0:
        raise ValueError(f"budget must be > 0 (a multiple of --recovery-steps), not {settings.budget}; "
                         "--recovery none skips the recovery.")
    if settings.recovery_steps > 0 and settings.scheduled_recovery_steps() == 0:
        raise ValueError(f"budget {settings.budget} times {settings.recovery_steps} recovery steps rounds to no step: "
                         "raise --budget, or pass --recovery none to skip the recovery.")
    if settings.recovery_learning_rate is not None and not settings.recovery_learning_rate > 0:
        raise ValueError(f"recovery_learning_rate must be > 0, not {settings.recovery_learning_rate}.")
    if settings.transfer_steps == 0 and (settings.recovery == "none" or settings.scheduled_recovery_steps() == 0):
        raise ValueError("Both stages are off (transfer_steps 0, no recovery): there is nothing to convert.")
    if settings.non_attention_lr_scale <= 0:
        raise ValueError(f"non_attention_lr_scale must be > 0, not {settings.non_attention_lr_scale} (freeze "
                         "those weights with --recovery-trainable attention instead).")
    if settings.teacher_top_k and settings.distill_weight == 0:
        raise ValueError("--teacher-top-k caches the teacher for the KL, and --distill-weight 0 has no KL: drop either.")
    if settings.recovery != "none" and settings.next_token_weight == 0 and settings.distill_weight == 0:
        raise ValueError("Recovery with next_token_weight 0 and distill_weight 0 has no loss: raise either.")
    if settings.cluster_tokens is not None and not target.clusters:
        raise ValueError(f"--cluster-tokens sizes the fit of the cluster codebooks, and {target.name} has no clusters: "
                         "drop it, or give --clusters C.")
    if settings.cluster_tokens is not None and settings.cluster_tokens < target.clusters:
        raise ValueError(f"cluster_tokens must be at least the number of clusters ({target.clusters}: one key per "
                         f"direction), not {settings.cluster_tokens}.")
    check_window_dropout(settings.window_dropout, settings.window_dropout_schedule)
    if settings.window_dropout and not target.window:
        raise ValueError(f"--window-dropout {settings.window_dropout} drops the softmax window on some recovery "
                         f"steps, and {target.name} has none: give --softmax-window W > 0, or --window-dropout 0.")
    if settings.window_dropout and (settings.recovery == "none" or settings.scheduled_recovery_steps() == 0):
        raise ValueError(f"--window-dropout {settings.window_dropout} applies in the recovery, and this conversion "
                         "has none: give --recovery lora or full with recovery steps, or --window-dropout 0.")
    for name in settings.domains():
        domain(name)
    if settings.beyond_window:
        from ..conversion.beyond_window import check_block

        check_block(settings.beyond_window_block)
    if settings.dataset == "chatterbot" and "conversation" in settings.domains():
        raise ValueError("--dataset chatterbot trains on the conversation domain's own text, which would then not be "
                         "held out: leave conversation out of --eval-domains (e.g. essays,plays,technical).")
    check_extras("hf-knorm convert", settings.integrations(), lora=settings.recovery == "lora")
    check_fsdp("hf-knorm convert", supported=False)
    check_precision(settings.bf16, settings.fp16)
    check_sources(settings.dataset if settings.dataset != GENERAL else "paul-graham", settings.eval_dataset,
                  settings.model)
    out = Path(settings.out)
    finished = (out / RESULT_FILE).is_file()
    started = (out / STATE_FILE).is_file()
    if finished:
        raise ValueError(f"{out} holds a finished conversion ({RESULT_FILE}); pass another --out.")
    if started and not settings.resume and is_main_process():  # another process may see its own launch's main
        # process's state file already (written after the original's evaluation): the main process decides
        raise ValueError(f"{out} holds an interrupted conversion: pass --resume to continue it, or another --out.")
    if settings.resume and not started:
        raise ValueError(f"--resume: {out} holds no conversion to continue ({STATE_FILE} is missing).")
    if settings.resume:  # a run records its settings resolved (settings.resolved), so compare them resolved
        stored = _with_clusters_recorded(_with_sparse_score_recorded(_with_sparse_cache_recorded(
            read_state(out).get("settings"))))
        check_same_settings(stored, settings.resolved(target))
    return target


def _with_sparse_cache_recorded(stored: dict | None) -> dict | None:
    """A settings record from before ``--sparse-cache`` had a default (it lacks the field) with the value it ran with:
    0, unless its spelling named a cache (then ``None``, the spelling's), so that resuming such a run with today's
    default (256 pairs) is refused as a change of settings."""
    if not stored or "sparse_cache" in stored:
        return stored
    spelled = parse_normalization(stored.get("normalization", "x/1")).sparse
    return {**stored, "sparse_cache": None if spelled else 0}


SPARSE_SCORE_BEFORE_RECORDING = "value_over_key"
"""The default score of runs whose record left ``sparse_score`` unresolved (before it was recorded resolved)."""


def _with_sparse_score_recorded(stored: dict | None) -> dict | None:
    """A settings record that left ``sparse_score`` at ``None`` with a sparse cache ran with the spelling's score, or
    with :data:`SPARSE_SCORE_BEFORE_RECORDING`, the default then: filled in, so that resuming it with another default
    is refused as a change of settings (``--sparse-score value_over_key`` resumes it)."""
    if not stored or stored.get("sparse_score") is not None:
        return stored
    shaping = ("normalization", "softmax_window", "attention_sinks", "sparse_cache")
    try:
        recorded = ConvertSettings(**{name: stored[name] for name in shaping if name in stored}).target()
    except ValueError:  # a record this version cannot read: check_same_settings names what differs
        return stored
    if not recorded.sparse:
        return stored
    spelled = parse_normalization(stored.get("normalization", "x/1")).sparse
    return {**stored, "sparse_score": recorded.score if spelled else SPARSE_SCORE_BEFORE_RECORDING}


def _with_clusters_recorded(stored: dict | None) -> dict | None:
    """A settings record that left ``clusters`` at ``None`` (or lacks it: before they were recorded resolved, and
    before they had a default) ran with the spelling's clusters, else none: filled in, so that resuming it with
    today's default is refused as a change of settings (``--clusters 0`` resumes it)."""
    if not stored or stored.get("clusters") is not None:
        return stored
    try:
        spelled = parse_normalization(stored.get("normalization", "x/1")).clusters
    except ValueError:  # a record this version cannot read: check_same_settings names what differs
        return stored
    return {**stored, "clusters": spelled}


def convert(settings: ConvertSettings | None = None, **fields) -> dict:
    """Convert a pretrained softmax causal LM to another normalization (the Python side of ``hf-knorm convert``).

    Examples:
        >>> summary = hf_knorm.convert(out="runs/converted")          # the embedded default model, the defaults
        >>> model = hf_knorm.from_pretrained("runs/converted")
        >>> summary["evaluation"]["perplexity"], summary["evaluation"]["original_perplexity"]

    Args:
        settings: a :class:`~hf_knorm.conversion.settings.ConvertSettings`; default: its defaults.
        **fields: settings fields to change (``model=``, ``dataset=``, ``recovery="full"``, ...).

    Returns:
        What ``convert.json`` records (see :func:`run_convert`).
    """
    from dataclasses import replace

    return run_convert(replace(settings or ConvertSettings(), **fields))


def run_convert(settings: ConvertSettings) -> dict:
    """Convert as ``settings`` say (see the module docstring); returns what ``convert.json`` records.

    Raises:
        ValueError, FileNotFoundError: bad input, always before the first training step.
    """
    import transformers

    from ..conversion.beyond_window import (beyond_window_blocks, beyond_window_perplexities, beyond_window_record,
                                            measure_converted)
    from ..data.heldout import held_out_domain_blocks, held_out_perplexity
    from ..evaluation.retrieval import retrieval_records

    clustered = check_settings(settings)
    settings = settings.resolved(clustered)
    target = with_clusters(clustered, 0)  # the transfer trains without clusters; the recovery with them
    normalization = target.name
    model_dir, config = causal_lm_source(settings.model, settings.block_size, "convert converts")
    already = (getattr(config, "hf_knorm", None) or {}).get("normalization")
    if already is not None:
        raise ValueError(f"{model_dir} is already patched with {already}. Conversion starts from the original softmax "
                         "model: pass the model it was made from.")
    if clustered.clusters and getattr(config.get_text_config(), "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{model_dir}'s attention has a softcap (Gemma 2), which bends each score: a cluster's mean "
                         f"key no longer gives its pairs' mean score, so {clustered.name} is not defined there. "
                         "Pass --clusters 0 (the sparse cache alone).")

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "chat_template", None) and (settings.probe or settings.dataset == GENERAL):
        raise ValueError(f"{model_dir}'s tokenizer has no chat template, which the ability probe and the general "
                         "mixture's instructions use: pass --no-probe and another --dataset.")
    process = process_state()
    train, own_held_out, mixture, descriptions = None, None, None, {}
    data_format = format_description(LANGUAGE_MODELING)
    with process.main_process_first():  # its datasets.map calls fill the cache once, the others read it
        eval_sets = held_out_domain_blocks(settings.domains(), tokenizer, settings.block_size, settings.eval_tokens)
        if settings.dataset != GENERAL:
            train, own_held_out, descriptions[OWN_HELD_OUT], data_format = _training_data(settings, tokenizer)
        long_sets = (beyond_window_blocks(settings.domains(), tokenizer, settings.eval_tokens,
                                          settings.beyond_window_block)
                     if settings.beyond_window and settings.domains() else None)
    if own_held_out is not None:
        eval_sets = {OWN_HELD_OUT: own_held_out, **eval_sets}
    if not eval_sets:
        raise ValueError("No held-out text to evaluate on: name held-out domains (--eval-domains) or pass "
                         "--eval-dataset.")

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    state = read_state(out)
    process.wait_for_everyone()  # every process has read the state before the main one writes it
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights_dtype())  # fp32 weights
    device = process.device  # where the Trainer trains it: the original is evaluated, probed and sampled there
    model.to(device)

    def precision():  # ... and in the run's precision (--bf16: autocast), as the Trainer evaluates
        return run_precision(device, settings.bf16, settings.fp16)

    if settings.dataset == GENERAL:
        with process.main_process_first(), precision():  # the main process samples and caches, the others read
            train, mixture = _general_training_data(model, tokenizer, model_dir, settings, process.num_processes)
    inputs = inputs_fingerprint(model_dir, {"training": train, **{f"held-out {name}": blocks
                                                                  for name, blocks in eval_sets.items()}})
    if "original_perplexity" in state:  # resumed: the data and the model folder as the run started
        check_same_inputs(state.get("inputs"), inputs, out)
    if "original_perplexity" not in state:
        state["inputs"] = inputs
        state["trained_as"] = (training_normalization(model, target).name if settings.fold_constant
                               else normalization)

        def measure_original():  # once, on the main process, the others waiting for its figures
            with precision():
                perplexity = {name: held_out_perplexity(model, blocks, desc=f"original model, {name}")
                              for name, blocks in eval_sets.items()}
                answers = [asdict(answer) for answer in _probe(model, tokenizer)] if settings.probe else None
                beyond = None if long_sets is None else {
                    "perplexity": beyond_window_perplexities(model, long_sets, "original model"),
                    "retrieval": retrieval_records(model, tokenizer, **settings.retrieval(),
                                                   desc="original model, retrieval")}
            return perplexity, answers, beyond

        state["original_perplexity"], answers, beyond = on_main_process(measure_original)
        if settings.probe:
            state["original_probe"] = answers
        if beyond is not None:
            state["original_beyond_window"] = beyond
        state["settings"] = settings_record(settings)
        write_state(out, state)
    teacher = copy.deepcopy(model).eval() if settings.distill_weight > 0 and settings.recovery != "none" else None

    from ..conversion.clusters import add_clusters
    from ..conversion.stages import run_recovery, run_transfer

    collator = examples_collator(train, tokenizer)
    trained = state.get("trained_as", normalization)  # a run started before twins trained x^p/c itself
    trained_as = target if trained == normalization else parse_normalization(trained)  # read back from the state

    def fitted_clusters(model):
        """The clusters' codebooks fitted on ``model``'s keys (conversion/clusters.py) where it has none yet: the
        transferred model, so that the recovery trains with them (or a recovered model of a release that fitted them
        after the recovery, resumed)."""
        if clustered.clusters and not held_normalization(model).clusters:
            add_clusters(model, tokenizer, clustered.clusters, seed=settings.seed, tokens=settings.cluster_tokens)
        return model

    model = run_transfer(model, settings, trained_as, train, eval_sets, out, state, collator)
    if not state.get("recovery", {}).get("done"):  # a finished recovery's model is loaded with its own
        model = fitted_clusters(model)
    model = fitted_clusters(run_recovery(model, settings, train, eval_sets, out, state, teacher, collator,
                                         evaluate_at_start=bool(clustered.clusters)))
    if trained != normalization:
        fold_constant(model, target)  # the same function under x^p/c (twin.py)
    normalization = clustered.name

    model.eval()
    with precision():
        final = on_main_process(lambda: _final_perplexities(model, eval_sets, state))
    summary = _summary(settings, normalization, model_dir, eval_sets, descriptions, len(train), state, final, mixture)
    summary["trained_as"] = trained
    summary["data_format"] = summary["evaluation"]["data_format"] = data_format
    if settings.probe:
        from ..evaluation.probe import ProbeAnswer, compare

        reference = [ProbeAnswer(**answer) for answer in state["original_probe"]]
        with precision():
            summary["probe"] = on_main_process(lambda: compare(_probe(model, tokenizer), reference))
    if long_sets is not None:
        with precision():
            converted = on_main_process(lambda: measure_converted(model, tokenizer, long_sets, settings.retrieval(),
                                                                  windowed=target.window > 0))
        summary["beyond_window"] = beyond_window_record(state["original_beyond_window"], converted,
                                                        settings.beyond_window_block)
    _save(model, tokenizer, out, summary)
    return summary


OWN_HELD_OUT = "held_out"
"""The evaluation set of the training data's own held-out texts (``--eval-dataset``, or split off ``--dataset``)."""


def _training_data(settings: ConvertSettings, tokenizer):
    """``(training examples, held-out examples or None, their description, the data format)`` of a dataset named by
    ``--dataset`` (not the mixture): text, conversations or prompt/completion pairs
    (:mod:`hf_knorm.data.dataset_formats`).

    The held-out examples are the training data's own (``--eval-dataset`` or its last ``--eval-fraction``), evaluated
    beside the domains; ``paul-graham`` has none of its own: its held-out essays are the ``essays`` domain.
    """
    from ..data.heldout import training_and_held_out

    data = training_and_held_out(
        settings.dataset, tokenizer, settings.block_size, settings.eval_tokens, settings.text_column, settings.split,
        settings.eval_dataset, settings.eval_fraction, settings.max_blocks, settings.train_on_prompt)
    own = settings.eval_dataset is not None or settings.dataset != "paul-graham"
    description = data.description
    if data.format["format"] != LANGUAGE_MODELING:
        description += f", scored on {data.format['loss_on']}"
    return data.train, data.held_out if own else None, description, data.format


def _general_training_data(model, tokenizer, model_dir: Path, settings: ConvertSettings, processes: int = 1):
    """``(training blocks, description)`` of the general mixture (:mod:`.mixture`), sampling the teacher texts once
    (no more than the run can train on: :func:`.mixture.teacher_tokens_for`): the essays packed into blocks, the
    teacher samples packed with them or one example each (from position 0)."""
    import datasets

    from ..data.text_data import pack_dataset, sequence_dataset
    from ..conversion.mixture import general_mixture, teacher_tokens_for

    steps = settings.transfer_steps + (settings.scheduled_recovery_steps() if settings.recovery != "none" else 0)
    examples = settings.examples_drawn(steps, processes)  # what both stages draw
    tokens = teacher_tokens_for(settings.teacher_tokens, examples)
    texts, description = general_mixture(model, tokenizer, model_dir, tokens)  # one fixed sample
    packed = texts["essays"] + (texts["teacher_samples"] if settings.pack_teacher_samples else [])
    train = pack_dataset(datasets.Dataset.from_dict({"text": packed}), tokenizer, settings.block_size)
    if not settings.pack_teacher_samples and texts["teacher_samples"]:
        train = train.add_column("attention_mask", [[1] * settings.block_size] * len(train))
        samples = sequence_dataset(datasets.Dataset.from_dict({"text": texts["teacher_samples"]}), tokenizer,
                                   settings.block_size)
        train = datasets.concatenate_datasets([train, samples.cast(train.features)])
    if settings.max_blocks is not None and len(train) > settings.max_blocks:
        train = train.shuffle(seed=settings.seed).select(range(settings.max_blocks))
    return train, dict(description, blocks=len(train))


def examples_collator(train, tokenizer):
    """How a stage batches ``train``: blocks of one length are stacked (``default_data_collator``); examples of
    several lengths (one per conversation or prompt/completion pair) are padded on the right, ``-100`` labels and a 0
    attention mask on the padding, as TRL's ``SFTTrainer`` pads them under ``finetune``: through Transformers' public
    ``DataCollatorForSeq2Seq`` (TRL's own collator is not part of its public API), on a copy of the tokenizer set to
    pad on the right (the end-of-text token as padding where it has no pad token)."""
    import copy

    import transformers

    if len({len(ids) for ids in train["input_ids"]}) == 1:
        return transformers.default_data_collator
    padder = copy.deepcopy(tokenizer)
    padder.padding_side = "right"
    if padder.pad_token is None:
        padder.pad_token = padder.eos_token
    return transformers.DataCollatorForSeq2Seq(padder, padding=True, label_pad_token_id=-100, return_tensors="pt")


def _probe(model, tokenizer):
    from ..evaluation.probe import ask

    return ask(model, tokenizer)


def _final_perplexities(model, eval_sets: dict, state: dict) -> dict[str, float]:
    """Each set's perplexity of the converted model: the last stage's evaluation at its last step when there was
    one (the Trainer evaluates at the end when the steps are a multiple of ``eval_steps``), else measured now."""
    from ..data.heldout import held_out_perplexity

    stage = state.get("recovery") or state.get("transfer") or {}
    final = {}
    for name, blocks in eval_sets.items():
        curve = stage.get("curves", {}).get(name) or []
        if curve and curve[-1][0] == stage.get("steps"):
            final[name] = curve[-1][2]
        else:
            final[name] = held_out_perplexity(model, blocks, desc=f"converted model, {name}")
    return final


def _summary(settings, normalization, model_dir, eval_sets, descriptions, train_blocks, state, final, mixture) -> dict:
    from ..data.heldout import domains_record

    evaluation = domains_record(eval_sets, settings.block_size, state["original_perplexity"], final, descriptions)
    stages = {name: state[name] for name in ("transfer", "recovery") if name in state}
    for stage in stages.values():  # the headline curve: the worst domain's
        stage["curve"] = stage.get("curves", {}).get(evaluation["worst_domain"], [])
    return {
        "settings": asdict(settings),
        "model_dir": str(model_dir),
        "normalization": normalization,
        "evaluation": evaluation,
        "training_data": mixture or {"dataset": settings.dataset},
        "training_blocks": train_blocks,
        "stages": stages,
        "seconds": time.time() - state["started"],
    }


def _save(model, tokenizer, out: Path, summary: dict) -> None:
    """The converted model with its card, the figures and ``convert.json`` (written last), from the main process."""
    if not is_main_process():
        return
    from ..hub.saving import save_pretrained
    from ..training.norm_figure import plot_norm_history

    runs = [out / name for name in ("transfer", "recovery") if (out / name / "norms.jsonl").is_file()]
    figure = None
    if runs:
        figure = plot_norm_history(runs, out / "norms.png", labels=[run.name for run in runs],
                                   title=f"||A||_F per layer, conversion to {summary['normalization']}")
    summary["perplexity_figure"] = str(plot_conversion_curve(summary, out / "perplexity.png"))
    save_pretrained(model, out, tokenizer=tokenizer, norm_history=figure, evaluation=card_evaluation(summary))
    write_json(out / RESULT_FILE, summary)


def card_evaluation(summary: dict) -> dict:
    """What the model card shows of a conversion (``convert.json``): the held-out record, each stage's headline
    curve, the ability probe's figures, the beyond-window record without its answers, the twin the stages trained (:mod:`.twin`) where it differs."""
    evaluation = dict(summary["evaluation"], stages={
        name: stage.get("curve", []) for name, stage in summary["stages"].items()})
    if "probe" in summary:
        evaluation["probe"] = {key: value for key, value in summary["probe"].items() if key != "answers"}
    if "beyond_window" in summary:
        evaluation["beyond_window"] = {key: value for key, value in summary["beyond_window"].items()
                                       if key != "answers"}
    if summary.get("trained_as", summary["normalization"]) != summary["normalization"]:
        evaluation["trained_as"] = summary["trained_as"]
    return evaluation


def plot_conversion_curve(summary: dict, path: Path) -> Path:
    """Held-out perplexity of every evaluation set over training tokens (transfer, then recovery), each against the
    original model's line."""
    from ..plots import plot_perplexity_curves

    evaluation = summary["evaluation"]
    curves, references = {}, {}
    for name, record in evaluation["domains"].items():
        offset, points = 0, []
        for stage_name in ("transfer", "recovery"):
            stage = summary["stages"].get(stage_name)
            if stage:
                points += [(offset + tokens, value) for _, tokens, value in stage.get("curves", {}).get(name, [])]
                offset += stage["tokens"]
        curves[name] = points
        references[f"original, {name}"] = record["original_perplexity"]
    return plot_perplexity_curves(
        curves, path, references=references, matched=True,
        title=f"Conversion to {summary['normalization']}: held-out perplexity ({evaluation['tokens']} tokens a set)")

"""What a training job checks before it loads anything heavy: the data files, the model folder, the extras it will
need, and that the model is a supported causal LM whose positions hold a block."""

from __future__ import annotations

from ..extras import require
from ..models.architectures import architecture_of
from ..models.sources import model_folder
from ..data.text_data import local_files, model_max_length


def check_sources(dataset: str, eval_dataset: str | None, model: str) -> None:
    """The data files and the model a job names exist (before anything is loaded).

    Raises:
        FileNotFoundError: a missing data file; ModelNotFoundError (one) for a model that is not ``"default"``, not a
            folder, and not a Hub id in the local Hub cache (:func:`hf_knorm.models.sources.model_folder`, the one
            rule of the library and every job). ValueError: files of mixed or unsupported kinds.
    """
    local_files(dataset)
    if eval_dataset is not None:
        local_files(eval_dataset)
    model_folder(model)


def check_extras(job: str, report_to, lora: bool = False) -> None:
    """The optional packages a training job needs are installed: ``datasets`` and ``trl`` always, ``tensorboard``
    when it reports there, ``peft`` for LoRA (the ``train`` extra). Checked before any model is loaded.

    Raises:
        MissingExtraError: one is missing; the message names the extra to install.
    """
    require("datasets", f"{job}'s datasets")
    require("trl", f"{job} (TRL's SFTTrainer and its packing)")
    if "tensorboard" in report_to:
        require("tensorboard", f"{job}'s TensorBoard logs (--report-to tensorboard, the default; none turns it off)")
    if lora:
        require("peft", f"{job} with LoRA (--recovery lora)")


def causal_lm_source(model: str, block_size: int, job: str = "this job takes"):
    """``(folder, config)`` of a job's model (:func:`~hf_knorm.models.sources.model_folder`: ``"default"``, a
    checkpoint folder or a Hub id in the local Hub cache, never downloaded), checked to be a supported causal LM
    whose positions hold ``block_size`` tokens.

    Raises:
        ValueError: an unsupported architecture, an encoder, or a block size above the model's maximum.
    """
    import transformers

    folder = model_folder(model)
    config = transformers.AutoConfig.from_pretrained(folder)
    spec = architecture_of(config)
    if not spec.causal:
        raise ValueError(f"{job} causal language models; {folder} is a {spec.model_type} encoder.")
    maximum = model_max_length(config)
    if maximum is not None and block_size > maximum:
        raise ValueError(f"--block-size {block_size} is above the model's maximum of {maximum} positions.")
    return folder, config

"""What a training job checks before it loads anything heavy: the data files, the model folder, the extras it will
need, and that the model is a supported causal LM whose positions hold a block."""

from __future__ import annotations

from pathlib import Path

from ..extras import require
from ..models.architectures import architecture_of
from ..data.text_data import local_files, model_max_length


def check_sources(dataset: str, eval_dataset: str | None, model: str) -> None:
    """The data files and the model a job names exist (before anything is loaded).

    Raises:
        FileNotFoundError: a missing data file, or a model that is no folder and no Hub id in the local Hub cache. ValueError: files of mixed or unsupported kinds.
    """
    local_files(dataset)
    if eval_dataset is not None:
        local_files(eval_dataset)
    model_folder(model)


def model_folder(model: str) -> Path:
    """The folder of a job's ``--model``: ``"default"`` (the embedded SmolLM2-135M-Instruct), a checkpoint folder, or
    a Hub id (``org/name``) resolved through the local Hub cache only (``HF_HUB_CACHE``; nothing is downloaded: this
    machine may have no network), as ``from_pretrained(..., local_files_only=True)`` would find it.

    Raises:
        FileNotFoundError: neither a folder nor a Hub id in the local cache; the message names both forms.
    """
    if model == "default":
        from ..assets.default_model import default_model_dir

        return Path(default_model_dir())
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=model, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError):
        raise FileNotFoundError(
            f"No model folder at {model!r}, and no Hub model {model!r} in the local Hub cache ({constants.HF_HUB_CACHE}). "
            "Pass 'default', a checkpoint folder, or the id of a Hub model already downloaded to this cache "
            f"(hf download {model}, where the Hub is reachable)."
        ) from None


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
    """``(folder, config)`` of a job's model (:func:`model_folder`: ``"default"``, a checkpoint folder or a Hub id in
    the local Hub cache), checked to be a supported causal LM whose positions hold ``block_size`` tokens.

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

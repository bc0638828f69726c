"""The ``hf-knorm push`` job: its settings (the command's flags) and the run (:func:`hf_knorm.hub.push_folder`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from huggingface_hub import CommitInfo

from ..hub.push import push_folder


@dataclass
class PushSettings:
    """The flags of ``hf-knorm push`` (the folder and the repo id are its positional arguments)."""

    private: bool = field(default=False, metadata={
        "help": "create the repo private (an existing repo keeps its visibility)"})
    token: str | None = field(default=None, repr=False, metadata={
        "help": "a Hugging Face write token (without it: HF_TOKEN, else the saved login)"})
    commit_message: str | None = field(default=None, metadata={
        "help": "the commit message (without it: one saying what is pushed)"})
    no_tokenizer: bool = field(default=False, metadata={
        "help": "push a causal LM whose folder has no tokenizer (refused otherwise)"})


def run_push(model_dir, repo_id: str, settings: PushSettings) -> CommitInfo:
    """``hf-knorm push MODEL_DIR REPO_ID [flags]``: :func:`push_folder` with the command's settings."""
    return push_folder(model_dir, repo_id, private=settings.private or None, token=settings.token,
                       commit_message=settings.commit_message, without_tokenizer=settings.no_tokenizer)

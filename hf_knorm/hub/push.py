"""``hf_knorm.push_to_hub`` and ``push_folder`` (``hf-knorm push``, :mod:`hf_knorm.jobs.push`): a saved model folder
and its card, in one commit.

Through ``huggingface_hub.HfApi`` (the endpoint is ``HF_ENDPOINT``'s): ``create_repo`` (``exist_ok``), ``repo_info``
and the current ``README.md`` (so a re-push keeps what the user wrote on the card), then **one** ``create_commit``
with every file of the folder, the card rendered for this repo, and the deletion of weight files an earlier push left
that this one does not replace (a stale shard would be loaded with the new ones). ``upload_folder`` is not used: with
``hf_xet`` installed it commits large folders in several batches, and a failure between two batches would leave a
config of one model beside the weights of another. One commit is all or nothing: when a push fails midway, the
error says that nothing was committed and which files did not reach the repo.

Which earlier card keeps its text: the folder's ``README.md`` when the user wrote something in it (text outside the
generated block, or metadata keys hf_knorm does not own), else the card on the Hub, else none.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import HTTPError

from ..version import __version__
from .card import BEGIN, END, render_card
from .checks import (
    WEIGHT_FILES,
    WEIGHT_INDEXES,
    check_repo_id,
    check_saved_model,
    has_tokenizer,
    is_causal_lm,
    missing_tokenizer_error,
    resolve_token,
)
from .saving import CARD_FILE, save_pretrained

WEIGHT_SUFFIXES = (".safetensors", ".bin")
OWNED_METADATA = {"library_name", "tags", "base_model", "pipeline_tag"}


class HubPushError(RuntimeError):
    """A push that the Hub refused or that failed in transit; the message says what reached the repo."""


def push_to_hub(model, repo_id: str, tokenizer=None, *, private: bool | None = None, token: str | None = None,
                commit_message: str | None = None, base_model: str | None = None, balance_report=None, niah=None,
                norm_history=None) -> CommitInfo:
    """Push ``model``, its config, its tokenizer and its card to ``repo_id`` in one commit.

    Everything hf_knorm changed travels in ``config.json`` (normalization, K/V balancing scales, plugin version,
    the ``attn_implementation`` marker): ``hf_knorm.from_pretrained(repo_id)`` gives the same logits back.

    Args:
        model: a Transformers model, patched or not (a plain model's card says it is unmodified).
        repo_id: ``namespace/name``; created if it does not exist.
        tokenizer: its tokenizer or processor. Required for a causal LM; ``False`` pushes one without it.
        private: make a new repo private (ignored when the repo exists, as by the Hub).
        token: a write token; default ``$HF_TOKEN``, else the token file of ``hf auth login``.
        commit_message: default: what was pushed.
        base_model, balance_report, niah, norm_history: card inputs, see :func:`hf_knorm.save_pretrained`.

    Returns:
        The commit (``.commit_url``, ``.oid``).

    Raises:
        ValueError: invalid repo id, no token, a causal LM without ``tokenizer`` (all before anything is sent).
        HubPushError: the Hub refused the push or it failed in transit; nothing was committed.
    """
    check_repo_id(repo_id)
    token = resolve_token(token)
    if tokenizer is None and getattr(model, "can_generate", lambda: False)():
        raise missing_tokenizer_error("The model", "pass tokenizer=False")
    with tempfile.TemporaryDirectory(prefix="hf_knorm_push_") as tmp:
        save_pretrained(model, tmp, tokenizer=tokenizer or None, repo_id=repo_id, base_model=base_model,
                        balance_report=balance_report, niah=niah, norm_history=norm_history)
        return _push(Path(tmp), repo_id, token, private, commit_message)


def push_folder(model_dir, repo_id: str, *, private: bool | None = None, token: str | None = None,
                commit_message: str | None = None, without_tokenizer: bool = False) -> CommitInfo:
    """Push a folder saved by :func:`hf_knorm.save_pretrained` (or by Transformers) in one commit; ``hf-knorm push``.

    The card is rendered again for ``repo_id`` from the folder's config and card inputs.

    Args:
        model_dir: the saved folder.
        repo_id, private, token, commit_message: as in :func:`push_to_hub`.
        without_tokenizer: push a causal LM whose folder has no tokenizer files.

    Raises:
        FileNotFoundError, ValueError: not a saved model folder (or a ``config.json`` of a patched model that lost
            its ``attn_implementation`` marker), invalid repo id, no token, no tokenizer (before anything is sent).
        HubPushError: as in :func:`push_to_hub`.
    """
    folder, config = check_saved_model(model_dir)
    check_repo_id(repo_id)
    token = resolve_token(token)
    if is_causal_lm(config) and not has_tokenizer(folder) and not without_tokenizer:
        raise missing_tokenizer_error(str(folder), "pass without_tokenizer=True (--no-tokenizer)")
    return _push(folder, repo_id, token, private, commit_message)


def _push(folder: Path, repo_id: str, token: str, private: bool | None, commit_message: str | None) -> CommitInfo:
    api = HfApi(token=token, library_name="hf_knorm", library_version=__version__)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    names = sorted(set(files) | {CARD_FILE})
    local_card = (folder / CARD_FILE).read_text() if (folder / CARD_FILE).is_file() else None
    render_card(folder, repo_id, local_card)  # a card that cannot be rendered fails here, before any request
    with _failures_reported(repo_id, names, "creating the repo"):
        api.create_repo(repo_id, private=private, exist_ok=True)
    with _failures_reported(repo_id, names, "reading the repo's files"):
        remote = {sibling.rfilename for sibling in api.repo_info(repo_id).siblings or []}
        remote_card = _download_card(api, repo_id) if CARD_FILE in remote else None
    previous = local_card if local_card and _user_wrote(local_card) else (remote_card or local_card)
    card = render_card(folder, repo_id, previous)
    config = json.loads((folder / "config.json").read_text())

    operations = [CommitOperationDelete(path) for path in sorted(remote - set(names)) if _is_weight_file(path)]
    for name in files:
        if name == CARD_FILE:
            continue
        operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)))
    operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=str(card).encode()))

    normalization = (config.get("hf_knorm") or {}).get("normalization")
    message = commit_message or (f"Upload {normalization} model with hf_knorm {__version__}" if normalization
                                 else f"Upload model with hf_knorm {__version__}")
    description = "Files: " + ", ".join(names)
    deleted = [op.path_in_repo for op in operations if isinstance(op, CommitOperationDelete)]
    if deleted:
        description += ". Removed stale weight files: " + ", ".join(deleted)
    with _failures_reported(repo_id, names, remote=remote):
        return api.create_commit(repo_id, operations, commit_message=message, commit_description=description)


def _download_card(api: HfApi, repo_id: str) -> str:
    with tempfile.TemporaryDirectory(prefix="hf_knorm_card_") as tmp:
        return Path(api.hf_hub_download(repo_id, CARD_FILE, local_dir=tmp)).read_text()


def _user_wrote(card_text: str) -> bool:
    """Whether a card has text outside the generated block, or metadata hf_knorm does not own."""
    from huggingface_hub import ModelCard

    card = ModelCard(card_text, ignore_metadata_errors=True)
    body = card.text
    if BEGIN in body and END in body:
        body = body.split(BEGIN, 1)[0] + body.split(END, 1)[1]
    lines = [line for line in body.splitlines() if line.strip() and not line.startswith("<!-- Text outside the block")]
    metadata = card.data.to_dict()
    own_tags = {tag for tag in metadata.get("tags") or [] if tag == "hf-knorm" or tag == "kv-balancing"
                or tag.startswith("normalization-")}
    return bool(lines) or bool(set(metadata) - OWNED_METADATA) or set(metadata.get("tags") or []) != own_tags


def _is_weight_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES or name in WEIGHT_FILES


@contextmanager
def _failures_reported(repo_id: str, names: list[str], step: str | None = None, remote: set[str] | None = None):
    """Turn a failed push step into a :class:`HubPushError` that says what reached the repo.

    ``remote`` (the repo's files before the commit) is given for the commit step, ``None`` for the steps before it.
    """
    try:
        yield
    except Exception as error:
        cause = error  # huggingface_hub wraps a failed LFS upload in a RuntimeError: find the HTTP error under it
        while cause is not None and not isinstance(cause, (HTTPError, OSError, ValueError)):
            cause = cause.__cause__
        if cause is None:
            raise
        if remote is None:
            outcome = "Nothing was uploaded."
        else:
            held = f"the {len(remote)} files it had before" if remote else "no files, as before"
            outcome = (f"Nothing was committed: the push is a single commit, so {repo_id} still holds {held}. "
                       f"Not in the repo: {', '.join(names)}. Large files already sent to storage belong to no "
                       "commit; running the same push again sends only what the Hub does not have yet.")
        if getattr(getattr(cause, "response", None), "status_code", None) in (401, 403):
            outcome = (f"The Hub refused the token: check that it is valid and has write access to "
                       f"{repo_id.split('/')[0]}. {outcome}")
        detail = _describe(cause) if cause is error else f"{error} ({_describe(cause)})"
        step = step or _commit_step(cause)
        raise HubPushError(f"Pushing to {repo_id} failed while {step}: {detail}. {outcome}") from error


def _commit_step(error: Exception) -> str:
    response = getattr(error, "response", None)
    request = getattr(response, "request", None) if response is not None else None
    url = str(getattr(request, "url", "")) if request is not None else ""
    if "/validate-yaml" in url:
        return "validating the card's metadata"
    if "/preupload/" in url:
        return "preparing the upload"
    if "/commit/" in url:
        return "creating the commit"
    if url:
        return "uploading the large files"
    return "uploading"


def _describe(error: Exception) -> str:
    """``"<status> <server's message>"`` for an HTTP error, else the error's first line."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    message = (getattr(error, "server_message", None) or "").strip()
    if not message:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{status} {message}" if status else message

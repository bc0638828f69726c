"""Fixtures of the Hub tests: the loopback stand-in wired into huggingface_hub, a tiny tokenizer, fresh processes.

``hub`` points huggingface_hub at a :class:`HubStandIn` for one test (in-process: its endpoint constants, Xet off so
uploads take the LFS path the stand-in speaks, telemetry off as in :func:`fresh_env`, a token in ``HF_TOKEN``, an
empty token file and cache) and refuses every connection outside the loopback interface. With telemetry off,
huggingface_hub sends only the requests of the API calls made (with it on, building the user agent may first fetch
the Hub's agent-harness registry, depending on this machine's cache), so a test can assert every request it sees.
:func:`fresh_env` gives a subprocess the same world through its environment (``HF_ENDPOINT`` and the rest), with the
same guard installed as ``sitecustomize``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hub_standin import TOKEN, HubStandIn, guard_network, offline_guard_source

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running :class:`HubStandIn` that huggingface_hub (and Transformers) talk to, with a valid token set."""
    from huggingface_hub import constants

    guard_network(monkeypatch)
    with HubStandIn() as standin:
        monkeypatch.setattr(constants, "ENDPOINT", standin.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            standin.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token_file"))
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
        import transformers.utils.hub as transformers_hub

        monkeypatch.setattr(transformers_hub, "_hf_api", None)  # its shared HfApi must see the stand-in's endpoint
        yield standin


def fresh_env(tmp_path: Path, endpoint: str | None, token: str | None = TOKEN) -> dict:
    """The environment of a fresh Python process that sees only the stand-in (and this worktree's hf_knorm)."""
    guard = tmp_path / "offline_guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(offline_guard_source())
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("HF_", "HUGGINGFACE_")) and key not in ("PYTHONPATH",)}
    env.update(PYTHONPATH=os.pathsep.join([str(guard), str(ROOT)]), HF_HOME=str(tmp_path / "hf_home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TRANSFORMERS_VERBOSITY="error")
    if endpoint is not None:
        env["HF_ENDPOINT"] = endpoint
    if token is not None:
        env["HF_TOKEN"] = token
    return env


PYTHON = sys.executable


def tiny_tokenizer():
    """A word-level tokenizer over the 128 ids of the tiny models (pad 0, bos 1, eos 2), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(124)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")

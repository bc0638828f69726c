"""``hf-knorm demo``: run every step on the model, then write ``demo.json`` and the self-contained ``report.html``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import transformers

from ...normalizations import parse_normalization
from ...hub.checks import check_repo_id, resolve_token
from ...models.persistence import load_model
from ...version import __version__
from .report import write_report
from .settings import DemoSettings
from .steps import balancing_step, conversion_step, knorm_step, normalizations_step, sharing_step


def run_demo(model_name: str, out_dir: str | Path, settings: DemoSettings | None = None,
             push_to: str | None = None, token: str | None = None) -> Path:
    """Run the demo's steps on ``model_name``; returns ``report.html``'s path.

    Args:
        model_name: ``"default"`` (SmolLM2-135M-Instruct, embedded), a checkpoint folder, or a Hub id in the local
            Hub cache (:func:`hf_knorm.models.sources.model_folder`).
        out_dir: where every step writes its folder, ``demo.json`` and ``report.html``.
        settings: the sizes of the steps (default: :class:`DemoSettings`; ``DemoSettings.fast()`` for tests).
        push_to: a Hub repo id: step 5 also pushes the converted model there (needs a token).
        token: the Hub token for ``push_to`` (default: the one ``huggingface_hub`` finds).

    Raises:
        ValueError: a bad normalization or setting, an invalid ``push_to`` or no token for it, all found before the
            model is loaded.
        ModelNotFoundError: ``model_name`` is none of the three forms.
    """
    settings = settings or DemoSettings()
    for name in settings.normalizations:  # bad input fails before any work
        parse_normalization(name)
    target = settings.conversion(model_name, str(Path(out_dir) / "conversion")).target()  # step 4's, with its window
    if push_to is not None:
        check_repo_id(push_to)
        token = resolve_token(token)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, tokenizer = load_model(model_name)
    print(f"Model: {model_name} ({model.config.model_type}, {model.config.num_hidden_layers} layers), "
          f"loaded in {time.perf_counter() - started:.1f} s. Output: {out_dir}")

    steps = [
        ("normalizations", "Attention normalizations side by side",
         lambda: normalizations_step(model, tokenizer, settings, out_dir / "normalizations")),
        ("balancing", "K/V balancing", lambda: balancing_step(model, tokenizer, settings, out_dir / "balancing")),
        ("knorm", "KNorm needle-in-a-haystack", lambda: knorm_step(model, tokenizer, settings, out_dir / "knorm")),
        ("conversion", f"Converting to {target.name} (transfer, recovery, norm callback)",
         lambda: conversion_step(model, tokenizer, model_name, settings, out_dir / "conversion")),
        ("sharing", "Saving the converted model with its card" + (f" and pushing it to {push_to}" if push_to else ""),
         lambda: sharing_step(results["conversion"], out_dir / "model", push_to=push_to, token=token)),
    ]
    results, sections = {}, []
    for index, (key, title, step) in enumerate(steps, 1):
        print(f"\n[{index}/{len(steps)}] {title}", flush=True)
        section, results[key] = step()
        sections.append(section)
        print(f"[{index}/{len(steps)}] done in {section.seconds:.1f} s", flush=True)

    total = time.perf_counter() - started
    summary = {"model": model_name, "hf_knorm": __version__, "transformers": transformers.__version__,
               "torch": torch.__version__, "threads": torch.get_num_threads(), "total time": f"{total:.0f} s"}
    timings = {section.title: round(section.seconds, 1) for section in sections}
    record = {"model": model_name, "settings": settings.as_dict(), "timings_s": timings, "total_s": round(total, 1),
              "steps": _jsonable(results)}
    (out_dir / "demo.json").write_text(json.dumps(record, indent=1) + "\n")
    report = write_report(sections, out_dir / "report.html", "hf_knorm demo", summary)
    print(f"\nWrote {out_dir / 'demo.json'} and {report} ({total:.0f} s in all). Open the report in a browser.")
    return report


def _jsonable(value):
    """Results as JSON: paths as strings, non-finite floats as strings (the file stays valid JSON)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value

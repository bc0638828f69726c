"""The demo's steps, one function each: run one capability on the model, return the report's :class:`Section`.

Each step calls the library exactly as a user would (``patch``, ``balance_kv``, ``KNormCache`` through the needle
harness, ``hf_knorm.convert``'s Trainer runs with ``NormLoggerCallback``, ``save_pretrained`` with the card), writes its files under its own
folder of the demo's output, and leaves the model it was given as it found it.
"""

from __future__ import annotations

import copy
import shutil
import time
from pathlib import Path

import torch

from ...assets.texts import SAMPLE_TEXT, shakespeare_split
from ...balancing.balance import balance_kv
from ...evaluation.decoding_cost import decoding_cost, plot_decoding_cost
from ...evaluation.needle import run_needle, score_variants, summary_table, write_report
from ...hub.push import push_folder
from ...hub.saving import CARD_FILE, save_pretrained
from ...models.persistence import load_model
from ..convert import card_evaluation, run_convert
from ...models.persistence import from_pretrained
from .normalizations import PROMPTS, compare_normalizations, evaluate_normalization, format_table
from .report import Section, Table
from .settings import DemoSettings


def normalizations_step(model, tokenizer, settings: DemoSettings, out_dir: Path) -> tuple[Section, dict]:
    """Step 1: perplexity and greedy continuations under each normalization, the model's own attention first; then
    what decoding costs against the context length, softmax with its K/V cache against ``x/1`` with its state."""
    started = time.perf_counter()
    rows = compare_normalizations(model, tokenizer, list(settings.normalizations))
    print(format_table(rows))
    table = Table(["normalization", "perplexity", *(repr(p) for p in PROMPTS)],
                  [[r["normalization"], r["perplexity"], *r["continuations"]] for r in rows],
                  caption=f"Perplexity on a {len(tokenizer(SAMPLE_TEXT)['input_ids'])}-token text, greedy next tokens")
    decoding = decoding_cost(model, list(settings.decoding_lengths))
    figure = plot_decoding_cost(decoding, out_dir / "decoding.png")
    decoding_table = Table(
        ["context (tokens)", *(str(length) for length in settings.decoding_lengths)],
        [[f"{name}: {label}", *(fmt(row) for row in decoding if row["normalization"] == name)]
         for name in ("softmax", "x/1")
         for label, fmt in (("cache MiB", lambda row: round(row["cache_bytes"] / 2**20, 2)),
                            ("ms per token", lambda row: round(row["seconds_per_token"] * 1e3, 1)))],
        caption="Decoding one token after a context of N tokens (caches filled with random content; "
                "hf_knorm.evaluation.decoding_cost)")
    largest = max(settings.decoding_lengths)
    by = {(row["normalization"], row["context"]): row for row in decoding}
    section = Section(
        "Attention normalizations side by side",
        "Look at the first two rows: softmax through the plugin reproduces the model's own attention (same perplexity, "
        "same tokens); the polynomial rows change the function of a model trained with softmax, which is why step 4 "
        f"converts one. Then the figure: x/1 is linear attention, so generate decodes it with a state of "
        f"{by[('x/1', largest)]['cache_bytes'] / 2**20:.1f} MiB whatever the context, where softmax's K/V cache holds "
        f"{by[('softmax', largest)]['cache_bytes'] / 2**20:.0f} MiB at {largest} tokens.",
        figures=[(figure, "Cache size and time per new token against the context length: softmax (K/V cache) and x/1 "
                          "(recurrent state)")],
        tables=[table, decoding_table],
        settings={"normalizations": ", ".join(settings.normalizations),
                  "decoding_lengths": ", ".join(map(str, settings.decoding_lengths))},
        seconds=time.perf_counter() - started,
    )
    return section, {"normalizations": rows, "decoding": decoding}


def balancing_step(model, tokenizer, settings: DemoSettings, out_dir: Path) -> tuple[Section, dict]:
    """Step 2: K/V balancing of a copy of the model; the "Original vs. Balanced kv-norm" figure and per-layer ratios."""
    started = time.perf_counter()
    balanced = copy.deepcopy(model)
    texts, _ = shakespeare_split()  # calibrate on the training split; Hamlet and the sonnets stay held out
    report = balance_kv(balanced, tokenizer, texts, settings.balance_mode, max_tokens=settings.calibration_tokens)
    del balanced
    paths = report.save(out_dir)
    numbers = report.to_dict()
    layer = report.default_layer()
    layers = numbers["layers"]
    table = Table(["layer", *(str(entry["layer"]) for entry in layers)],
                  [["before", *(round(entry["before"]["ratio"], 2) for entry in layers)],
                   ["after", *(round(entry["after"]["ratio"], 2) for entry in layers)]],
                  caption="Mean key norm over mean value norm, per layer")
    section = Section(
        "K/V balancing",
        f"Look at the top panel of the first figure: in layer {layer} the keys (blue) dwarf the values (orange); "
        "below, "
        f"after the exact fold into the weights, both share one scale, and the model's logits moved by at most "
        f"{report.max_logit_change:.1e}.",
        figures=[(paths["figure"], f"Original vs. balanced per-channel K/V norms, layer {layer}"),
                 (paths["summary"], "Key/value mean-norm ratio of every layer, before and after")],
        tables=[table],
        settings={"mode": settings.balance_mode, "calibration_tokens": report.before.tokens},
        seconds=time.perf_counter() - started,
    )
    return section, numbers


def knorm_step(model, tokenizer, settings: DemoSettings, out_dir: Path) -> tuple[Section, str]:
    """Step 3: needle-in-a-haystack with the uncompressed cache, with KNorm (the paper's key-norm score) and with
    ``settings.niah_score`` at the same ratio; heatmaps and the accuracy table."""
    started = time.perf_counter()
    if out_dir.exists():  # the harness resumes from its results file: a demo run starts from a clean grid
        shutil.rmtree(out_dir)
    ratio, score = settings.niah_ratio, settings.niah_score
    variants = score_variants((0.0, ratio), ["key_norm", score])
    records = run_needle(model, tokenizer, out_dir, tasks=("niah",), variants=variants,
                         lengths=settings.niah_lengths, depths=settings.niah_depths, seeds=1)
    write_report(records, out_dir)
    table_md = summary_table(records, "niah")
    found = {name: f"{100 * sum(r['correct'] for r in rows) / len(rows):.0f}%" for name, rows in
             ((v.name, [r for r in records if r["variant"] == v.name]) for v in variants)}
    paper, other = f"r={ratio:g}", f"r={ratio:g} {score}"
    section = Section(
        "KNorm KV-cache compression",
        f"Compare the heatmaps (green = needle found): uncompressed, the model finds {found['r=0']} of the needles. "
        f"With {ratio:.0%} of the cached tokens evicted by the paper's rule (largest key L2 norm out) it finds "
        f"{found[paper]}; evicting as many by the {score} score, which needs no attention weights either, "
        f"{found[other]}. BENCHMARKS.md measures every score on 1000-8000 tokens and explains the difference.",
        figures=[(out_dir / "heatmap_niah_r=0.png", "Uncompressed cache"),
                 (out_dir / f"heatmap_niah_r={ratio:g}.png", f"KNorm (key_norm), compression ratio {ratio:g}"),
                 (out_dir / f"heatmap_niah_r={ratio:g}_{score}.png", f"score={score!r}, compression ratio {ratio:g}")],
        tables=[_markdown_table(table_md, "Needle found (%), by context length")],
        settings={"lengths": settings.niah_lengths, "depths": settings.niah_depths, "ratio": ratio, "score": score,
                  "seeds": 1},
        seconds=time.perf_counter() - started,
    )
    return section, table_md


def beyond_window_table(beyond: dict, normalization: str) -> Table:
    """The conversion's record beyond the window (:mod:`hf_knorm.conversion.beyond_window`) as a table: each
    domain's perplexity from position 256 of 1,024-token blocks, the retrieval hits in the caption."""
    alone = "window_only_worst_ratio" in beyond
    rows = [[name, record["original_perplexity"], record["perplexity"], f"{record['ratio_to_original']:.3g}x",
             *([record["window_only_perplexity"], f"{record['window_only_ratio']:.3g}x"] if alone else [])]
            for name, record in beyond["domains"].items()]
    hits = "; ".join(
        f"{task} {length} tokens: converted {cell[0]}/{cell[1]}, original {beyond['retrieval']['original'][task][length][0]}"
        + (f", window alone {beyond['retrieval']['window_only'][task][length][0]}" if alone else "")
        for task, by_length in beyond["retrieval"]["converted"].items() for length, cell in by_length.items())
    return Table(["domain", "original (softmax)", f"converted ({normalization})", "ratio",
                  *(["window alone", "ratio"] if alone else [])], rows,
                 caption=f"Beyond the window: perplexity of the tokens at positions >= {beyond['first_scored_position']} "
                         f"of {beyond['block_size']}-token blocks. Retrieval: {hits}")


def conversion_step(model, tokenizer, model_name: str, settings: DemoSettings, out_dir: Path,
                    ) -> tuple[Section, dict]:
    """Step 4: convert the model to a polynomial normalization (attention transfer, then recovery) with the norm
    callback and held-out perplexity; the perplexity curve, the per-layer norms, greedy answers before and after."""
    started = time.perf_counter()
    if out_dir.exists():  # a demo run is a fresh run, never a resumed one
        shutil.rmtree(out_dir)
    conversion = settings.conversion(model_name, str(out_dir))
    summary = run_convert(conversion)
    normalization = summary["normalization"]
    converted = from_pretrained(out_dir)
    answers = [evaluate_normalization(model, tokenizer, None),
               evaluate_normalization(model, tokenizer, normalization, cluster_tokens=settings.cluster_tokens),
               evaluate_normalization(converted, tokenizer, None)]
    answers[1]["normalization"] = f"{normalization}, patched only"
    answers[2]["normalization"] = f"{normalization}, converted"
    evaluation = summary["evaluation"]
    stages = summary["stages"]
    rows = [[f"{name}: {record['text']}", record["original_perplexity"], record["perplexity"],
             f"{record['ratio_to_original']:.3g}x"] for name, record in evaluation["domains"].items()]
    table = Table(["held-out set", "original (softmax)", f"converted ({normalization})", "ratio"], rows,
                  caption=f"Held-out perplexity, {evaluation['tokens']} tokens a set; the headline is the worst set "
                          f"({evaluation['worst_domain']})")
    stage_rows = [[name, f"{stages[name]['curve'][0][2]:.4g} -> {stages[name]['curve'][-1][2]:.4g}",
                   stages[name]["tokens"], stages[name]["trainable_parameters"]]
                  for name in ("transfer", "recovery") if name in stages and stages[name]["curve"]]
    stage_table = Table(["stage", f"{evaluation['worst_domain']}: start -> end", "training tokens",
                         "trainable parameters"], stage_rows, caption="The two stages")
    greedy = Table(["model", *(repr(p) for p in PROMPTS)], [[a["normalization"], *a["continuations"]] for a in answers],
                   caption="Greedy next tokens of step 1's prompts")
    tables = [table, stage_table, greedy]
    if "beyond_window" in summary:
        tables.append(beyond_window_table(summary["beyond_window"], normalization))
    probe_line = ""
    if "probe" in summary:
        probe = summary["probe"]
        probe_line = (f" The ability probe: the converted model reproduces {probe['agreement']:.0%} of the original's "
                      f"{probe['prompts']} greedy answers (first token {probe['first_token_agreement']:.0%}).")
        tables.append(Table(["prompt", "original", "converted", "same"],
                            [[a["prompt"], a["reference"], a["text"], "yes" if a["same"] else "no"]
                             for a in probe["answers"]], caption="The ability probe, answer by answer"))
    mixture = summary["training_data"]
    parts = ", ".join(f"{name.replace('_', ' ')} {part['tokens']:,} tokens" for name, part in mixture.get("parts", {}).items())
    section = Section(
        "Converting the model to a new normalization",
        f"Follow the curves: patched with {normalization} the model's held-out perplexity starts at "
        f"{stages['transfer']['curve'][0][2]:.3g} on {evaluation['worst_domain']} (the original: "
        f"{evaluation['original_perplexity']:.3g}); attention transfer and "
        f"{stages['recovery']['mode'] if 'recovery' in stages else 'no'} recovery on the general mixture bring the "
        f"worst of the held-out sets to {evaluation['ratio_to_original']:.3g}x the original in this shortened "
        f"schedule.{probe_line} The panels show each layer's attention norm during both stages, logged by "
        "NormLoggerCallback.",
        figures=[(Path(summary["perplexity_figure"]), "Held-out perplexity over training tokens, per held-out set "
                                                      "(log scale; dashed: the original model)"),
                 (out_dir / "norms.png", "Per-layer attention-matrix norm during transfer and recovery (log scale)")],
        tables=tables,
        text=f"tensorboard --logdir {out_dir}\n{out_dir / 'convert.json'}",
        settings={"normalization": normalization, "transfer_steps": conversion.transfer_steps,
                  "recovery": f"{conversion.recovery}, {conversion.scheduled_recovery_steps()} steps",
                  "block_size": conversion.block_size, "batch_size": conversion.batch_size,
                  "data": f"{conversion.dataset}: {parts}" if parts else conversion.dataset},
        seconds=time.perf_counter() - started,
    )
    return section, {**summary, "answers": answers, "folder": str(out_dir)}


def sharing_step(conversion: dict, out_dir: Path, push_to: str | None = None,
                 token: str | None = None) -> tuple[Section, dict]:
    """Step 5: save the converted model with its card as a push would send it; reload it and compare; push if asked.

    The folder written is exactly what :func:`hf_knorm.push_to_hub` uploads (weights, config with the plugin's
    settings, tokenizer, ``README.md`` card, the card's figure); ``push_to`` uploads it in one commit.
    """
    started = time.perf_counter()
    run_dir = Path(conversion["folder"])
    model, tokenizer = load_model(str(run_dir))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    evaluation = card_evaluation(conversion)
    folder = save_pretrained(model, out_dir, tokenizer=tokenizer, repo_id=push_to, norm_history=run_dir / "norms.png",
                             evaluation=evaluation)
    reloaded, _ = load_model(str(folder))
    batch = tokenizer(SAMPLE_TEXT, return_tensors="pt")
    with torch.no_grad():
        same_logits = bool(torch.equal(model(**batch).logits, reloaded(**batch).logits))
    commit_url = None
    if push_to:
        commit_url = push_folder(folder, push_to, token=token).commit_url
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    card_head = "\n".join((folder / CARD_FILE).read_text().splitlines()[:40])
    table = Table(["file", "bytes"], [[str(p.relative_to(folder)), p.stat().st_size] for p in files],
                  caption=f"{folder}: what a push sends")
    look_at = (f"The folder holds what push_to_hub sends: the weights, a config that carries "
               f"{conversion['normalization']}, the tokenizer and the model card below, with the held-out perplexity "
               f"({conversion['evaluation']['perplexity']:.4g}, the original {conversion['evaluation']['original_perplexity']:.4g}) "
               "in its text and its model-index; reloaded with "
               f"hf_knorm.from_pretrained it gives {'identical' if same_logits else 'DIFFERENT'} logits.")
    if commit_url:
        look_at += f" Pushed: {commit_url}."
    section = Section(
        "Saving the model with its card" + (" and pushing it" if push_to else ""),
        look_at,
        tables=[table],
        text=card_head,
        settings={"repo_id": push_to or "(not pushed; --push-to REPO_ID pushes)"},
        seconds=time.perf_counter() - started,
    )
    return section, {"folder": str(folder), "same_logits_after_reload": same_logits, "commit_url": commit_url,
                     "files": [str(p.relative_to(folder)) for p in files]}


def _markdown_table(markdown: str, caption: str) -> Table:
    """A :class:`Table` from a pipe-delimited markdown table (header, separator, rows)."""
    lines = [line.strip().strip("|").split("|") for line in markdown.strip().splitlines()]
    header, rows = [c.strip() for c in lines[0]], [[c.strip() for c in line] for line in lines[2:]]
    return Table(header, rows, caption=caption)

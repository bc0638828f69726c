"""Needle-in-a-haystack and passkey retrieval under KNorm compression (arXiv 2406.11430, Sec. 4).

One grid: context lengths (tokens) x needle depths x seeds. Each cell builds a context, prefills it **once** with a
full cache (the prefill of a KNorm cache is exact, so it is shared), then for every variant (a compression ratio plus
options; ratio 0 is the uncompressed model) compresses a copy, appends the question uncompressed and decodes greedily:
the kvpress protocol (context compressed, question not), through the same function as the public
``knorm-text-generation`` pipeline (``hf_knorm.eviction.pipeline.answer_after_context``). The variant
``protocol="authors"`` instead processes the question on the uncompressed pass, takes the first answer token from
it, then compresses context and question (the authors' l2compress code; combine with ``layer_ratios={0: 0, 1: 0}``).

- ``niah``: Paul Graham essays as haystack (a random start per seed), the needle "The special magic number for
  {city} is {7 digits}." placed at the depth (snapped to a sentence end), question "What is the special magic number
  for {city}?".
- ``passkey``: the repeated filler of Mohtashami & Jaggi (2023), the needle "The pass key is {5 digits}. Remember
  it. ...", question "What is the pass key?".

Prompts use the model's chat template (SmolLM2-Instruct answers in full sentences through it) with the answer
started as "The special magic number for {city} is" / "The pass key is"; a cell is correct when the first number in
the answer equals the needle's (exact match). Results are rewritten atomically after every cell
(``results.json`` + ``results.csv``); a rerun with the same output folder resumes where it stopped.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from ..compat import cache_kwargs, output_cache
from ..eviction.pipeline import answer_after_context, encode_prompt, generate_after, knorm_cache_for
from ..eviction.reconstruction import reconstruction_scores, shared_scoring

CITIES = ("Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Mumbai", "Madrid", "Seoul",
          "Dublin", "Lisbon", "Santiago", "Hanoi", "Vienna", "Prague", "Manila", "Bogota", "Helsinki")
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class Variant:
    """One row of the tables: a name, :class:`KNormCache` options and the protocol ("kvpress" or "authors")."""

    name: str
    options: dict = field(default_factory=dict)
    protocol: str = "kvpress"
    score_basis: str = "cached"

    @property
    def ratio(self) -> float | None:
        """The compression ratio (0: uncompressed); ``None`` for a threshold row, which evicts what the text gives."""
        return None if "threshold" in self.options else float(self.options.get("compression_ratio", 0.0))


def ratio_variants(ratios) -> list[Variant]:
    """Plain KNorm at each ratio (0 = the uncompressed model)."""
    return [Variant(f"r={r:g}", {"compression_ratio": float(r)}) for r in ratios]


def parse_score_spec(spec: str) -> dict:
    """Cache options of one ``--scores`` entry: a score name, optionally with protections or a pooling window, e.g.
    ``"key_diff"``, ``"recent+sinks4"`` (StreamingLLM), ``"kv_diff+sinks4+window64"``, ``"key_diff+pool5"``; the
    budget extras ``+heads`` (AdaKV's head-adaptive budget, ``head_budget="heads"``), ``+floorF`` (``head_floor=F``,
    e.g. ``+floor0``) and ``+layers-dispersion`` / ``+layers-skip_first`` / ``+layers-global`` (``layer_budget=``),
    e.g. ``"kv_diff+heads+layers-dispersion"``, ``"kvzip+heads+floor0+layers-global"`` (KVzip's own budget); and
    ``+thresholdT`` (``threshold=T``: KVzap's threshold pruning instead of a ratio, arXiv 2601.07891), e.g.
    ``"kvzap+heads+sinks4+window128+threshold-4.3"``.

    Raises:
        ValueError: A malformed entry or an unknown score (the message lists the accepted names).
    """
    import dataclasses

    from ..eviction.budgets import LAYER_BUDGETS
    from ..eviction.scores import resolve_score

    name, *extras = spec.strip().split("+")
    score = resolve_score(name)  # an unknown name raises here, listing the accepted ones
    options = {"score": name}
    for extra in extras:
        if extra == "heads":
            options["head_budget"] = "heads"
            continue
        if extra.startswith("layers-") and extra.removeprefix("layers-") in LAYER_BUDGETS[1:]:  # not "uniform"
            options["layer_budget"] = extra.removeprefix("layers-")
            continue
        floor = re.fullmatch(r"floor(\d+(?:\.\d+)?)", extra)
        if floor:
            options["head_floor"] = float(floor.group(1))
            continue
        threshold = re.fullmatch(r"threshold(-?\d+(?:\.\d+)?)", extra)
        if threshold:
            options["threshold"] = float(threshold.group(1))
            continue
        match = re.fullmatch(r"(sinks|window|pool)(\d+)", extra)
        if not match:
            raise ValueError(f"Bad score entry {spec!r}: after the name, only '+sinksK', '+windowW', '+poolP', "
                             "'+heads', '+floorF', '+thresholdT', '+layers-skip_first', '+layers-dispersion' and "
                             "'+layers-global' are accepted.")
        kind, value = match.group(1), int(match.group(2))
        if kind == "pool":
            if "pool" not in {f.name for f in dataclasses.fields(score)}:
                raise ValueError(f"Bad score entry {spec!r}: {name} has no pooling window.")
            options["score"] = dataclasses.replace(score, pool=value)
        else:
            options["sink_tokens" if kind == "sinks" else "recent_window"] = value
    return options


def score_variants(ratios, specs) -> list[Variant]:
    """One row per ratio and score entry (see :func:`parse_score_spec`); ratio 0 is the uncompressed model, once. An
    entry with a threshold (``+thresholdT``) is one row whatever the ratios: it evicts what its threshold gives.

    Row names: ``r=<ratio>`` for plain ``key_norm`` (the names of :func:`ratio_variants`), else ``r=<ratio> <entry>``;
    a threshold row ``t=<T> <entry without +thresholdT>``.

    Raises:
        ValueError: A malformed entry, or options a :class:`~hf_knorm.KNormCache` refuses (checked here, before a
            model is loaded).
    """
    from ..eviction.settings import EvictionSettings

    parsed = {spec.strip(): parse_score_spec(spec) for spec in specs}
    sized = [spec for spec, options in parsed.items() if "threshold" not in options]
    variants = []
    for ratio in ratios:
        for spec in (list(parsed)[:1] if float(ratio) == 0 else sized):
            options = parsed[spec]
            plain = options == {"score": "key_norm"} or float(ratio) == 0
            name = f"r={float(ratio):g}" + ("" if plain else f" {spec}")
            variants.append(Variant(name, {"compression_ratio": float(ratio), **({} if float(ratio) == 0 else options)}))
    for spec, options in parsed.items():
        if "threshold" in options:
            entry = "+".join(part for part in spec.split("+") if not part.startswith("threshold"))
            variants.append(Variant(f"t={options['threshold']:g} {entry}", options))
    for variant in variants:
        EvictionSettings(**variant.options)  # refused now, not after the model and the first context
    return variants


def option_variants(ratio: float = 0.5, balanced: bool = False) -> list[Variant]:
    """The options that may close the gap on a small model, each at ``ratio``."""
    variants = [
        Variant(f"r={ratio:g} sinks4+window64", {"compression_ratio": ratio, "sink_tokens": 4, "recent_window": 64}),
        Variant(f"r={ratio:g} layers0-1 kept", {"compression_ratio": ratio, "layer_ratios": {0: 0.0, 1: 0.0}}),
        Variant(f"r={ratio:g} authors protocol", {"compression_ratio": ratio, "layer_ratios": {0: 0.0, 1: 0.0}},
                protocol="authors"),
    ]
    if balanced:
        variants.append(Variant(f"r={ratio:g} original basis", {"compression_ratio": ratio}, score_basis="original"))
    return variants


def make_sample(task: str, tokenizer, haystack_ids: list[int], length: int, depth: float, seed: int) -> dict:
    """Context (about ``length`` tokens), question, answer prefix and expected number of one grid cell."""
    rng = random.Random(f"{task}-{length}-{depth}-{seed}")
    if task == "niah":
        city, number = rng.choice(CITIES), str(rng.randrange(10**6, 10**7))
        needle = f"The special magic number for {city} is {number}."
        question = f"What is the special magic number for {city}? Answer with the number only."
        prefix, filler = "", haystack_ids
        answer_prefix = f"The special magic number for {city} is"
    elif task == "passkey":
        number = str(rng.randrange(10**4, 10**5))
        needle = f"The pass key is {number}. Remember it. {number} is the pass key."
        question = "What is the pass key? Answer with the number only."
        prefix, filler = PASSKEY_INTRO, haystack_ids
        answer_prefix = "The pass key is"
    else:
        raise ValueError(f"Unknown task {task!r}; use 'niah' or 'passkey'.")
    budget = length - len(tokenizer(prefix + needle, add_special_tokens=False)["input_ids"]) - 2
    if budget < 1 or budget > len(filler):
        raise ValueError(f"Context length {length} does not fit: the haystack has {len(filler)} tokens.")
    start = rng.randrange(0, len(filler) - budget + 1) if task == "niah" else 0
    text = tokenizer.decode(filler[start:start + budget])
    cut = int(depth * len(text))
    boundary = text.rfind(". ", 0, cut)  # the needle goes after a sentence
    cut = 0 if depth == 0 or boundary < 0 else boundary + 2
    if depth == 1:
        cut = len(text)
    context = prefix + text[:cut] + (" " if cut and not text[:cut].endswith(" ") else "") + needle + " " + text[cut:]
    return dict(context=context.strip(), question=question, answer_prefix=answer_prefix, expected=number)


def haystack(task: str, tokenizer) -> list[int]:
    """Token ids of the filler text: Paul Graham essays (niah) or the repeated passkey filler."""
    if task == "passkey":
        return tokenizer(PASSKEY_FILLER * 800, add_special_tokens=False)["input_ids"]
    from ..assets.texts import paul_graham_essays

    return tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]


def is_correct(answer: str, expected: str) -> bool:
    """Exact match: the first number in the answer (commas removed) is the needle's."""
    numbers = re.findall(r"\d+", answer.replace(",", ""))
    return bool(numbers) and numbers[0] == expected


@torch.no_grad()
def answer_cell(model, tokenizer, sample: dict, variants: list[Variant], max_new_tokens: int,
                evicted: dict[str, float] | None = None) -> dict[str, str]:
    """Answers of every variant for one sample; the context is prefilled once. ``evicted``, if given, receives each
    variant's share of the tokens seen that its cache no longer holds after the answer
    (:meth:`~hf_knorm.KNormCache.compression_achieved`: what a threshold row evicted).

    A ``kvpress`` variant runs :func:`hf_knorm.eviction.pipeline.answer_after_context`, the ``knorm-text-generation``
    pipeline's own protocol, on that shared prefill; its cache is :func:`~hf_knorm.eviction.pipeline.knorm_cache_for` with exactly the
    variant's options (a model's recorded KNorm defaults are not applied: every row names its options). KVzip's
    reconstruction (``score="kvzip"``) runs once per sample and options but the ratio, which it does not depend on.
    """
    context_ids, question_ids = encode_prompt(tokenizer, sample["context"], sample["question"], sample["answer_prefix"])
    context_ids, question_ids = context_ids.to(model.device), question_ids.to(model.device)
    full = output_cache(model(input_ids=context_ids, **cache_kwargs(DynamicCache()), use_cache=True))
    ids = torch.cat([context_ids, question_ids], dim=1)  # (1, n_context + n_question)
    generate = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    answers, with_question, reconstructed = {}, None, {}
    for variant in variants:
        cache = knorm_cache_for(model, score_basis=variant.score_basis, recorded_defaults=False, **variant.options)
        if variant.protocol == "kvpress":
            importance = None
            if cache.settings.deferred:  # KVzip: reconstructed once for every ratio of the same options
                options = shared_scoring(variant.options)
                if options not in reconstructed:
                    scored = knorm_cache_for(model, score_basis=variant.score_basis, recorded_defaults=False,
                                             **variant.options)
                    scored.prefill_from(full)
                    reconstructed[options] = reconstruction_scores(model, scored, context_ids, tokenizer)
                importance = reconstructed[options]
            new = answer_after_context(model, cache, context_ids, question_ids, prefilled=full, tokenizer=tokenizer,
                                       importance=importance, **generate)[0]
        elif variant.protocol == "authors":
            if with_question is None:  # question on the uncompressed pass; its last logits give the first token
                step_cache = DynamicCache([(layer.keys, layer.values) for layer in full.layers])
                step = model(input_ids=question_ids, **cache_kwargs(step_cache), use_cache=True)
                with_question = (output_cache(step), step.logits[:, -1].argmax(-1, keepdim=True))
            cache.prefill_from(with_question[0])
            first = with_question[1]
            rest = generate_after(model, cache, ids, first, **{**generate, "max_new_tokens": max_new_tokens - 1})
            new = torch.cat([first[0], rest[0]])
        else:
            raise ValueError(f"Unknown protocol {variant.protocol!r}; use 'kvpress' or 'authors'.")
        answers[variant.name] = tokenizer.decode(new, skip_special_tokens=True).strip()
        if evicted is not None:
            evicted[variant.name] = cache.compression_achieved()
    return answers


def run_needle(model, tokenizer, out_dir: Path, tasks=("niah",), variants: list[Variant] | None = None,
               lengths=(1000, 2000, 4000, 8000), depths=(0.0, 0.25, 0.5, 0.75, 1.0), seeds: dict | int = 2,
               max_new_tokens: int = 10, progress: bool = True) -> list[dict]:
    """Run the grid; returns every result record (also in ``out_dir/results.json`` and ``results.csv``).

    Args:
        seeds (int or dict): Seeds per cell, for every task or per task (e.g. ``{"niah": 2, "passkey": 1}``).
    """
    from tqdm.auto import tqdm

    variants = variants or ratio_variants((0.0, 0.5, 0.75, 0.9))
    seeds = seeds if isinstance(seeds, dict) else {task: seeds for task in tasks}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    records = json.loads(path.read_text()) if path.exists() else []
    done = {(r["task"], r["variant"], r["length"], r["depth"], r["seed"]) for r in records}
    cells = [(task, seed, length, depth) for task in tasks for seed in range(seeds.get(task, 0))
             for length in lengths for depth in depths]
    hay = {}
    bar = tqdm(cells, desc="needle", disable=not progress)
    for task, seed, length, depth in bar:
        todo = [v for v in variants if (task, v.name, length, depth, seed) not in done]
        if not todo:
            continue
        bar.set_postfix_str(f"{task} len={length} depth={depth:g} seed={seed}")
        if task not in hay:
            hay[task] = haystack(task, tokenizer)
        sample = make_sample(task, tokenizer, hay[task], length, depth, seed)
        evicted = {}
        answers = answer_cell(model, tokenizer, sample, todo, max_new_tokens, evicted=evicted)
        for variant in todo:
            records.append(dict(task=task, variant=variant.name, ratio=variant.ratio, length=length, depth=depth,
                                seed=seed, expected=sample["expected"], answer=answers[variant.name],
                                correct=is_correct(answers[variant.name], sample["expected"]),
                                evicted=evicted.get(variant.name)))
        _write_results(out_dir, records)
    return records


def _write_results(out_dir: Path, records: list[dict]) -> None:
    """Rewrite results.json and results.csv atomically (write a temporary file, then rename)."""
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(records, indent=1))
    os.replace(tmp, out_dir / "results.json")
    tmp = out_dir / "results.csv.tmp"
    with tmp.open("w", newline="") as handle:
        # every record's fields, in order: a folder written before a field existed gets it empty in older rows
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for record in records for key in record)))
        writer.writeheader()
        writer.writerows(records)
    os.replace(tmp, out_dir / "results.csv")


def accuracy_grid(records: list[dict], task: str, variant: str) -> tuple[list, list, list[list[float | None]]]:
    """(lengths, depths, accuracy[depth][length]) of one task and variant; None where nothing was run."""
    rows = [r for r in records if r["task"] == task and r["variant"] == variant]
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = []
    for depth in depths:
        line = []
        for length in lengths:
            hits = [r["correct"] for r in rows if r["length"] == length and r["depth"] == depth]
            line.append(sum(hits) / len(hits) if hits else None)
        grid.append(line)
    return lengths, depths, grid


def summary_table(records: list[dict], task: str) -> str:
    """Markdown table: one row per variant, accuracy (%) per context length and overall, the seeds per cell, and the
    mean share of the tokens its caches no longer held after the answers ("-" where not recorded)."""
    variants = list(dict.fromkeys(r["variant"] for r in records if r["task"] == task))
    lengths = sorted({r["length"] for r in records if r["task"] == task})
    lines = ["| variant | " + " | ".join(f"{n} tok" for n in lengths) + " | all | seeds/cell | evicted |",
             "|---|" + "---:|" * (len(lengths) + 3)]
    for variant in variants:
        rows = [r for r in records if r["task"] == task and r["variant"] == variant]
        cells = [[r["correct"] for r in rows if r["length"] == n] for n in lengths]
        seeds = len({r["seed"] for r in rows})
        lines.append(f"| {variant} | " + " | ".join(f"{100 * sum(c) / len(c):.0f}" if c else "-" for c in cells)
                     + f" | {100 * sum(r['correct'] for r in rows) / len(rows):.1f} | {seeds} | {mean_evicted(rows)} |")
    return "\n".join(lines)


def mean_evicted(records: list[dict]) -> str:
    """The mean ``evicted`` share of ``records`` in percent (``"47.8%"``), ``"-"`` where none recorded it."""
    shares = [r["evicted"] for r in records if r.get("evicted") is not None]
    return f"{100 * sum(shares) / len(shares):.1f}%" if shares else "-"


def write_report(records: list[dict], out_dir: Path) -> Path:
    """One heatmap per task and variant (``heatmap_<task>_<variant>.png``) and ``summary.md`` with the tables."""
    from ..plots import plot_needle_heatmap

    out_dir = Path(out_dir)
    parts = []
    for task in dict.fromkeys(r["task"] for r in records):
        parts.append(f"### {task}\n\n{summary_table(records, task)}\n")
        for variant in dict.fromkeys(r["variant"] for r in records if r["task"] == task):
            lengths, depths, grid = accuracy_grid(records, task, variant)
            slug = re.sub(r"[^A-Za-z0-9.=+-]+", "_", variant)
            seeds = len({r["seed"] for r in records if r["task"] == task and r["variant"] == variant})
            name = "uncompressed (r=0)" if variant == "r=0" else f"KNormCache {variant}"
            title = f"{'Needle in a haystack' if task == 'niah' else 'Passkey'}, {name}, {seeds} seed(s)/cell"
            plot_needle_heatmap(lengths, depths, grid, out_dir / f"heatmap_{task}_{slug}.png", title=title)
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(parts))
    return summary


"""The ``hf-knorm niah`` job: its settings (the command's flags) and the run (needle and passkey grids, heatmaps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..models.sources import MODEL_HELP
from ..balancing.balance import key_scales
from ..evaluation.needle import option_variants, run_needle, score_variants, write_report


@dataclass
class NiahSettings:
    """What ``hf-knorm niah`` runs; each field is a flag of the command (``--passkey-seeds 0``)."""

    model: str = field(default="default", metadata={"help": MODEL_HELP})
    ratios: tuple[float, ...] = field(default=(0.0, 0.5, 0.75, 0.9),
                                      metadata={"help": "comma-separated compression ratios (0 = uncompressed)"})
    scores: tuple[str, ...] = field(default=("key_norm",), metadata={
        "help": "comma-separated eviction scores, one row per ratio and score: key_norm (the paper's), kv_diff (the "
        "recommended one), value_over_key, key_diff, recent, random, kvzip (KVzip's context reconstruction, about one "
        "more prefill per context), kvzap (a fitted linear surrogate of kvzip's score: no reconstruction; shipped for "
        "the default model); append +sinksK / +windowW to protect the first K "
        "/ last W tokens (e.g. recent+sinks4 is StreamingLLM, kv_diff+sinks4+window64), +poolP to set the window of "
        "key_diff / kv_diff, +heads for AdaKV's head-adaptive budget (+floorF: each head keeps at least F of its "
        "share, default 0.2), +layers-dispersion / +layers-skip_first for a per-layer schedule (e.g. "
        "kv_diff+heads+layers-dispersion), for kvzip or kvzap +heads+layers-global: one threshold over every "
        "layer and head (KVzip's own budget with +floor0), and for kvzap +heads+thresholdT: KVzap's threshold "
        "pruning, one row whatever the ratios, evicting at the prefill and while decoding what T gives (e.g. "
        "kvzap+heads+sinks4+window128+threshold-4.3; the share evicted is in the summary)"})
    lengths: tuple[int, ...] = field(default=(1000, 2000, 4000, 8000),
                                     metadata={"help": "comma-separated context lengths (tokens)"})
    depths: tuple[float, ...] = field(default=(0.0, 0.25, 0.5, 0.75, 1.0),
                                      metadata={"help": "comma-separated needle depths in [0, 1]"})
    seeds: int = field(default=1, metadata={"help": "needle seeds per cell"})
    passkey_seeds: int = field(default=1, metadata={"help": "passkey seeds per cell (0 = skip)"})
    options: bool = field(default=True, metadata={
        "help": "the extra rows at ratio 0.5 (sinks+window, layers 0-1 kept, the authors' protocol); --no-options "
        "skips them"})
    out: str = field(default="outputs/niah", metadata={"help": "output folder (a rerun resumes)"})

    def __post_init__(self):
        for name, values, ok, rule in (
            ("ratios", self.ratios, lambda r: 0 <= r < 1, "in [0, 1)"),
            ("lengths", self.lengths, lambda n: n > 0, "positive"),
            ("depths", self.depths, lambda d: 0 <= d <= 1, "in [0, 1]"),
        ):
            if not values or not all(ok(value) for value in values):
                raise ValueError(f"--{name} takes comma-separated values {rule}, got {values}.")
        if self.seeds < 0 or self.passkey_seeds < 0 or self.seeds + self.passkey_seeds == 0:
            raise ValueError(f"--seeds {self.seeds} --passkey-seeds {self.passkey_seeds}: each at least 0, one of them "
                             "at least 1 (nothing would run).")
        score_variants(self.ratios, list(self.scores))  # an unknown score is refused before the model loads


def run_niah_job(settings: NiahSettings) -> Path:
    """Load the model, run the NIAH and passkey grids, write results, heatmaps and ``summary.md``; return its path."""
    from ..models.persistence import load_model

    variants = score_variants(settings.ratios, list(settings.scores))
    model, tokenizer = load_model(settings.model)
    balanced = key_scales(model.config) is not None
    variants += option_variants(0.5, balanced=balanced) if settings.options else []
    seeds = {"niah": settings.seeds, "passkey": settings.passkey_seeds}
    tasks = tuple(task for task, n in seeds.items() if n > 0)
    out = Path(settings.out)
    records = run_needle(model, tokenizer, out, tasks=tasks, variants=variants, lengths=settings.lengths,
                         depths=settings.depths, seeds=seeds)
    summary = write_report(records, out)
    print(summary.read_text())
    return summary

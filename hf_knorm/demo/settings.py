"""How big each demo step is: the defaults (minutes on a 2-core CPU; BENCHMARKS.md has the measured time) and
``--fast`` (the test suite's)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of the demo's steps.

    Attributes:
        normalizations: step 1, the normalizations compared with the model's own attention.
        balance_mode: step 2, ``"layer"`` (TransMLA's Balanced Key-Value) or ``"channel"``.
        calibration_tokens: step 2, calibration tokens for the K/V norms.
        niah_lengths, niah_depths: step 3, the needle-in-a-haystack grid (context tokens x needle depth).
        niah_ratio: step 3, the compression ratio compared with the uncompressed cache.
        niah_score: step 3, the eviction score shown beside the paper's key norm (``"kv_diff"``, the recommended one,
            BENCHMARKS.md "Eviction scores").
        train_normalization: step 4, the normalization fine-tuned with the norm callback.
        train_steps, train_block_size, train_batch_size, train_learning_rate, logging_steps: step 4, the
            fine-tuning run.
    """

    normalizations: tuple[str, ...] = ("softmax", "x/1", "x/16", "x^3/1", "x^3/16", "x^3/sqrtN")
    balance_mode: str = "layer"
    calibration_tokens: int = 4096
    niah_lengths: tuple[int, ...] = (1000, 2000)
    niah_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    niah_ratio: float = 0.5
    niah_score: str = "kv_diff"
    train_normalization: str = "x^3/16"
    train_steps: int = 30
    train_block_size: int = 128
    train_batch_size: int = 4
    train_learning_rate: float = 2e-4
    logging_steps: int = 3

    def __post_init__(self):
        from ..knorm.scores import resolve_score

        resolve_score(self.niah_score)  # an unknown score fails before any step runs, listing the accepted ones
        if self.niah_score == "key_norm":
            raise ValueError("niah_score is shown beside the paper's key_norm, which step 3 always runs: choose "
                             "another score (e.g. kv_diff).")
        if not 0 < self.niah_ratio < 1:
            raise ValueError(f"niah_ratio must be in (0, 1) (the fraction of the context evicted), got "
                             f"{self.niah_ratio!r}.")

    @classmethod
    def fast(cls) -> DemoSettings:
        """Every step shrunk to seconds, for the test suite (``--fast``)."""
        return cls(normalizations=("softmax", "x^3/16"), calibration_tokens=256, niah_lengths=(300,),
                   niah_depths=(0.5,), train_steps=4, train_block_size=64, train_batch_size=2, logging_steps=2)

    def with_overrides(self, **overrides) -> DemoSettings:
        """A copy with the given fields replaced; ``None`` values are ignored (flags the user did not set)."""
        names = {f.name for f in fields(self)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"Unknown demo settings {sorted(unknown)}; known: {sorted(names)}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def as_dict(self) -> dict:
        """The settings as plain values (for the report and ``demo.json``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

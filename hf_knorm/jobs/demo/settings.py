"""How big each demo step is: the defaults (minutes on a 2-core CPU; BENCHMARKS.md has the measured time) and
``--fast`` (the test suite's)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ...conversion.settings import DEFAULT_CLUSTERS, DEFAULT_NORMALIZATION, DEFAULT_SPARSE_CACHE, DEFAULT_SPARSE_SCORE


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of the demo's steps: each field is a flag of ``hf-knorm demo``, with its help in ``metadata["help"]``
    (``--fast`` starts from :meth:`fast` instead of these defaults; flags given explicitly still win)."""

    normalizations: tuple[str, ...] = field(default=("softmax", "x/1", "x/16", "x^3/1", "x^3/16", "x^3/sqrtN"),
                                            metadata={"help": "step 1: comma-separated normalizations compared with "
                                                              "the model's own attention"})
    decoding_lengths: tuple[int, ...] = field(default=(1024, 4096, 16384, 32768), metadata={
        "help": "step 1: context lengths at which decoding is timed, softmax's K/V cache against x/1's state"})
    balance_mode: str = field(default="layer", metadata={
        "help": "step 2: one K/V scale per layer (TransMLA's Balanced Key-Value) or per channel",
        "choices": ("layer", "channel")})
    calibration_tokens: int = field(default=4096, metadata={"help": "step 2: calibration tokens for the K/V norms"})
    niah_lengths: tuple[int, ...] = field(default=(1000, 2000), metadata={
        "help": "step 3: comma-separated context lengths (tokens) of the needle-in-a-haystack grid"})
    niah_depths: tuple[float, ...] = field(default=(0.0, 0.25, 0.5, 0.75, 1.0), metadata={
        "help": "step 3: comma-separated needle depths in [0, 1]"})
    niah_ratio: float = field(default=0.5, metadata={
        "help": "step 3: the KNorm compression ratio compared with the uncompressed cache, in (0, 1)"})
    niah_score: str = field(default="kv_diff", metadata={
        "help": "step 3: the eviction score shown beside the paper's key_norm (kv_diff is the recommended one, "
                "docs/results/knorm.md, 'Eviction scores')"})
    train_normalization: str = field(default=DEFAULT_NORMALIZATION, metadata={
        "help": "step 4: the normalization the model is converted to, beside the softmax window, the sinks and the "
                "sparse cache (attention transfer, then hf-knorm convert's default recovery: LoRA on the attention)"})
    transfer_steps: int = field(default=10, metadata={"help": "step 4: attention-transfer steps"})
    recovery_steps: int = field(default=50, metadata={"help": "step 4: recovery steps"})
    train_block_size: int = field(default=128, metadata={"help": "step 4: tokens per example"})
    train_batch_size: int = field(default=4, metadata={"help": "step 4: examples per step"})
    teacher_tokens: int = field(default=8192, metadata={
        "help": "step 4: tokens the original model samples for the general training mixture (cached)"})
    eval_tokens: int = field(default=1024, metadata={
        "help": "step 4: held-out tokens of each of the four domains scored at each evaluation"})
    eval_steps: int = field(default=25, metadata={"help": "step 4: held-out perplexity every N steps of each stage"})
    probe: bool = field(default=True, metadata={
        "help": "step 4: ask the ability probe (40 greedy answers) before and after the conversion"})
    logging_steps: int = field(default=5, metadata={"help": "step 4: per-layer norms every N steps"})
    softmax_window: int = field(default=64, metadata={
        "help": "step 4: the softmax window beside the normalization (hf-knorm convert --softmax-window; 0: none)"})
    sparse_cache: int | None = field(default=None, metadata={
        "help": "step 4: older key/value pairs kept beside the window per layer and KV head, chosen by "
                f"{DEFAULT_SPARSE_SCORE} (hf-knorm convert --sparse-cache; default: {DEFAULT_SPARSE_CACHE} with a "
                "window, 0 without; 0: none)"})
    clusters: int | None = field(default=None, metadata={
        "help": "step 4: the older pairs the sparse cache leaves, weighted by softmax with it through C per-cluster "
                f"mean pairs (hf-knorm convert --clusters; default: {DEFAULT_CLUSTERS} beside the default sparse "
                "cache; 0: none)", "metavar": "C"})
    cluster_tokens: int | None = field(default=None, metadata={
        "help": "step 4: tokens the cluster codebooks are fitted on (hf-knorm convert --cluster-tokens; default: "
                "max(2048, 8 C))", "metavar": "N"})
    beyond_window: bool = field(default=True, metadata={
        "help": "step 4: also measure beyond the window (1,024-token blocks from position 256, passkey retrieval at "
                "1,000 tokens, the window alone), as hf-knorm convert does"})
    full_conversion: bool = field(default=False, metadata={
        "help": "step 4: convert with hf-knorm convert's full defaults (BENCHMARKS.md has their time) instead of "
                "the demo's shortened schedule"})

    def __post_init__(self):
        from ...eviction.scores import resolve_score

        resolve_score(self.niah_score)  # an unknown score fails before any step runs, listing the accepted ones
        if self.niah_score == "key_norm":
            raise ValueError("niah_score is shown beside the paper's key_norm, which step 3 always runs: choose "
                             "another score (e.g. kv_diff).")
        clusters = DEFAULT_CLUSTERS if self.clusters is None else self.clusters
        if self.cluster_tokens is not None and not clusters:
            raise ValueError("cluster_tokens sizes the fit of the cluster codebooks, and clusters is 0: drop it.")
        if self.cluster_tokens is not None and self.cluster_tokens < clusters:
            raise ValueError(f"cluster_tokens must be at least the number of clusters ({clusters}: one key per "
                             f"direction), not {self.cluster_tokens}.")
        if not 0 < self.niah_ratio < 1:
            raise ValueError(f"niah_ratio must be in (0, 1) (the fraction of the context evicted), got "
                             f"{self.niah_ratio!r}.")

    @classmethod
    def fast(cls) -> DemoSettings:
        """Every step shrunk to seconds, for the test suite (``--fast``)."""
        return cls(normalizations=("softmax", "x^3/16"), decoding_lengths=(32, 128), calibration_tokens=256, niah_lengths=(300,),
                   niah_depths=(0.5,), transfer_steps=4, recovery_steps=4, train_block_size=64, train_batch_size=2,
                   teacher_tokens=256, eval_tokens=128, eval_steps=2, logging_steps=2, probe=False,
                   softmax_window=16, clusters=8, cluster_tokens=256, beyond_window=False)

    def conversion(self, model: str, out: str):
        """The :class:`~hf_knorm.conversion.settings.ConvertSettings` of step 4."""
        from ...conversion.settings import ConvertSettings

        if self.full_conversion:
            return ConvertSettings(model=model, out=out, normalization=self.train_normalization, probe=self.probe,
                                   softmax_window=self.softmax_window, sparse_cache=self.sparse_cache,
                                   clusters=self.clusters, cluster_tokens=self.cluster_tokens,
                                   beyond_window=self.beyond_window)
        return ConvertSettings(
            model=model, out=out, normalization=self.train_normalization, softmax_window=self.softmax_window,
            sparse_cache=self.sparse_cache, clusters=self.clusters, cluster_tokens=self.cluster_tokens,
            beyond_window=self.beyond_window,
            retrieval_lengths=(1000,),
            transfer_steps=self.transfer_steps, recovery_steps=self.recovery_steps, block_size=self.train_block_size, batch_size=self.train_batch_size,
            teacher_tokens=self.teacher_tokens, eval_tokens=self.eval_tokens, eval_steps=self.eval_steps,
            logging_steps=self.logging_steps, probe=self.probe,
            warmup_steps=min(10, self.transfer_steps // 2), save_steps=max(self.transfer_steps, self.recovery_steps) + 1)

    def as_dict(self) -> dict:
        """The settings as plain values (for the report and ``demo.json``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

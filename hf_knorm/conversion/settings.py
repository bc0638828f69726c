"""``ConvertSettings``: what ``hf-knorm convert`` and :func:`hf_knorm.convert` run; each field is a flag.

The defaults convert the embedded default model (SmolLM2-135M-Instruct) to ``x/1 + softmax window 64 + sinks 4 + sparse
256 (prefix_kv_diff) + clusters 600`` on the general mixture (:mod:`.mixture`: the original model's own samples and
Paul Graham essays 0-39), evaluated on four held-out domains (:mod:`hf_knorm.evaluation.domains`) and by the ability
probe (:mod:`hf_knorm.evaluation.probe`); docs/results/conversion.md, "The default conversion", has the time and the
figures. Each field's ``metadata["help"]`` is its flag's help, a line or two; docs/conversion.md has the details.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from ..normalizations import Normalization, parse_normalization, with_clusters, with_sparse, with_window
from ..normalizations.sparse_choice import DEFAULT_SCORE
from ..runs.precision import BF16_HELP, FP16_HELP
from ..training.window_dropout import WINDOW_DROPOUT_SCHEDULES

RECOVERY_MODES = ("lora", "full", "none")
DEFAULT_NORMALIZATION = "x/1"
"""The part beside the window: with ``p = 1`` decoding holds ``W + S + K`` pairs and a ``D x D_v`` state whatever the
length (:class:`hf_knorm.recurrent.sparse_cache.SparseWindowStateLayer`)."""
DEFAULT_SOFTMAX_WINDOW = 64
"""LoLCATs' window (arXiv 2410.10254: 64 softmax keys beside the linear attention)."""
DEFAULT_ATTENTION_SINKS = 4
"""StreamingLLM's attention sinks (arXiv 2309.17453): each sequence's first 4 keys by softmax beside the window."""
DEFAULT_SPARSE_CACHE = 256
DEFAULT_SPARSE_SCORE = DEFAULT_SCORE
"""The sparse global cache beside the window (LoLA, arXiv 2505.23666): the 256 older pairs per layer and KV head of
highest ``kv_diff`` over each token's prefix (:mod:`hf_knorm.normalizations.prefix_kv_diff`), the configuration that
retrieves beyond the window best of those measured (docs/results/conversion.md, 'The default conversion': at 4,000
tokens it keeps the passkey where ``value_over_key``, the default before, does not): the one default score
(:data:`hf_knorm.normalizations.sparse_choice.DEFAULT_SCORE`, also the parser's and the recurrent cache's). The
default training blocks (:data:`DEFAULT_BLOCK_SIZE`) are longer than the window, the sinks and the cache hold, so the
score's choice, the ``x/1`` part and the clusters all act in training."""
DEFAULT_CLUSTERS = 600
"""The clusters beside the default sparse cache (:mod:`hf_knorm.attention.distant_clusters`): the older pairs the
cache leaves, weighted by softmax with it through 600 per-cluster mean pairs per layer and KV head, their codebooks
fitted on the transferred model's keys before the recovery, which trains with them. With the window, the sinks, the
cache, the ``x/1`` state and the score's statistics, 24%
of the pairs' bytes at 4,000 tokens (issue 47's budget: 25%). Measured on three seeds against the cache alone
(docs/results/conversion.md, 'The default conversion'): the same passkeys on the median, 13% lower perplexity beyond
the window on technical text in 1,024-token blocks."""
DEFAULT_BLOCK_SIZE, DEFAULT_BATCH_SIZE = 512, 2
"""Tokens per training example and examples per micro-batch: 1,024 tokens a step as before, in blocks longer than the
default's ``64 + 4 + 256 = 324`` pairs, so that every part of it sees gradients (in 256-token blocks the cache held
every older key: a softmax model was trained and ``x/1`` and the clusters shipped untrained). Measured on seeds 0
and 1 against the 256-token default (docs/results/conversion.md, 'Training blocks longer than the cache'): worst
held-out domain 0.97x and 0.98x the original (best 0.85x), beyond the window in 1,024-token blocks 1.074x and 1.084x
(1.08x before), passkeys 44 of 48; the recovery 2.2x slower (36.0 minutes against 16.3), the first run on a fresh
machine about 76 minutes."""
RECOVERY_TRAINABLE = ("all", "no-embeddings", "attention")
MODEL, NORMALIZATION, STAGES, EVALUATION, RUN = (
    "the model and its training data", "the normalization", "the stages: attention transfer, then recovery",
    "evaluation", "output and run")
"""The groups of ``hf-knorm convert --help`` (each field's ``metadata["group"]``)."""
SCALE_FOLDS = ("scores", "output")
"""Where the transfer's closed-form head scales go (:meth:`~.transfer.AttentionTransfer.match_scale`)."""
RECOVERY_LEARNING_RATES = {1: 1e-3}
"""The recovery's default rate by the normalization's power where it is not ``DEFAULT_RECOVERY_LEARNING_RATE``: the
linear ones were measured at the full budget at 1e-3 only, and trained stably there
(docs/research/2026-12-conversion.md, 'Per normalization')."""
DEFAULT_RECOVERY_LEARNING_RATE = 5e-4
"""The cubic ones' in full recovery: three x^3/16 runs over seeds and thread counts within 0.94-1.13x of their median,
where 1e-3 moved them by 2.6x (docs/research/2026-12-conversion.md, 'The general conversion':
'Spread after the fix')."""
LORA_RECOVERY_LEARNING_RATE = 1e-3
"""LoRA recovery's default rate, any normalization: the default conversion's, measured over three seeds
(docs/research/2026-12-conversion.md, 'LoRA recovery')."""
DEFAULT_TEACHER_TOP_K = 256
"""The recovery's KL against the teacher's 256 most likely tokens (95% of its mass on the default model), cached once
(:mod:`.teacher_logits`): the default conversion's, measured over three seeds (docs/research/2026-12-conversion.md,
'LoRA recovery'), where the recovery reads most of the training set (:func:`default_teacher_top_k`)."""


@dataclass
class ConvertSettings:
    """A conversion: attention transfer, then recovery, each a Trainer run with held-out perplexity.

    Attributes are the command-line flags (``--transfer-steps`` for ``transfer_steps``); see each field's help.
    """

    help_groups: ClassVar[tuple[str, ...]] = (MODEL, NORMALIZATION, STAGES, EVALUATION, RUN)
    """The order of the groups of ``hf-knorm convert --help``."""

    model: str = field(default="default", metadata={
        "help": "'default' (SmolLM2-135M-Instruct, embedded), the folder of a pretrained softmax causal LM, or its Hub id "
                "(org/name) if it is in the local Hub cache (nothing is downloaded)", "group": MODEL})
    dataset: str = field(default="general", metadata={
        "help": "general (the original model's samples + essays), shakespeare, paul-graham, chatterbot, local "
                "files or a datasets name, in any format finetune takes", "group": MODEL})
    teacher_tokens: int = field(default=65536, metadata={
        "help": "tokens the original samples for general, cached", "group": MODEL})
    pack_teacher_samples: bool = field(default=False, metadata={
        "help": "pack the teacher samples with the essays",
        "group": MODEL})
    normalization: str = field(default=DEFAULT_NORMALIZATION, metadata={
        "help": "the normalization beyond the window (hf-knorm --help lists them)",
        "group": NORMALIZATION})
    softmax_window: int = field(default=DEFAULT_SOFTMAX_WINDOW, metadata={
        "help": "softmax over each query's last W keys (0: none)",
        "group": NORMALIZATION, "metavar": "W"})
    attention_sinks: int | None = field(default=None, metadata={
        "help": f"softmax over the first S keys too (default: {DEFAULT_ATTENTION_SINKS} with a window, 0 without)",
        "group": NORMALIZATION, "metavar": "S"})
    sparse_cache: int | None = field(default=None, metadata={
        "help": f"softmax over K older pairs per KV head too, by --sparse-score (default: {DEFAULT_SPARSE_CACHE} "
                "with a window, 0 without)",
        "group": NORMALIZATION, "metavar": "K"})
    sparse_score: str | None = field(default=None, metadata={
        "help": f"prefix_kv_diff | value_over_key | key_norm (default: {DEFAULT_SPARSE_SCORE})",
        "group": NORMALIZATION, "metavar": "SCORE"})
    clusters: int | None = field(default=None, metadata={
        "help": "softmax over C cluster means of the pairs the cache leaves too (default: the spelling's, or "
                f"{DEFAULT_CLUSTERS} beside a cache it does not give; 0: none)",
        "group": NORMALIZATION, "metavar": "C"})
    cluster_tokens: int | None = field(default=None, metadata={
        "help": "tokens of the essays the cluster codebooks are fitted on (default: max(2048, 8 C))",
        "group": NORMALIZATION, "metavar": "N"})
    fold_constant: bool = field(default=True, metadata={
        "help": "train x^p/c as x^p/1, then fold c^(1/p) into q", "group": NORMALIZATION})
    out: str = field(default="outputs/convert", metadata={
        "help": "the run and the converted model", "group": RUN,
        "metavar": "DIR"})
    text_column: str = field(default="text", metadata={"help": "the text column", "group": MODEL})
    split: str = field(default="train", metadata={"help": "the split", "group": MODEL})
    train_on_prompt: bool = field(default=False, metadata={
        "help": "the loss on prompts too, not only on replies",
        "group": MODEL})
    eval_dataset: str | None = field(default=None, metadata={
        "help": "held-out text of the data, as --dataset (default: the data's own, or none: docs/conversion.md)",
        "group": EVALUATION})
    eval_domains: tuple[str, ...] = field(default=("essays", "plays", "technical", "conversation"), metadata={
        "help": "held-out domains; the worst is the headline", "group": EVALUATION})
    eval_fraction: float = field(default=0.1, metadata={
        "help": "texts held out of other data", "group": EVALUATION})
    eval_tokens: int = field(default=4096, metadata={
        "help": "held-out tokens per domain", "group": EVALUATION})
    eval_steps: int = field(default=50, metadata={"help": "evaluate every N steps", "group": EVALUATION})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per example", "group": MODEL})
    batch_size: int = field(default=DEFAULT_BATCH_SIZE, metadata={"help": "examples per micro-batch",
                                                                  "group": STAGES})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "micro-batches per step", "group": STAGES})
    transfer_steps: int = field(default=25, metadata={
        "help": "transfer steps (0: no transfer)", "group": STAGES})
    transfer_learning_rate: float = field(default=1e-3, metadata={
        "help": "transfer learning rate", "group": STAGES})
    transfer_trainable: str = field(default="qk", metadata={
        "help": "what the transfer trains, of qkvo", "group": STAGES})
    scale_fold: str = field(default="scores", metadata={
        "help": "where the closed-form head scales go", "choices": SCALE_FOLDS,
        "group": STAGES})
    recovery: str = field(default="lora", metadata={
        "help": "lora (merged before saving) | full | none", "choices": RECOVERY_MODES,
        "group": STAGES})
    recovery_steps: int = field(default=150, metadata={"help": "recovery steps at --budget 1", "group": STAGES})
    budget: float = field(default=1.0, metadata={
        "help": "the recovery's length, in --recovery-steps", "group": STAGES})
    window_dropout: float = field(default=0.0, metadata={
        "help": "chance a recovery step runs without the window (0: off)",
        "group": STAGES, "metavar": "P0"})
    window_dropout_schedule: str = field(default="linear", metadata={
        "help": "linear: down to 0", "choices": WINDOW_DROPOUT_SCHEDULES, "group": STAGES})
    recovery_learning_rate: float | None = field(default=None, metadata={
        "help": "recovery learning rate (default: 1e-3, or 5e-4 in full recovery of any but x/c)",
        "group": STAGES})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank", "group": STAGES})
    distill_weight: float = field(default=1.0, metadata={
        "help": "weight of the KL to the original (0: none)", "group": STAGES})
    teacher_top_k: int | None = field(default=None, metadata={
        "help": "the KL over the original's top K tokens, cached (0: every token; default: 256 where the "
                "recovery reads half the data, else 0)", "group": STAGES, "metavar": "K"})
    next_token_weight: float = field(default=1.0, metadata={
        "help": "weight of the next-token loss", "group": STAGES})
    recovery_trainable: str = field(default="all", metadata={
        "help": "what full recovery trains", "choices": RECOVERY_TRAINABLE, "group": STAGES})
    non_attention_lr_scale: float = field(default=1.0, metadata={
        "help": "learning-rate factor outside attention", "group": STAGES})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping", "group": STAGES})
    warmup_steps: int = field(default=10, metadata={"help": "warm-up steps of each stage", "group": STAGES})
    logging_steps: int = field(default=10, metadata={"help": "log every N steps", "group": RUN})
    save_steps: int = field(default=50, metadata={"help": "checkpoint every N steps", "group": RUN})
    max_blocks: int | None = field(default=None, metadata={"help": "at most N training blocks", "group": MODEL})
    seed: int = field(default=0, metadata={"help": "random seed", "group": RUN})
    bf16: bool = field(default=False, metadata={"help": BF16_HELP, "group": RUN})
    fp16: bool = field(default=False, metadata={"help": FP16_HELP, "group": RUN})
    beyond_window: bool = field(default=True, metadata={
        "help": "perplexity and retrieval beyond the window",
        "group": EVALUATION})
    beyond_window_block: int = field(default=1024, metadata={
        "help": "tokens per block beyond the window (> 256)", "group": EVALUATION})
    retrieval_tasks: tuple[str, ...] = field(default=("passkey",), metadata={
        "help": "passkey, niah or none", "group": EVALUATION, "metavar": "TASK,..."})
    retrieval_lengths: tuple[int, ...] = field(default=(1000, 2000), metadata={
        "help": "retrieval context lengths", "group": EVALUATION})
    probe: bool = field(default=True, metadata={
        "help": "the ability probe (40 greedy answers)", "group": EVALUATION})
    report_to: tuple[str, ...] = field(default=("tensorboard",), metadata={
        "help": "Trainer integrations", "group": RUN})
    resume: bool = field(default=False, metadata={
        "help": "continue an interrupted run in --out", "group": RUN})

    def target(self) -> Normalization:
        """The normalization the run converts to, with its softmax window: the spelling parsed, the one place a
        conversion reads it (the job passes the object on).

        Raises:
            ValueError: an unknown spelling, a window, sinks, a sparse cache or clusters that contradict
                ``softmax_window``, ``attention_sinks``, ``sparse_cache``, ``sparse_score`` and ``clusters``, sinks or a
                sparse cache without a window, or clusters without a sparse cache.
        """
        base = parse_normalization(self.normalization)
        if base.clusters and self.clusters not in (None, base.clusters):
            raise ValueError(f"{base.name} already has {base.clusters} clusters; clusters={self.clusters} contradicts "
                             "it. Give the clusters once.")
        cached = self._target_cache(base)
        clusters = self.clusters
        if clusters is None:  # the spelling's; beside a sparse cache from the flags or the defaults, the default's
            clusters = base.clusters or (DEFAULT_CLUSTERS if cached.sparse and not base.sparse else 0)
        return with_clusters(cached, clusters)

    def _target_cache(self, base: Normalization) -> Normalization:
        """:meth:`target` up to its clusters."""
        sinks = self.attention_sinks
        if sinks is None and not base.sinks:  # None with sinks in the spelling: keep them
            sinks = DEFAULT_ATTENTION_SINKS if self.softmax_window else 0
        windowed = with_window(base, self.softmax_window, sinks)
        sparse, score = self.sparse_cache, self.sparse_score
        if base.sparse:  # the spelling's sparse cache: the flags may repeat it, not change it
            spelled = base.score
            if sparse not in (None, base.sparse) or score not in (None, spelled):
                raise ValueError(f"{base.name} already has a sparse cache of {base.sparse} pairs ({spelled}); "
                                 f"sparse_cache={sparse}, sparse_score={score} contradict it. Give the cache once.")
            return windowed
        if sparse is None:
            sparse = DEFAULT_SPARSE_CACHE if self.softmax_window else 0
        if score is not None and not sparse:
            raise ValueError(f"sparse_score={score} without a sparse cache (sparse_cache=0, or no softmax window): "
                             "give sparse_cache=K > 0 beside a window, or leave sparse_score out.")
        if sparse and not self.softmax_window:
            raise ValueError(f"sparse_cache={sparse} without a softmax window: the sparse cache's pairs are weighted "
                             "by softmax with the window's. Give softmax_window=W > 0 too, or sparse_cache=0.")
        return with_sparse(windowed, sparse, score or DEFAULT_SPARSE_SCORE)

    def resolved(self, target: Normalization) -> ConvertSettings:
        """These settings with the defaults that depend on others filled in: the recovery rate (on the recovery and
        the normalization, ``target``), the teacher's top k where the recovery does not distil (0; where it does,
        ``None`` stays until the recovery knows its training set: :func:`default_teacher_top_k`), the sparse
        cache's score and the clusters (``target``'s: a later change of a default cannot resume a run with another
        score or other clusters)."""
        rate = self.recovery_learning_rate
        if rate is None:
            rate = default_recovery_learning_rate(target, self.recovery)
        top_k = self.teacher_top_k
        if top_k is None and (self.distill_weight == 0 or self.recovery == "none"):
            top_k = 0
        score = self.sparse_score or (target.score if target.sparse else None)
        clusters = target.clusters if self.clusters is None else self.clusters
        return replace(self, recovery_learning_rate=rate, teacher_top_k=top_k, sparse_score=score, clusters=clusters)

    def scheduled_recovery_steps(self) -> int:
        """The recovery's steps: ``recovery_steps`` times ``budget``, rounded."""
        return round(self.recovery_steps * self.budget)

    def examples_drawn(self, steps: int, processes: int) -> int:
        """The training examples ``steps`` optimizer steps draw: steps x batch x accumulation x processes."""
        return steps * self.batch_size * self.gradient_accumulation_steps * processes

    def domains(self) -> list[str]:
        """``eval_domains`` as a list of names."""
        names = [self.eval_domains] if isinstance(self.eval_domains, str) else list(self.eval_domains)
        return [name for name in names if name and name != "none"]

    def retrieval(self) -> dict:
        """The retrieval grid as :func:`hf_knorm.evaluation.retrieval.retrieval_records` takes it."""
        tasks = [self.retrieval_tasks] if isinstance(self.retrieval_tasks, str) else list(self.retrieval_tasks)
        return {"tasks": [task for task in tasks if task and task != "none"],
                "lengths": [int(length) for length in self.retrieval_lengths]}

    def integrations(self) -> list[str]:
        """``report_to`` as the Trainer takes it."""
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        return [name for name in names if name and name != "none"]


def default_recovery_learning_rate(normalization: Normalization, recovery: str = "lora") -> float:
    """The recovery's default learning rate: ``LORA_RECOVERY_LEARNING_RATE`` for LoRA, else by ``normalization``'s
    power (``RECOVERY_LEARNING_RATES``)."""
    if recovery == "lora":
        return LORA_RECOVERY_LEARNING_RATE
    return RECOVERY_LEARNING_RATES.get(getattr(normalization.without_window, "power", None), DEFAULT_RECOVERY_LEARNING_RATE)


def default_teacher_top_k(drawn: int, examples: int) -> int:
    """The teacher's top k a distilled recovery uses when none is given: ``DEFAULT_TEACHER_TOP_K`` where the recovery
    draws at least half of the training set's ``examples`` (``drawn``: steps x batch x accumulation x processes), so
    the cache costs at most twice the teacher forwards it saves in this run and none in the next; else 0 (the
    teacher's forward at each step: a few steps of a short run read a few examples)."""
    return DEFAULT_TEACHER_TOP_K if 2 * drawn >= examples else 0

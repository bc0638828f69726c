"""``ConvertSettings``: what ``hf-knorm convert`` and :func:`hf_knorm.convert` run; each field is a flag.

The defaults convert the embedded default model (SmolLM2-135M-Instruct) to ``x/1 + softmax window 64 + sinks 4 + sparse
256 (prefix_kv_diff)`` on the general mixture (:mod:`.mixture`: the original model's own samples and Paul Graham essays
0-39), evaluated on four held-out domains
(:mod:`hf_knorm.evaluation.domains`) and by the ability probe (:mod:`hf_knorm.evaluation.probe`);
docs/results/conversion.md, "The default conversion", has the time and the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..normalizations import Normalization, parse_normalization, with_clusters, with_sparse, with_window
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
DEFAULT_SPARSE_SCORE = "prefix_kv_diff"
"""The sparse global cache beside the window (LoLA, arXiv 2505.23666): the 256 older pairs per layer and KV head of
highest ``kv_diff`` over each token's prefix (:mod:`hf_knorm.normalizations.prefix_kv_diff`), the configuration that
retrieves beyond the window best of those measured (docs/results/conversion.md, 'The default conversion': at 4,000
tokens it keeps the passkey where ``value_over_key``, the default before, does not). At the default 256-token
training blocks it holds every older key, so the trained weights do not depend on the score, and the part beside it
trains only under window dropout."""
DEFAULT_CLUSTERS = 600
"""The clusters beside the default sparse cache (:mod:`hf_knorm.attention.distant_clusters`): the older pairs the
cache leaves, weighted by softmax with it through 600 per-cluster mean pairs per layer and KV head, their codebooks
fitted after the training. With the window, the sinks, the cache, the ``x/1`` state and the score's statistics, 24%
of the pairs' bytes at 4,000 tokens (issue 47's budget: 25%). Measured on three seeds against the cache alone
(docs/results/conversion.md, 'The default conversion'): the same passkeys on the median, 13% lower perplexity beyond
the window on technical text in 1,024-token blocks."""
RECOVERY_TRAINABLE = ("all", "no-embeddings", "attention")
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

    model: str = field(default="default", metadata={
        "help": "'default' (SmolLM2-135M-Instruct, embedded), the folder of a pretrained softmax causal LM, or its Hub id "
                "(org/name) if it is in the local Hub cache (nothing is downloaded)"})
    dataset: str = field(default="general", metadata={
        "help": "training data: general (the original model's own samples + Paul Graham essays 0-39) | shakespeare | "
                "paul-graham | chatterbot (conversations) | local file(s), comma-separated | a datasets name; text, "
                "'messages' (conversations) or 'prompt' + 'completion' columns, detected"})
    teacher_tokens: int = field(default=65536, metadata={
        "help": "tokens the original model samples for the general mixture (generated once, then cached); at most 256 "
                "per example the run's stages draw (steps x batch x accumulation x processes)"})
    pack_teacher_samples: bool = field(default=False, metadata={
        "help": "pack the teacher samples into blocks with the essays (default: each sample is one example from "
                "position 0, padded, as a prompt starts)"})
    normalization: str = field(default=DEFAULT_NORMALIZATION, metadata={
        "help": "the normalization to convert to (not softmax), beside --softmax-window, --attention-sinks and "
                "--sparse-cache"})
    softmax_window: int = field(default=DEFAULT_SOFTMAX_WINDOW, metadata={
        "help": "W: each query's last W keys keep softmax, the older keys take the normalization, scaled by a "
                "per-head mix solved in closed form (LoLCATs' hybrid; hf_knorm.attention.window); 0: the pure "
                "normalization over every key (docs/results/conversion.md, 'The default conversion': both measured)"})
    attention_sinks: int | None = field(default=None, metadata={
        "help": "S: each sequence's first S keys keep softmax beside the window and leave the polynomial part "
                "(StreamingLLM's attention sinks, arXiv 2309.17453); needs a window (default: "
                f"{DEFAULT_ATTENTION_SINKS} with one, 0 without)"})
    sparse_cache: int | None = field(default=None, metadata={
        "help": "K: each layer keeps up to K key/value pairs older than the window, chosen by --sparse-score and "
                "weighted by softmax with it; the others go to the normalization (LoLA's sparse global cache, arXiv "
                "2505.23666); needs a window (default: "
                f"{DEFAULT_SPARSE_CACHE} with one, 0 without; 0: none)"})
    sparse_score: str | None = field(default=None, metadata={
        "help": "which older pairs the sparse cache keeps, a score fixed before its token leaves the window: "
                "prefix_kv_diff (kv_diff against the tokens before it; a window of 3 or more) | value_over_key "
                f"(||v|| / ||k||) | key_norm (KNorm's -||k||) (default: {DEFAULT_SPARSE_SCORE})"})
    clusters: int | None = field(default=None, metadata={
        "help": "C: the older pairs the sparse cache leaves are also weighted by softmax with it through C "
                "pseudo-pairs per layer and KV head, the mean key and value of each cluster of a codebook fitted "
                "after training on the model's keys (Paul Graham essays; hf_knorm.attention.distant_clusters); needs "
                f"a sparse cache (default: the spelling's; {DEFAULT_CLUSTERS} beside a sparse cache the spelling does "
                "not give; else 0: none; not with an attention softcap, Gemma 2)"})
    fold_constant: bool = field(default=True, metadata={
        "help": "x^p/c with a constant c: train the same function as x^p/1, then fold c^(1/p) into the queries "
                "(AdamW's steps suit the smaller q and k: docs/research/2026-12-conversion.md, 'Per normalization'); "
                "--no-fold-constant trains x^p/c itself"})
    out: str = field(default="outputs/convert", metadata={
        "help": "run folder: each stage's checkpoints and logs, the converted model, convert.json"})
    text_column: str = field(default="text", metadata={"help": "the column holding the text"})
    split: str = field(default="train", metadata={"help": "the split to read"})
    train_on_prompt: bool = field(default=False, metadata={
        "help": "conversations and prompt/completion pairs: the loss on every token, not only on the replies"})
    eval_dataset: str | None = field(default=None, metadata={
        "help": "held-out text of the training data (same forms as --dataset), evaluated beside the held-out "
                "domains; default: none for general and paul-graham, shakespeare's Hamlet and sonnets, else the "
                "last --eval-fraction of the texts"})
    eval_domains: tuple[str, ...] = field(default=("essays", "plays", "technical", "conversation"), metadata={
        "help": "held-out domains, comma-separated (hf_knorm.evaluation.domains; none: no domain); the headline "
                "figure is the worst held-out set"})
    eval_fraction: float = field(default=0.1, metadata={"help": "share of texts held out of other datasets"})
    eval_tokens: int = field(default=4096, metadata={
        "help": "held-out tokens of each domain scored at each evaluation"})
    eval_steps: int = field(default=50, metadata={"help": "evaluate every N steps of each stage (and at its start)"})
    block_size: int = field(default=256, metadata={"help": "tokens per example"})
    batch_size: int = field(default=4, metadata={"help": "examples per device and micro-batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "micro-batches per optimizer step, in each process"})
    transfer_steps: int = field(default=25, metadata={
        "help": "attention-transfer steps after the closed-form head scales (0: skip the stage and the scales)"})
    transfer_learning_rate: float = field(default=1e-3, metadata={"help": "attention-transfer learning rate"})
    transfer_trainable: str = field(default="qk", metadata={
        "help": "attention projections trained by the transfer, letters of qkvo"})
    scale_fold: str = field(default="scores", metadata={
        "help": "where the closed-form head scales go: scores (q/k rows; o_proj keeps its size, so AdamW steps stay "
                "in proportion) | output (o_proj columns)", "choices": SCALE_FOLDS})
    recovery: str = field(default="lora", metadata={
        "help": "recovery: lora (rank --lora-rank adapters on q/k/v/o, the MLPs and embeddings frozen, merged before "
                "saving: with the softmax window it keeps more of the original's answers than full recovery, for a "
                "slightly worse worst domain; docs/research/2026-12-conversion.md, 'LoRA recovery') | full (every "
                "weight, --recovery-trainable) | none",
        "choices": RECOVERY_MODES})
    recovery_steps: int = field(default=150, metadata={"help": "recovery steps at --budget 1"})
    budget: float = field(default=1.0, metadata={
        "help": "the recovery's length as a multiple of its steps (recovery_steps), to trade time for quality: 1 is "
                "the default conversion (150 steps; its time in docs/results/conversion.md, "
                "'The default conversion'), 2 runs 300 steps: on the pure x^3/16 in full recovery, 1.55x the time, the worst "
                "held-out domain from 12.9x to 9.7x the original (docs/research/2026-12-conversion.md, 'Budget')"})
    window_dropout: float = field(default=0.0, metadata={
        "help": "p0: with a softmax window, the probability that a recovery step runs without it (the window, the "
                "sinks and a sparse cache off: the normalization alone over every key), so that the part beside the "
                "window must carry the context; drawn once per step from --seed (Scheduled Sliding-window Dropout, "
                "arXiv 2510.05901; hf_knorm.training.window_dropout); never in evaluation; 0: off"})
    window_dropout_schedule: str = field(default="linear", metadata={
        "help": "how --window-dropout moves over the recovery: linear (p0 at the first step, down to 0 at the last) | "
                "constant", "choices": WINDOW_DROPOUT_SCHEDULES})
    recovery_learning_rate: float | None = field(default=None, metadata={
        "help": "recovery learning rate; default 1e-3 for LoRA; in full recovery by the normalization's power: 1e-3 "
                "for the linear ones (x/c, x/sqrtN; x/1 measured stable at the full budget), 5e-4 for the others "
                "(1e-3 moved x^3/16 by 2.6x between runs; docs/research/2026-12-conversion.md, "
                "'The general conversion': 'Spread after the fix')"})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank (q, k, v, o projections)"})
    distill_weight: float = field(default=1.0, metadata={
        "help": "weight of the KL divergence to the original model's next-token distribution in recovery (0: the "
                "next-token loss alone: steps 1.5x faster without the teacher, a worse model: BENCHMARKS.md)"})
    teacher_top_k: int | None = field(default=None, metadata={
        "help": "K > 0: the recovery's KL against the original model's K most likely next tokens per position plus one "
                "bucket for the rest, computed once before the recovery and cached (no teacher forward per step; "
                "hf_knorm.conversion.teacher_logits); 0: the full teacher at every step; default: 256 where the "
                "recovery distils and draws at least half the training examples (the default conversion: 600 of "
                "about 760), else 0 (a short run: the cache would cost more teacher forwards than it saves)"})
    next_token_weight: float = field(default=1.0, metadata={
        "help": "weight of the next-token loss in recovery (0: the KL to the original model alone)"})
    recovery_trainable: str = field(default="all", metadata={
        "help": "what full recovery trains: all | no-embeddings (the token embeddings and a tied output layer stay) "
                "| attention (the attention projections alone)", "choices": RECOVERY_TRAINABLE})
    non_attention_lr_scale: float = field(default=1.0, metadata={
        "help": "recovery learning rate of the weights outside the attention, as a fraction of "
                "--recovery-learning-rate (the attention is what the conversion changed)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping of both stages"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps of each stage"})
    logging_steps: int = field(default=10, metadata={"help": "log loss and norms every N steps"})
    save_steps: int = field(default=50, metadata={"help": "checkpoint every N steps"})
    max_blocks: int | None = field(default=None, metadata={"help": "use at most N training blocks"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    bf16: bool = field(default=False, metadata={"help": BF16_HELP})
    fp16: bool = field(default=False, metadata={"help": FP16_HELP})
    beyond_window: bool = field(default=True, metadata={
        "help": "also measure beyond the window: each held-out domain's perplexity in --beyond-window-block-token "
                "blocks on positions >= 256, and --retrieval-tasks at --retrieval-lengths, of the original and the "
                "converted model and, with a softmax window, of the window alone (the polynomial part off)"})
    beyond_window_block: int = field(default=1024, metadata={
        "help": "tokens per block of the beyond-window perplexity (above 256; max(--eval-tokens, this) tokens of "
                "each domain). 4096 measures what a bounded cache loses where it cannot hold the whole block (the "
                "default conversion: 1.24x the original on technical text at 1024, 2.21x at 4096)"})
    retrieval_tasks: tuple[str, ...] = field(default=("passkey",), metadata={
        "help": "retrieval tasks beyond the window, comma-separated: passkey, niah (none: no retrieval)"})
    retrieval_lengths: tuple[int, ...] = field(default=(1000, 2000), metadata={
        "help": "context lengths (tokens) of the retrieval, separated by commas; the needle at 4 depths from 0 to "
                "0.75, 2 seeds each"})
    probe: bool = field(default=True, metadata={
        "help": "ask the ability probe (40 greedy answers) of the original and the converted model"})
    report_to: tuple[str, ...] = field(default=("tensorboard",), metadata={
        "help": "Trainer integrations, comma-separated (tensorboard, wandb, ...; 'none' for none)"})
    resume: bool = field(default=False, metadata={"help": "continue an interrupted conversion in --out"})

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

"""Attention transfer: each patched attention layer learns to reproduce the original model's attention output.

Stage 1 of LoLCATs (Zhang et al., "LoLCATs: On Low-Rank Linearizing of Large Language Models", ICLR 2025,
arXiv 2410.10254), applied to the polynomial normalizations of "Rethinking Softmax" (arXiv 2410.18613).

How it runs. The student is the model patched with the new normalization. Beside each of its attention modules, a
frozen copy made *before* patching (the teacher) keeps the model's original attention. A forward hook on every
student attention module runs the teacher on the same inputs (hidden states, position embeddings, mask), records

    e_l = mean((y_student - y_teacher)^2) / mean(y_teacher^2)          (y: the attention output, (B, q, hidden))

and hands the *teacher's* output on to the residual stream. Every layer therefore sees exactly the inputs it has in
the original model, and the layers learn independently, as in LoLCATs. The loss is the mean of ``e_l`` over layers.
Only the named projections of the attention modules train, with the family's learned values (a sigmoid's bias, a
sink logit); the rest of the model is frozen. Nothing is added to the model: the trained projections are ordinary
weights and the normalization keeps its formula ``x^p/c``.

Scale first. Right after patching, a polynomial attention's output is off by orders of magnitude (``x^3/16`` on
the default model: the output is ~10^4 times softmax's, a relative error ~10^9), which gradient steps on the
projections cannot undo in any reasonable budget. :meth:`AttentionTransfer.match_scale` solves the best scalar per
query head in closed form on a calibration batch (least squares between each head's contribution to the attention
output, ``c_h = o_h W_o[:, h]^T``: ``gamma_h = <c_s,h, c_t,h> / <c_s,h, c_s,h>``) and folds it into ``o_proj``'s
columns of that head: an exact rescaling of the head's output, the normalization untouched. A second call finds
every scale 1.

Where the scale goes matters for the training that follows. Folded into ``o_proj`` (``fold="output"``), the scales
(1e-5 to 1e-3 on the default model) shrink that head's ``o_proj`` columns by as much, and AdamW, whose steps are of
a fixed size in parameter space, then changes them by their own size at every step: full fine-tuning at 1e-4 and
LoRA at 1e-3 diverged within 10-25 steps. The polynomial ``w = s^p / c`` is homogeneous in the score, so
``fold="scores"`` (the default) puts ``|gamma_h|^(1/p)`` into the scores instead, split evenly between the query
rows of head ``h`` and the key rows of its key/value head (a geometric mean over the heads sharing it, GQA), and
only the sign into ``o_proj`` (a flip, exact under any power). Same function, weights of ordinary size. Attention
modules whose scores are not linear in q and k (``q_norm``/``k_norm``, a softcap) take ``fold="output"``.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..attention.masks import explicit_mask
from ..models.architectures import attention_modules
from ..models.patching import held_normalization
from .learned_values import family_values
from .settings import SCALE_FOLDS

PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
"""Letters of ``trainable`` and the Llama-style attention projections they name."""
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")
"""Keyword arguments that carry a KV cache into an attention module (the name changed across Transformers 5.x): the
teacher never writes to the student's cache."""


class AttentionTransfer:
    """Teacher copies of a model's attention modules and the hooks that train the student's to match them.

    Build it on the model **before** patching (the teachers copy the original attention), then patch the model.

    Args:
        model: a causal LM of a supported architecture whose attention projections are named ``q_proj``, ``k_proj``,
            ``v_proj``, ``o_proj`` (Llama, Mistral, Qwen, Gemma families).
        trainable: which projections train, as letters of ``"qkvo"`` (default ``"qk"``: the scores only).

    Attributes:
        layer_errors: ``{layer index: relative error}`` of the last forward pass with the hooks on (tensors with grad
            during training).
    """

    def __init__(self, model: nn.Module, trainable: str = "qk"):
        unknown = sorted(set(trainable) - set(PROJECTIONS))
        if not trainable or unknown:
            raise ValueError(f"trainable names the attention projections to train as letters of 'qkvo' "
                             f"(e.g. 'qk'), got {trainable!r}.")
        self.trainable = "".join(letter for letter in "qkvo" if letter in trainable)
        self.students = [module for _, module in attention_modules(model)]
        for module in self.students:
            missing = [name for name in PROJECTIONS.values() if not isinstance(getattr(module, name, None), nn.Linear)]
            if missing:
                raise ValueError(f"Attention transfer needs q_proj, k_proj, v_proj and o_proj linear layers; "
                                 f"{type(module).__name__} has no {', '.join(missing)}.")
        self.teachers = [_frozen_copy(module) for module in self.students]  # kept off the model: never saved
        self.layer_errors: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def to(self, device) -> AttentionTransfer:
        """Move the teachers to ``device`` (the Trainer moves the model alone; the teachers are kept off it)."""
        self.teachers = [teacher.to(device) for teacher in self.teachers]
        return self

    # --- parameters ----------------------------------------------------------------------------------------------

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters that train: the chosen projections of every student attention module, and the base
        family's learned values (a sigmoid's bias, a sink logit, SSMax's scale: they shape the weights the student
        matches; a window's mix is solved in closed form around the stage)."""
        projections = [parameter for module in self.students for letter in self.trainable
                       for parameter in getattr(module, PROJECTIONS[letter]).parameters()]
        return projections + [parameter for module in self.students for parameter in family_values(module).values()]

    def freeze_all_but_trainable(self, model: nn.Module) -> int:
        """Set ``requires_grad`` on the trainable parameters only; returns their number of elements."""
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        trainable = self.trainable_parameters()
        for parameter in trainable:
            parameter.requires_grad_(True)
        return sum(parameter.numel() for parameter in trainable)

    # --- hooks ---------------------------------------------------------------------------------------------------

    @contextmanager
    def teaching(self):
        """Within: every student attention runs beside its teacher, the teacher's output goes on, errors recorded."""
        self.layer_errors = {}
        hooks = [module.register_forward_hook(self._hook(index), with_kwargs=True)
                 for index, module in enumerate(self.students)]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def loss(self) -> torch.Tensor:
        """The mean relative error over layers of the last forward pass inside :meth:`teaching`."""
        if len(self.layer_errors) != len(self.students):
            raise RuntimeError(f"Attention transfer saw {len(self.layer_errors)} of {len(self.students)} attention "
                               "layers in the last forward pass; run the model inside teaching().")
        return torch.stack([self.layer_errors[index] for index in range(len(self.students))]).mean()

    def _hook(self, index: int):
        teacher = self.teachers[index]

        def hook(module, args, kwargs, output):
            with torch.no_grad():
                target = teacher(*args, **_teacher_kwargs(teacher, args, kwargs))[0]  # (B, q, hidden)
            self.layer_errors[index] = (output[0] - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-30)
            return (target,) + tuple(output[1:])

        return hook

    # --- closed-form scale -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def match_scale(self, model: nn.Module, input_ids: torch.Tensor, fold: str = "scores") -> list[torch.Tensor]:
        """Fold the least-squares output scale of every query head into the model (see the module docstring).

        Args:
            model: the patched student (the model these teachers were copied from).
            input_ids: ``(B, N)`` calibration tokens.
            fold: ``"scores"`` (``|gamma|^(1/p)`` into q/k rows, the sign into ``o_proj``; modules whose scores are
                not linear in q and k, and families not homogeneous in the scores (sigmoid, softpick, ...), fall
                back to ``"output"``) or ``"output"`` (``gamma`` into ``o_proj``).

        Returns:
            One ``(H_q,)`` tensor of scales per layer.
        """
        if fold not in SCALE_FOLDS:
            raise ValueError(f"fold must be one of {', '.join(SCALE_FOLDS)}, not {fold!r}.")
        normalization = held_normalization(model)
        if normalization is None or normalization.is_softmax:
            raise ValueError("match_scale needs the student patched with a normalization other than softmax.")
        if normalization.window:
            raise ValueError(f"{normalization.name}: a head scale folded into the scores or the output would change "
                             "the softmax window too; solve the polynomial part's mix instead (match_mix).")
        # x^p/c and relu(x)^p/c are homogeneous of degree p in the scores (a positive factor on q scales the weights
        # by its p-th power); sigmoid, softpick, SSMax, stick-breaking are not: their scale goes into o_proj.
        power = getattr(normalization, "power", None)
        heads = self._head_outputs(model, input_ids)
        scales = []
        for index, (module, teacher) in enumerate(zip(self.students, self.teachers)):
            width = module.o_proj.in_features
            head_dim = width // _query_heads(module)
            energy, overlap = head_inner_products(heads[(index, "student")], heads[(index, "teacher")],
                                                  module.o_proj.weight, teacher.o_proj.weight, head_dim)
            gamma = torch.where(energy > 0, overlap / energy.clamp_min(1e-300), torch.ones_like(energy))
            if not bool(torch.isfinite(gamma).all()):
                raise ValueError(f"Layer {index}: the attention output is not finite on the calibration batch.")
            if fold == "scores" and power is not None and _scores_are_bilinear(module):
                _fold_into_scores(module, gamma, power, head_dim)
            else:
                _scale_o_columns(module, gamma, head_dim)
            scales.append(gamma.float())
        return scales

    @torch.no_grad()
    def match_mix(self, model: nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Solve the mix of a softmax window's polynomial part in closed form and store it in the model's config.

        A normalization with a softmax window (:mod:`hf_knorm.attention.window`) keeps softmax's scale on the last
        ``W`` keys; the polynomial part over the older keys, RMS-normalized per row, gets its size from the mix. Its
        per-head factors ``m`` are the least-squares fit of what the window leaves to explain, jointly over a layer's heads
        (the transfer's loss is the layer's output error, and heads' contributions overlap): with ``u_h`` what head
        ``h``'s part adds to the layer's output at ``m_h = 1`` and ``r`` the teacher's output minus the student's with
        the part off, ``m = argmin ||sum_h m_h u_h - r||^2`` (the ``H x H`` normal equations, summed from per-head
        Gram blocks: :func:`mix_normal_equations`). The projections are untouched, so the window starts as the
        original attention on its keys. Calling it again re-solves it for the current projections (after the transfer
        trained them).

        Args:
            model: the patched student, with a softmax window.
            input_ids: ``(B, N)`` calibration tokens.

        Returns:
            One ``(H_q,)`` float tensor of mixes per layer (also written into the model's mix parameters,
            :mod:`hf_knorm.models.window_mix`).
        """
        from ..models.window_mix import distant_part_off, set_window_mix

        normalization = held_normalization(model)
        if normalization is None or not normalization.window:
            raise ValueError("match_mix needs the student patched with a softmax window (softmax_window=W).")
        set_window_mix(model, None)  # m_h = 1: the part's own size
        full = self._head_outputs(model, input_ids)
        with distant_part_off(model):
            window = self._head_outputs(model, input_ids)
        mixes = []
        for index, (module, teacher) in enumerate(zip(self.students, self.teachers)):
            head_dim = module.o_proj.in_features // _query_heads(module)
            gram, target = mix_normal_equations(window[(index, "student")], full[(index, "student")],
                                                window[(index, "teacher")], module.o_proj.weight,
                                                teacher.o_proj.weight, head_dim)
            mix = _solve_normal_equations(gram, target)
            if not bool(torch.isfinite(mix).all()):
                raise ValueError(f"Layer {index}: the attention output is not finite on the calibration batch.")
            mixes.append(mix.float())
        set_window_mix(model, mixes)
        return mixes

    def _head_outputs(self, model: nn.Module, input_ids: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
        """Every layer's attention output before ``o_proj``, ``(B, q, H_q * D)``, of the student and the teacher on
        ``input_ids``, by ``(layer, "student" | "teacher")``; each layer sees the original model's inputs."""
        heads: dict[tuple[int, str], torch.Tensor] = {}

        def record(index: int, who: str):
            def hook(module, args):
                heads[(index, who)] = args[0]  # (B, q, H_q * D): the attention output before o_proj
            return hook

        pairs = [(index, who, module.o_proj) for index, (student, teacher) in enumerate(zip(self.students, self.teachers))
                 for who, module in (("student", student), ("teacher", teacher))]
        hooks = [o_proj.register_forward_pre_hook(record(index, who)) for index, who, o_proj in pairs]
        try:
            with self.teaching():
                model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        finally:
            for hook in hooks:
                hook.remove()
        return heads

    # --- measurement ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def errors_by_layer_and_position(self, model: nn.Module, blocks: list[torch.Tensor], buckets: int = 8) -> dict:
        """The relative error of every layer on ``blocks``, overall and per position bucket.

        Args:
            model: the patched student.
            blocks: ``(N,)`` token-id tensors of one length.
            buckets: how many equal ranges of positions to report.

        Returns:
            ``{"layers": [e_0, ...], "positions": [[start, stop), ...], "by_position": [[e per bucket] per layer]}``.
        """
        squared = {}

        def hook_of(index: int):
            teacher = self.teachers[index]

            def hook(module, args, kwargs, output):
                target = teacher(*args, **_teacher_kwargs(teacher, args, kwargs))[0]  # (B, q, hidden)
                error = (output[0] - target).pow(2).double().sum(dim=(0, 2))  # (q,)
                energy = target.pow(2).double().sum(dim=(0, 2))
                totals = squared.setdefault(index, [0, 0])
                totals[0], totals[1] = totals[0] + error, totals[1] + energy
                return (target,) + tuple(output[1:])

            return hook

        hooks = [module.register_forward_hook(hook_of(index), with_kwargs=True)
                 for index, module in enumerate(self.students)]
        was_training = model.training
        model.eval()
        try:
            device = next(model.parameters()).device
            for ids in blocks:
                model(input_ids=ids.to(device)[None], use_cache=False, logits_to_keep=1)
        finally:
            for hook in hooks:
                hook.remove()
            model.train(was_training)
        length = blocks[0].shape[0]
        edges = [round(length * b / buckets) for b in range(buckets + 1)]
        layers, by_position = [], []
        for index in range(len(self.students)):
            error, energy = squared[index]
            layers.append(float(error.sum() / energy.sum()))
            by_position.append([float(error[a:b].sum() / energy[a:b].sum()) for a, b in zip(edges, edges[1:])])
        return {"layers": layers, "positions": [[a, b] for a, b in zip(edges, edges[1:])], "by_position": by_position}


TOKEN_BLOCK = 1024
"""Tokens per step of the closed forms' sums over the calibration tokens (:func:`head_inner_products`,
:func:`mix_normal_equations`): their float64 temporaries are a block's, whatever the number of tokens."""


def head_inner_products(student: torch.Tensor, teacher: torch.Tensor, o_weight: torch.Tensor,
                        teacher_o_weight: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(<c_s,h, c_s,h>, <c_s,h, c_t,h>)`` per query head, ``(H,)`` each in float64, of the heads' contributions to
    the attention output ``c_h = o_h W_h^T`` (:meth:`AttentionTransfer.match_scale`), summed over the tokens.

    From per-head Gram blocks: ``<c_s,h, c_t,h> = <W_h^T W_t,h, sum_t o_s,h o_t,h^T>_F``, the ``(H, D, D)`` blocks of
    the weights' and of the outputs' inner products (the outputs summed over blocks of :data:`TOKEN_BLOCK`
    tokens), never a ``(tokens, H, hidden)`` tensor.

    Args:
        student, teacher: the attention outputs before ``o_proj``, ``(B, q, H * D)``.
        o_weight, teacher_o_weight: their ``o_proj`` weights ``(hidden, H * D)``.
        head_dim: ``D``.
    """
    width = o_weight.shape[1]
    heads = width // head_dim
    weight = o_weight.double().view(-1, heads, head_dim)  # (hidden, H, D)
    teacher_weight = teacher_o_weight.double().view(-1, heads, head_dim)
    own = weight.new_zeros(heads, head_dim, head_dim)  # sum_t o_s,h o_s,h^T
    cross = weight.new_zeros(heads, head_dim, head_dim)  # sum_t o_s,h o_t,h^T
    rows = [outputs.reshape(-1, width) for outputs in (student, teacher)]
    for start in range(0, rows[0].shape[0], TOKEN_BLOCK):
        mine, theirs = (outputs[start:start + TOKEN_BLOCK].double().view(-1, heads, head_dim)
                        for outputs in rows)
        own += torch.einsum("thi,thj->hij", mine, mine)
        cross += torch.einsum("thi,thj->hij", mine, theirs)
    energy = (torch.einsum("ohi,ohj->hij", weight, weight) * own).sum(dim=(1, 2))
    overlap = (torch.einsum("ohi,ohj->hij", weight, teacher_weight) * cross).sum(dim=(1, 2))
    return energy, overlap


def mix_normal_equations(window: torch.Tensor, full: torch.Tensor, teacher_window: torch.Tensor,
                         o_weight: torch.Tensor, teacher_o_weight: torch.Tensor, head_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The normal equations of the mix's least squares (:meth:`AttentionTransfer.match_mix`), in float64.

    With ``d_h`` what head ``h``'s polynomial part adds to its output at ``m_h = 1`` (``full - window``), ``W_h`` the
    ``o_proj`` columns of head ``h`` and ``r`` the teacher's attention output minus the student's with the part off
    (``teacher_window W_t^T - window W^T``, hidden-sized), over the tokens ``t``::

        gram[h, g] = sum_t <W_h d_h(t), W_g d_g(t)> = <W_h^T W_g, sum_t d_h(t) d_g(t)^T>_F
        target[h]  = sum_t <d_h(t), W_h^T r(t)>

    The per-head Gram blocks ``W_h^T W_g`` are the ``(H*D, H*D)`` matrix ``W^T W``; the inner products of the heads'
    parts are summed over blocks of :data:`TOKEN_BLOCK` tokens. Memory: two ``(H*D, H*D)`` matrices and one
    block's ``(tokens, hidden)``, never a ``(tokens, H, hidden)`` tensor.

    Args:
        window, full: the student's attention output before ``o_proj``, ``(B, q, H * D)``, with the polynomial part
            off and at ``m = 1``.
        teacher_window: the teacher's, ``(B, q, H * D)``.
        o_weight, teacher_o_weight: ``(hidden, H * D)``, the student's and the teacher's ``o_proj`` weights.
        head_dim: ``D``.

    Returns:
        ``(gram (H, H), target (H,))``.
    """
    width = o_weight.shape[1]
    heads = width // head_dim
    weight, teacher_weight = o_weight.double(), teacher_o_weight.double()
    moments = weight.new_zeros(width, width)  # sum_t d(t) d(t)^T: block (h, g) is sum_t d_h d_g^T
    target = weight.new_zeros(heads)
    rows = [outputs.reshape(-1, width) for outputs in (window, full, teacher_window)]
    for start in range(0, rows[0].shape[0], TOKEN_BLOCK):
        alone, on, teacher = (outputs[start:start + TOKEN_BLOCK].double() for outputs in rows)
        part = on - alone  # (tokens, H * D)
        moments += part.T @ part
        residual = teacher @ teacher_weight.T - alone @ weight.T  # (tokens, hidden)
        target += (part * (residual @ weight)).view(-1, heads, head_dim).sum(dim=(0, 2))
    blocks = weight.T @ weight  # (H * D, H * D): block (h, g) is W_h^T W_g
    gram = (blocks * moments).view(heads, head_dim, heads, head_dim).sum(dim=(1, 3))
    return gram, target


def _solve_normal_equations(gram: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``m`` with ``gram m = target`` (least squares, float64) over the heads whose part is not zero; the others
    get 0."""
    live = gram.diagonal() > 0
    mix = torch.zeros_like(target)
    if bool(live.any()):
        chosen = gram[live][:, live]
        mix[live] = torch.linalg.lstsq(chosen, target[live][:, None]).solution[:, 0]
    return mix


def _scale_o_columns(module: nn.Module, per_head: torch.Tensor, head_dim: int) -> None:
    """Multiply the ``o_proj`` columns of query head ``h`` by ``per_head[h]``."""
    weight = module.o_proj.weight
    weight.mul_(per_head.repeat_interleave(head_dim).to(weight.dtype)[None, :])


def _scale_rows(linear: nn.Linear, per_head: torch.Tensor, head_dim: int) -> None:
    """Multiply the output rows (and bias) of head ``h`` of a q/k projection by ``per_head[h]``."""
    factor = per_head.repeat_interleave(head_dim).to(linear.weight.dtype)
    linear.weight.mul_(factor[:, None])
    if linear.bias is not None:
        linear.bias.mul_(factor)


def _fold_into_scores(module: nn.Module, gamma: torch.Tensor, power: int, head_dim: int) -> None:
    """Scale head ``h``'s weights ``s^p/c`` by ``gamma[h]`` through its scores: ``|gamma|^(1/p)`` split between q
    and k, the sign into ``o_proj``.

    Args:
        module: a patched attention module (``q_proj``: ``H_q * D`` rows, ``k_proj``: ``H_kv * D`` rows).
        gamma: ``(H_q,)`` float64 scales.
        power: the normalization's ``p``.
        head_dim: ``D``.
    """
    query_heads = gamma.shape[0]
    kv_heads = module.k_proj.out_features // head_dim
    magnitude = gamma.abs().clamp_min(1e-12).pow(1.0 / power)  # (H_q,): the score factor of each query head
    log_magnitude = magnitude.log().reshape(kv_heads, query_heads // kv_heads)
    key = (log_magnitude.mean(dim=1) / 2).exp()  # (H_kv,): half of the group's geometric mean, on the keys
    query = magnitude / key.repeat_interleave(query_heads // kv_heads)  # (H_q,): the rest, head by head
    _scale_rows(module.q_proj, query, head_dim)
    _scale_rows(module.k_proj, key, head_dim)
    _scale_o_columns(module, torch.where(gamma < 0, -1.0, 1.0).to(gamma.dtype), head_dim)


def _scores_are_bilinear(module: nn.Module) -> bool:
    """Whether the module's scores are ``scaling * q . k`` of its q/k projections (no q/k norm, no softcap)."""
    normed = any(isinstance(getattr(module, name, None), nn.Module) for name in ("q_norm", "k_norm"))
    softcap = getattr(module.config, "attn_logit_softcapping", None)
    return not normed and softcap is None


def _teacher_kwargs(teacher: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The student's call arguments as the teacher takes them: no cache, and the plugin's key-padding mask made
    explicit (the teacher attends with the original implementation, e.g. SDPA, which reads a 2-D mask otherwise)."""
    kwargs = {name: value for name, value in kwargs.items() if name not in CACHE_ARGUMENTS}
    if kwargs.get("attention_mask") is not None:
        hidden = args[0] if args else kwargs["hidden_states"]
        kwargs["attention_mask"] = explicit_mask(kwargs["attention_mask"], hidden.shape[1],
                                                 getattr(teacher, "is_causal", True))
    return kwargs


def _frozen_copy(module: nn.Module) -> nn.Module:
    """A frozen deep copy of an attention module that keeps the model's current attention implementation."""
    teacher = copy.deepcopy(module)
    teacher.config = copy.deepcopy(module.config)  # its own config: patching the student's leaves it alone
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    return teacher.eval()


def _query_heads(module: nn.Module) -> int:
    config = module.config
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"{type(module).__name__}: the config has no num_attention_heads.")
    return heads

"""The normalization's learned values trained in both stages of a conversion, and checkpointed beside LoRA's adapters.

A patched model keeps its normalization's learned values (a sigmoid's bias, a sink logit, SSMax's scale, the softmax
window's mix) as ``hf_knorm_*`` parameters of its attention modules (:mod:`hf_knorm.models.parameters`), beside the
cluster codebook, which is fitted, never trained. The base family's values (:func:`family_values`) train wherever the
attention does: the transfer trains them with the projections (they shape the weights it matches), the recovery with
LoRA's adapters (LoRA would freeze them with the rest of the base model). The window's mix is solved in closed form
around the transfer and trains in the recovery only with window dropout (a dropped step computes the base family
times the mix, :mod:`hf_knorm.attention.window_off`, and the mix the transfer solved is ~0 where the window does the
work). PEFT's checkpoints hold the adapters alone: :class:`LearnedValuesCheckpoint` writes the learned values into
each checkpoint beside them, and :func:`restore_learned_values` reads them back when the run resumes, so a resumed
run continues the one interrupted. ``merge_and_unload`` leaves them in the merged model, which saves them with its
weights.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn
from transformers import TrainerCallback

from ..normalizations.base import PARAMETER_PREFIX
from ..normalizations.windowed import CODEBOOK, MIX

FILE = "hf_knorm_learned_values.safetensors"
"""The learned values in a checkpoint folder, by their names in the (PEFT-wrapped) model."""


def learned_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's ``hf_knorm_*`` parameters by name (``...self_attn.hf_knorm_window_mix``), in model order."""
    return {name: parameter for name, parameter in model.named_parameters(remove_duplicate=False)
            if name.rsplit(".", 1)[-1].startswith(PARAMETER_PREFIX)}


def is_family_value(name: str) -> bool:
    """Whether a parameter's name (``...self_attn.hf_knorm_bias``) is one of the base family's learned values (a
    sigmoid's bias, a sink logit, SSMax's scale): an ``hf_knorm_*`` parameter but the window's mix and the codebook."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith(PARAMETER_PREFIX) and last not in (PARAMETER_PREFIX + MIX, PARAMETER_PREFIX + CODEBOOK)


def family_values(model: nn.Module) -> dict[str, nn.Parameter]:
    """The base family's learned values of ``model`` by name (:func:`is_family_value`)."""
    return {name: parameter for name, parameter in learned_parameters(model).items() if is_family_value(name)}


def train_learned_values(model: nn.Module, mix: bool) -> int:
    """Mark the base family's learned values of ``model`` trainable, and with ``mix`` the window's mix (never the
    cluster codebook); returns how many parameters that marks (0: nothing to train)."""
    marked = [parameter for name, parameter in learned_parameters(model).items()
              if is_family_value(name) or (mix and name.rsplit(".", 1)[-1] == PARAMETER_PREFIX + MIX)]
    for parameter in marked:
        parameter.requires_grad_(True)
    return len(marked)


class LearnedValuesCheckpoint(TrainerCallback):
    """Write the model's learned values into each checkpoint folder the Trainer saves (:data:`FILE`)."""

    def on_save(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        from safetensors.torch import save_file

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        values = {name: parameter.detach().cpu().contiguous() for name, parameter in learned_parameters(model).items()}
        temporary = folder / (FILE + ".tmp")
        save_file(values, str(temporary))
        temporary.replace(folder / FILE)  # a crash mid-write leaves no half file under the real name


def restore_learned_values(model: nn.Module, checkpoint: str | Path) -> None:
    """Copy the learned values :class:`LearnedValuesCheckpoint` saved in ``checkpoint`` into ``model``.

    Raises:
        FileNotFoundError: the checkpoint holds no learned values (saved by a run that did not train them).
        ValueError: they do not name the model's learned values.
    """
    import torch
    from safetensors.torch import load_file

    path = Path(checkpoint) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint was saved without the learned values this run "
                                "trains (an older hf_knorm, or other settings). Start the conversion again in a new "
                                "--out.")
    saved, parameters = load_file(str(path)), learned_parameters(model)
    if set(saved) != set(parameters):
        raise ValueError(f"{path} holds {sorted(saved)}, the model learns {sorted(parameters)}: not this run's "
                         "checkpoint.")
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(saved[name].to(parameter))

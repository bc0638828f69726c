"""FSDP (fully sharded data parallel) in the training jobs: where it is refused, and the save that gathers the shards.

FSDP comes from an accelerate config (``accelerate launch --config_file configs/accelerate_fsdp.yaml``), which sets
``ACCELERATE_USE_FSDP=true`` for every process; the Trainer then shards the model through accelerate (FSDP2,
``fully_shard``). Two things the jobs add:

- **Refusals, before any model loads.** On a machine without an accelerator, accelerate (1.x, ``AcceleratorState``)
  turns FSDP on only for accelerator process groups (multi-GPU, XPU, NPU, ...): with ``use_cpu`` the processes form a
  ``MULTI_CPU`` group and the FSDP config is ignored, so the run would silently be plain DDP, every process holding the
  whole model. ``convert`` refuses FSDP everywhere: its attention-transfer teachers are frozen copies beside each
  layer, driven by hooks that read whole modules, and its recovery distils from a second full model.
- **The save.** Under FSDP each process holds a shard; the model saved with its card is the full state dict, gathered
  through ``accelerator.get_state_dict`` (a collective: every process calls it; Transformers' ``Trainer.save_model``
  does the same).
"""

from __future__ import annotations

import os

from .precision import has_accelerator


def fsdp_requested() -> bool:
    """Whether this process was launched with an FSDP accelerate config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_fsdp(job: str, supported: bool) -> None:
    """Refuse FSDP where it cannot run as asked (see the module docstring).

    Raises:
        ValueError: FSDP requested by ``job``, which does not support it, or on a machine without an accelerator.
    """
    if not fsdp_requested():
        return
    if not supported:
        raise ValueError(
            f"{job} does not run under FSDP (its attention-transfer teachers and distillation need whole modules). "
            "Launch it with data parallelism instead: torchrun, or accelerate launch --config_file "
            "configs/accelerate_cpu.yaml (on GPUs too; DDP keeps one full copy of the model per process).")
    if not has_accelerator():
        raise ValueError(
            f"{job}: FSDP was requested (ACCELERATE_USE_FSDP=true, an accelerate config with distributed_type FSDP), "
            "but this machine has no accelerator. accelerate enables FSDP only in GPU/XPU/NPU process groups; on the "
            "CPU the run would silently train with plain DDP instead. Here, launch with configs/accelerate_cpu.yaml; "
            "on GPUs, configs/accelerate_fsdp.yaml with --num_processes set to the GPU count.")


def gathered_state_dict(trainer) -> dict | None:
    """The full state dict of an FSDP-sharded model (every process must call this), or ``None`` without FSDP (the
    model's own parameters are whole then)."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    return trainer.accelerator.get_state_dict(trainer.model)

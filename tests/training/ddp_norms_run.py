"""Train the tiny llama for 3 steps with NormLoggerCallback, once per normalization; test_training_distributed.py
runs it under ``torchrun --standalone --nproc_per_node 2`` (gloo on CPU) and calls :func:`train` in-process.

Usage: ``ddp_norms_run.py OUT PER_DEVICE_BATCH NORMALIZATION [NORMALIZATION ...]`` (``native``: not patched); run
``i`` writes ``OUT/<i>/norms.jsonl``. Sequential sampling: with 2 processes of batch 2, step ``s`` sees examples
``4(s-1) .. 4s-1`` split between the ranks, the same global batch as one process of batch 4.
"""

import os
import sys

import torch.distributed as dist
import transformers as tf
from training_helpers import args, lm, lm_data

import hf_knorm


def train(out, batch: int, normalization: str) -> tf.Trainer:
    model = lm(None if normalization == "native" else normalization)
    trainer = tf.Trainer(
        model=model,
        args=args(out, max_steps=3, logging_steps=1, per_device_train_batch_size=batch,
                  train_sampling_strategy="sequential", ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None),
        train_dataset=lm_data(count=16),
        callbacks=[hf_knorm.NormLoggerCallback()],
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    out, batch = sys.argv[1], int(sys.argv[2])
    for index, normalization in enumerate(sys.argv[3:]):
        trainer = train(f"{out}/{index}", batch, normalization)
        print(f"{normalization}: rank {trainer.args.process_index} of {trainer.args.world_size}: done")
    if dist.is_initialized():
        dist.destroy_process_group()
    # Every file is written and flushed by now. Skip the interpreter's teardown: gloo's worker threads still abort
    # it now and then ("terminate called without an active exception", SIGABRT after both ranks printed "done"; seen
    # about once in 20 runs even with the group destroyed, pytorch/pytorch#190489 and #179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

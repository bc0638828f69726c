"""What longer training blocks cost the default conversion's recovery: a forward and backward of the default model
patched with ``x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff)``, 1,024 tokens a step as 4 x 256,
2 x 512 and 1 x 1,024, with its 600 clusters (fitted on the essays as ``convert`` fits them) and without: the median
of 3 steps each (docs/results/conversion.md, 'Training blocks longer than the cache').

Usage: ``OMP_NUM_THREADS=2 python research/2026-12/train_block_cost.py`` (2 quiet cores; ~3 minutes)
"""

import contextlib
import time
from pathlib import Path

import torch

import hf_knorm
from hf_knorm.assets.default_model import load_default_model
from hf_knorm.conversion.clusters import add_clusters
from hf_knorm.models.cluster_codebook import clusters_off

torch.manual_seed(0)
model, tokenizer = load_default_model()
hf_knorm.patch(model, "x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff)")
add_clusters(model, tokenizer, 600)
model.train()
text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
ids = tokenizer(text * 4, return_tensors="pt").input_ids[:, :1024]
for clustered in (False, True):
    with contextlib.nullcontext() if clustered else clusters_off(model):
        for batch, length in ((4, 256), (2, 512), (1, 1024)):
            inputs, times = ids[:, :length].repeat(batch, 1), []
            for _ in range(3):
                start = time.perf_counter()
                model(inputs, labels=inputs).loss.backward()
                times.append(time.perf_counter() - start)
                model.zero_grad()
            print(f"clusters={clustered} {batch}x{length}: {sorted(times)[1]:.2f} s", flush=True)

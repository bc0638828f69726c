"""Two processes (torchrun, gloo on CPU) log the same norms as one process holding the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_norms_run import train
from training_helpers import history_lines

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NORMALIZATIONS = ("native", "x^3/16")  # not patched (read through hf_knorm's softmax), and patched


def test_two_processes_agree_with_one_on_the_same_global_batch(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "ddp_norms_run.py"), str(tmp_path / "two"), "2", *NORMALIZATIONS]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for index, normalization in enumerate(NORMALIZATIONS):
        assert f"{normalization}: rank 0 of 2: done" in result.stdout
        assert f"{normalization}: rank 1 of 2: done" in result.stdout
        train(tmp_path / "one" / str(index), 4, normalization)
        two = history_lines(tmp_path / "two" / str(index) / "norms.jsonl")
        one = history_lines(tmp_path / "one" / str(index) / "norms.jsonl")
        assert [line["step"] for line in two] == [1, 2, 3]  # written once, by rank 0
        assert [line["step"] for line in one] == [1, 2, 3]
        for a, b in zip(two, one):
            for layer_two, layer_one in zip(a["layers"], b["layers"]):
                assert layer_two == pytest.approx(layer_one, rel=1e-4), normalization

"""``make device-check`` runs on a machine without a GPU: its attention part, small, prints its rows."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_check_runs_on_the_cpu_and_says_what_it_skips():
    result = subprocess.run([sys.executable, "scripts/device_check.py", "--skip-tests", "--skip-conversion",
                             "--skip-compile", "--lengths", "128"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| attention N=128")]
    assert len(rows) == 3 and all("x SDPA)" in row for row in rows)
    if "no CUDA device" in result.stdout:
        assert "bf16, flash and peak memory skipped" in result.stdout
        assert "| FSDP finetune | skipped: accelerate runs FSDP on accelerators only" in result.stdout

"""``scripts/conversion_normalizations.py --report`` gathers finished conversions into one row per normalization."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fake_run(folder: Path, rate: float, worst: float, grad_norms: list[list[float]]) -> None:
    """A finished run's ``convert.json``, only the fields the report reads."""
    folder.mkdir(parents=True)
    summary = {"settings": {"recovery_learning_rate": rate}, "seconds": 600.0, "probe": {"agreement": 0.125},
               "evaluation": {"ratio_to_original": worst, "domains": {
                   "essays": {"perplexity": 70.0, "ratio_to_original": 2.0},
                   "conversation": {"perplexity": 140.0, "ratio_to_original": worst}}},
               "stages": {"recovery": {"grad_norms": grad_norms}}}
    (folder / "convert.json").write_text(json.dumps(summary))


def test_one_row_per_finished_normalization_with_its_rate_and_late_spikes(tmp_path):
    fake_run(tmp_path / "x_1", 1e-3, 15.3, [[10, 15.1], [100, 21.6], [110, 5.5]])
    fake_run(tmp_path / "x3_16", 5e-4, 16.0, [[10, 31.0], [150, 301.0]])
    (tmp_path / "x_16").mkdir()  # unfinished: no convert.json, no row
    result = subprocess.run([sys.executable, "scripts/conversion_normalizations.py", "--out", str(tmp_path),
                             "--normalizations", "x/1,x/16,x^3/16", "--report"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("| `")]
    assert lines == [
        "| `x/1` | 0.001 | 70 (2.00x) | 140 (15.30x) | 15.30x | 12.5% | 21.6 / 5.5 | 10.0 |",
        "| `x^3/16` | 0.0005 | 70 (2.00x) | 140 (16.00x) | 16.00x | 12.5% | 31 / 301 | 10.0 |",
    ]
    saved = json.loads((tmp_path / "normalizations.json").read_text())
    assert [row["normalization"] for row in saved["runs"]] == ["x/1", "x^3/16"]

"""``scripts/conversion_budget.py --report`` gathers finished conversions into one row per budget, with each run's
worst held-out domain at every evaluation of its recovery."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fake_run(folder: Path, steps: int, conversation: list[float]) -> None:
    """A finished run's ``convert.json``, only the fields the report reads; evaluations every 50 steps."""
    folder.mkdir(parents=True)
    essays = [100.0] * len(conversation)
    curve = lambda values: [[50 * i, 50 * i * 1024, value] for i, value in enumerate(values)]  # noqa: E731
    summary = {"seconds": 60.0 * steps / 5, "probe": {"agreement": 0.15},
               "evaluation": {"ratio_to_original": conversation[-1] / 10.0, "domains": {
                   "essays": {"perplexity": essays[-1], "original_perplexity": 50.0, "ratio_to_original": 2.0},
                   "conversation": {"perplexity": conversation[-1], "original_perplexity": 10.0,
                                    "ratio_to_original": conversation[-1] / 10.0}}},
               "stages": {"recovery": {"steps": steps, "tokens": steps * 1024, "grad_norms": [],
                                       "curves": {"essays": curve(essays), "conversation": curve(conversation)}}}}
    (folder / "convert.json").write_text(json.dumps(summary))


def test_one_row_per_finished_budget_and_the_worst_domain_over_each_recovery(tmp_path):
    fake_run(tmp_path / "budget1", 150, [1000.0, 300.0, 150.0, 120.0])
    fake_run(tmp_path / "budget2", 300, [1000.0, 400.0, 200.0, 150.0, 110.0, 95.0, 90.0])
    (tmp_path / "budget4").mkdir()  # unfinished: no convert.json, no row
    result = subprocess.run([sys.executable, "scripts/conversion_budget.py", "--out", str(tmp_path),
                             "--budgets", "1,2,4", "--report"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert lines == ["| 1 | 150 (153,600) | 30.0 | 100 (2.00x) | 120 (12.00x) | 12.00x | 15.0% |",
                     "| 2 | 300 (307,200) | 60.0 | 100 (2.00x) | 90 (9.00x) | 9.00x | 15.0% |"]
    assert ("- budget 2, worst domain at each recovery evaluation: 0: 100x, 50: 40x, 100: 20x, 150: 15x, 200: 11x, "
            "250: 9.5x, 300: 9x") in result.stdout
    saved = json.loads((tmp_path / "budget.json").read_text())
    assert [row["budget"] for row in saved["runs"]] == [1.0, 2.0]


def test_a_budget_that_is_not_positive_is_refused(tmp_path):
    result = subprocess.run([sys.executable, "scripts/conversion_budget.py", "--out", str(tmp_path), "--budgets",
                             "1,0", "--report"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--budgets must be positive numbers" in result.stderr

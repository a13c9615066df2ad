"""`conceptlens` command line: one subcommand per module in `conceptlens.commands`.

    conceptlens demo                    # the main job on the embedded defaults
    conceptlens sites --model smollm2-135m
    conceptlens fit run.toml            # or --model M --data D --site S --extractor "topk:width=4608,k=32"
    conceptlens describe runs/x
    conceptlens steer --model smollm2-135m --concepts DIR --concept 12 --alpha 8 --prompt "..."

Exit codes: 0 done; 2 the command could not run as asked (a bad option or file, a missing or
unwritable path, a full disk, too little memory), said in one line on stderr; 1 a bug, with its
traceback; 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from typing import NoReturn

from conceptlens.commands._common import add_runtime_arguments, apply_runtime

# subcommand -> module in conceptlens.commands exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "demo": "Load SmolLM2, fit concepts on a bundled corpus, steer with one; all offline.",
    "sites": "List the sites of a model with their shapes.",
    "steer": "Continue a prompt without and with a concept (or word) direction added, side by side.",
    "gauge": "Gauge-invariant q/k geometry of one layer, streamed, then a gauge audit of the metrics.",
    "report": "Write the static concept atlas (index, one page per concept, matches) of a run folder.",
    "eval": "The evaluation suite: reconstruction, k-sparse probing and absorption, next to baselines with 95% intervals.",
    "fit": "Stream-fit named concept extractors at sites into a run folder (TOML config or flags), then describe them.",
    "describe": "Description pass of a run folder: top contexts, histograms, neighbours, tokens, probes per concept.",
    "sweep": "Dose-response of steering: a target score and fluency (perplexity) for each alpha.",
    "ablate": "Ablate chosen concepts on held-out text against matched controls, with the task's baseline.",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`conceptlens CMD: error: ...`, exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="conceptlens", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, help_text in COMMANDS.items():
        command = sub.add_parser(name, help=help_text.replace("%", "%%"), description=help_text)  # help is %-formatted
        importlib.import_module(f"conceptlens.commands.{name}").add_arguments(command)
        add_runtime_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error, already reported in one line (2)
        return done.code if isinstance(done.code, int) else 2
    module = importlib.import_module(f"conceptlens.commands.{args.command}")
    with warnings.catch_warnings():  # a warning is one line too, until the command returns
        warnings.showwarning = lambda message, *_, **__: print(
            f"conceptlens {args.command}: warning: {_one_line(str(message))}", file=sys.stderr)
        return _run(module, args)


def _run(module: object, args: argparse.Namespace) -> int:
    """Run the command; a user's mistake or the system's refusal (missing file, full disk, too
    little memory) is one line on stderr and exit code 2; a bug keeps its traceback (exit 1)."""
    try:
        apply_runtime(args)  # threads, logging, device and model names: checked before any loading
        return int(module.run(args) or 0)  # type: ignore[attr-defined]
    except KeyboardInterrupt as stop:  # a fit or describe says where its checkpoint stands
        print(f"interrupted: {stop}" if str(stop) else "interrupted", file=sys.stderr)
        return 130
    except (KeyError, ValueError, OSError, ModuleNotFoundError, MemoryError) as err:  # bugs keep their traceback
        print(f"conceptlens {args.command}: error: {_one_line(_message(err))}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        distributed = sys.modules.get("conceptlens.distributed")
        if distributed is not None and isinstance(err, distributed.DistributedError):
            # a distributed fit's ranks disagree, one died or never joined: one line
            print(f"conceptlens {args.command}: error: {_one_line(str(err))}", file=sys.stderr)
            return 1
        if not _out_of_memory(err):
            raise
        # torch's allocator refusing a size: one line, not a traceback
        print(f"conceptlens {args.command}: error: out of memory: {_one_line(str(err))[:300]}", file=sys.stderr)
        return 2
    finally:
        if "conceptlens.distributed" in sys.modules:  # a distributed fit ran in this process
            sys.modules["conceptlens.distributed"].shutdown()


def _message(err: BaseException) -> str:
    """What went wrong, for one line: an OSError names its file and cause (disk full, permission)."""
    if isinstance(err, KeyError) and err.args:
        return str(err.args[0])
    if isinstance(err, OSError) and err.strerror:
        files = " -> ".join(repr(str(f)) for f in (err.filename, err.filename2) if f is not None)
        return f"{files}: {err.strerror}" if files else err.strerror
    return str(err) or type(err).__name__


def _out_of_memory(err: RuntimeError) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def _one_line(message: str) -> str:
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())

"""`conceptlens` command line: one subcommand per module in `conceptlens.commands`.

    conceptlens demo                    # the main job on the embedded defaults
    conceptlens sites --model smollm2-135m
    conceptlens fit run.toml            # or --model M --data D --site S --extractor "topk:width=4608,k=32"
    conceptlens describe runs/x
    conceptlens steer --model smollm2-135m --concepts DIR --concept 12 --alpha 8 --prompt "..."
"""

from __future__ import annotations

import argparse
import importlib
import sys
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
        command = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"conceptlens.commands.{name}").add_arguments(command)
        add_runtime_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error, already reported in one line (2)
        return done.code if isinstance(done.code, int) else 2
    module = importlib.import_module(f"conceptlens.commands.{args.command}")
    try:
        apply_runtime(args)  # threads, logging, device and model names: checked before any loading
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (KeyError, ValueError, OSError, ModuleNotFoundError) as err:  # user errors; bugs keep their traceback
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"conceptlens {args.command}: error: {_one_line(str(message))}", file=sys.stderr)
        return 2
    finally:
        if "conceptlens.distributed" in sys.modules:  # a distributed fit ran in this process
            sys.modules["conceptlens.distributed"].shutdown()


def _one_line(message: str) -> str:
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())

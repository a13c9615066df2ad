"""`conceptlens report RUN`: write the static concept atlas of a run folder to RUN/report/.

    conceptlens report runs/demo            # then open runs/demo/report/index.html
"""

from __future__ import annotations

import argparse

from conceptlens.commands._args import out_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder written by `conceptlens fit` (holds concepts/ and describe/)")
    parser.add_argument("--out", type=out_dir, default=None, help="report folder: new, empty or an earlier report (default RUN/report)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from conceptlens.report import write_report

    summary = write_report(args.run, args.out, progress=not args.no_progress)
    print(f"report: {summary.pages:,} pages, {summary.bytes / 1e6:.1f} MB in {summary.seconds:.1f} s\n"
          f"open {summary.path.resolve().as_uri()}")  # percent-encoded: a space or # in the path stays a path
    return 0

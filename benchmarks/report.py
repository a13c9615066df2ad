"""Time `conceptlens report` on a run folder with 4096 concepts (and its size on disk).

    python benchmarks/report.py [--concepts 4096] [--extractors 1] [--top-n 16] [--d 576] [--threads 2]

The run folder is written in the atlas layout from random data (tests/report/atlas_fixture.py):
per concept 16 contexts of 13 tokens, a 32-bin histogram, 8 nearest concepts by direction and
by co-activation, 10 promoted / suppressed tokens, probe losses on 5 classes. With several
extractors at one site the matches page runs a Hungarian matching per pair. Target: under
a minute for 4096 concepts on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conceptlens.report import write_report  # noqa: E402
from tests.report.atlas_fixture import write_fake_run  # noqa: E402

METHODS = [("topk", "topk-sae"), ("deleuzian", "deleuzian"), ("kmeans", "kmeans")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concepts", type=int, default=4096, help="concepts per extractor")
    parser.add_argument("--extractors", type=int, default=1, choices=[1, 2, 3])
    parser.add_argument("--top-n", type=int, default=16)
    parser.add_argument("--d", type=int, default=576)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run = write_fake_run(Path(tmp) / "run", [(n, m, args.concepts) for n, m in METHODS[:args.extractors]],
                             d=args.d, top_n=args.top_n, bins=32, hierarchy="topk")
        print(f"fixture: {args.extractors} x {args.concepts} concepts written in {time.perf_counter() - start:.1f} s")
        cpu = time.process_time()
        summary = write_report(run)
        cpu = time.process_time() - cpu
        per_page = summary.bytes / summary.pages
        print(f"report: {summary.seconds:.1f} s wall ({cpu:.1f} s CPU) for {args.extractors * args.concepts} concepts, {summary.pages} pages, "
              f"{summary.bytes / 1e6:.1f} MB ({per_page / 1e3:.1f} kB per page); "
              f"atlas-data.js {(summary.path.parent / 'static' / 'atlas-data.js').stat().st_size / 1e6:.2f} MB, "
              f"index.html {summary.path.stat().st_size / 1e3:.1f} kB")


if __name__ == "__main__":
    main()

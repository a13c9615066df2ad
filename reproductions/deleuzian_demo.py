"""Claim (Deleuzian, 000; issue 23): Deleuzian's probe loss below the SAE's, checked in the demo's
own setting, and the streaming mode (what `fit` and the demo use) against the paper mode there.

    python reproductions/deleuzian_demo.py              # seed 0; 37 min under load 20-25 (28 reading activations, then cached)
    python reproductions/deleuzian_demo.py 0 1 2        # seeds (the demo's --seed: document order and extractors)

The demo's setting (`conceptlens demo` defaults): SmolLM2 block 15; the fit reads the first 40k
tokens of bbc-news train in the seeded order, as `fit` feeds them (the rows its filters keep);
Deleuzian and k-means 128 concepts, TopK SAE width 1024, k 32, with the demo's batch, buffer and
learning rate (`commands.demo.run_config`). The description pass reads 30k tokens of bbc-news
test; per topic, the test log-loss of the best single concept's 1-D probe on document-mean
activations (even documents train, odd test: `describe.finish.class_probes`, what the demo's
quality table shows), next to the best of as many random directions. The token rows of both
passes are cached, so the extractors are fitted here on exactly the rows the demo's are.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from _common import Clock, cached, report, threads

SITE = "blocks.15.resid_out"


class Rows:
    """An extractor that keeps what fit feeds it: the rows and their documents."""

    def __init__(self) -> None:
        self.x: list[torch.Tensor] = []
        self.doc: list[torch.Tensor] = []

    def update(self, x: torch.Tensor, *, tokens: Any) -> None:
        self.x.append(x.float().cpu())
        self.doc.append(tokens.doc.cpu())


def demo_args(seed: int) -> argparse.Namespace:
    from conceptlens.commands import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(["--seed", str(seed), "--no-progress"])


@torch.no_grad()
def passes(seed: int) -> dict[str, torch.Tensor]:
    """The fit pass's rows (in stream order) and the description pass's rows, documents and labels."""
    import conceptlens
    from conceptlens import models
    from conceptlens.commands.sources import source

    args = demo_args(seed)
    model, tok = models.load(args.model)
    lens = conceptlens.attach(model, tok)
    train, test = Rows(), Rows()
    lens.fit({SITE: {"rows": train}}, source("bbc-news:train", seed), max_tokens=args.max_tokens, progress=False)
    texts = source("bbc-news:test", seed)
    lens.fit({SITE: {"rows": test}}, texts, max_tokens=args.describe_tokens, progress=False)
    labels = torch.tensor([texts.label_names.index(y) if isinstance(y, str) else int(y) for y in texts.labels])
    return {"train": torch.cat(train.x), "test": torch.cat(test.x), "doc": torch.cat(test.doc), "labels": labels,
            "n_classes": torch.tensor(len(texts.label_names))}


def fitted(spec: dict[str, Any], rows: torch.Tensor) -> Any:
    """An extractor of the demo's run config, fed the fit pass's rows in order, in fit-sized blocks."""
    from conceptlens.commands import run_config as rc

    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k not in ("method", "name", "site")}
    extractor = rc.method_class(spec["method"])(**options)
    for block in rows.split(2048):
        extractor.update(block)
    extractor.flush()
    return extractor


def best_losses(codes: torch.Tensor, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per topic, the lowest test log-loss over concepts `(C,)`, as the demo's quality table."""
    from conceptlens.describe.finish import class_probes

    doc, n_docs = data["doc"], int(data["doc"].max()) + 1
    doc_sum = torch.zeros(n_docs, codes.shape[1], dtype=torch.float64).index_add_(0, doc, codes.double())
    doc_rows = torch.zeros(n_docs, dtype=torch.long).index_add_(0, doc, torch.ones_like(doc))
    loss, _ = class_probes(doc_sum, doc_rows, data["labels"][:n_docs].tolist(), int(data["n_classes"]))
    return torch.where(loss.isnan(), torch.inf, loss).min(0).values


def variants(cfg: Any) -> dict[str, dict[str, Any]]:
    """The demo's extractors, and Deleuzian in paper mode with the demo's other options."""
    specs = {e["name"]: e for e in cfg.extractors}
    dz = specs["deleuzian"]
    return {"deleuzian (streaming)": dz, "deleuzian (paper)": {**dz, "mode": "paper"},
            "topk": specs["topk"], "kmeans": specs["kmeans"]}


def main() -> None:
    from conceptlens.commands import demo
    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.describe.activations import concept_activations

    threads(2)
    clock, rows = Clock(), []
    for seed in [int(s) for s in sys.argv[1:]] or [0]:
        data = cached("deleuzian_demo", passes, seed=seed)
        cfg = demo.run_config(demo_args(seed))
        print(f"[{clock}] seed {seed}: {len(data['train'])} fit rows, {len(data['test'])} described rows "
              f"({int(data['doc'].max()) + 1} documents)", flush=True)
        sets = {name: fitted(spec, data["train"]).concept_set() for name, spec in variants(cfg).items()}
        g = torch.Generator().manual_seed(1_000_003 + seed)  # the demo's control
        d, mean = data["train"].shape[1], sets["deleuzian (streaming)"].mean
        sets["random/128"] = ConceptSet(torch.randn(1024, d, generator=g)[:128], SITE, method="random", mean=mean)
        for name, cs in sets.items():
            best = best_losses(concept_activations(cs).encode(data["test"]).float(), data)
            rows.append((seed, name, len(cs), float(best.median()), " ".join(f"{v:.3f}" for v in best)))
            print(f"[{clock}]   {name}: median {float(best.median()):.4f}, per topic {rows[-1][-1]}", flush=True)
    report("best-concept probe log-loss on held-out bbc-news documents (lower is better)", rows,
           ("seed", "set", "n", "median over topics", "per topic (business .. tech)"))
    print(f"\ntotal {clock}")


if __name__ == "__main__":
    main()

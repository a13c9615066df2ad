"""`conceptlens ablate`: ablate chosen concepts on held-out text and compare with matched controls.

    conceptlens ablate --concepts runs/demo/concepts/blocks.15.resid_out --concept 3 7 --task next_token
    conceptlens ablate --concepts DIR --concept 3 7 --task probe --data bbc-news --controls concepts

The concepts (centred when the set carries the fit's mean, unless `--no-centre`) are ablated
at their site (`--mode` projection or mean) at every position but the first (`--positions
all` includes the attention sink), on the test split of `--data`. The task is the model's
next-token loss, or a logistic probe of the set's labels trained on clean activations of half
the documents and scored on the others. Printed: the clean figure with its baseline, the
ablated one, the controls' mean +- spread and z, the site zeroed as a ceiling, and warnings
when the controls make the comparison meaningless.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from conceptlens.commands._args import concept_dir, data_source, positive_int, seed
from conceptlens.metrics.faithfulness_result import CONTROLS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model to load (default: the one the set's run.toml names, else the set's)")
    parser.add_argument("--concepts", metavar="DIR", type=concept_dir, required=True, help="a saved ConceptSet folder")
    parser.add_argument("--concept", type=int, nargs="+", metavar="I", required=True, help="concepts to ablate")
    parser.add_argument("--mode", choices=("projection", "mean"), default="projection",
                        help="projection: the component along the span -> 0; mean: -> the set's mean's")
    parser.add_argument("--no-centre", action="store_true", help="ablate the stored directions, not centred ones")
    parser.add_argument("--task", choices=("next_token", "probe"), default="next_token")
    parser.add_argument("--data", type=data_source, default="bbc-news",
                        help="bundled set, its test split unless SET:SPLIT names one (train, test, all), or a .txt / "
                             ".jsonl file of texts (next_token)")
    parser.add_argument("--probe-site", help="--task probe: where the probe reads (default: the concepts' site)")
    parser.add_argument("--controls", choices=tuple(CONTROLS), default="covariance",
                        help="covariance (default): random directions with the activation covariance; random: "
                             "isotropic; concepts: other concepts of the same set")
    parser.add_argument("--n-controls", type=positive_int, default=8, help="control sets (at least 2)")
    parser.add_argument("--positions", choices=("after-first", "all"), default="after-first",
                        help="after-first (default) leaves the attention sink at position 0 alone")
    parser.add_argument("--max-docs", type=positive_int, default=64, help="test documents")
    parser.add_argument("--max-length", type=positive_int, default=128, help="tokens per document")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seed", type=seed, default=0, help="controls, documents and the probe's split")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    import torch

    import conceptlens
    from conceptlens import ConceptSet, data
    from conceptlens.batching import check_max_length
    from conceptlens.commands._common import check_one_site, check_predicts_tokens, load_model
    from conceptlens.commands.run_folder import model_of
    from conceptlens.metrics.faithfulness import ProbeTask, faithfulness

    for name in ("max_docs", "max_length", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {getattr(args, name)}")
    if args.n_controls < 2:  # before the model loads
        raise ValueError(f"--n-controls must be at least 2 (their spread is part of the result); got {args.n_controls}")
    full = ConceptSet.load(args.concepts)
    n = len(full)
    bad = [i for i in args.concept if not 0 <= i < n]
    if bad:
        raise ValueError(f"--concept {bad[0]} is out of range: {args.concepts} holds {n} concepts (0-{n - 1})")
    if full.site is None:
        raise ValueError(f"the concept set in {args.concepts} records no site")
    check_one_site(full.site, args.concepts, full.method, "ablate")
    if args.probe_site is not None and args.task != "probe":
        raise ValueError(f"--probe-site {args.probe_site!r} is where --task probe's probe reads; --task {args.task} "
                         "reads no probe (add --task probe)")
    model_name = args.model or model_of(args.concepts, full)
    centre = full.mean is not None and not args.no_centre
    base = full.centred() if centre else full
    chosen = base[list(args.concept)]
    name, _, split = args.data.partition(":")  # before the model loads
    test = data.load(name, split or "test") if not Path(args.data).is_file() else None
    pool = test.texts if test is not None else list(data.iter_texts(args.data))
    picked = torch.randperm(len(pool), generator=torch.Generator().manual_seed(args.seed))[:args.max_docs].tolist()
    texts = [pool[i] for i in picked]
    task: Literal["next_token"] | ProbeTask = "next_token"
    if args.task == "probe":
        if test is None or not test.label_names or isinstance(test.labels[0], list):
            raise ValueError(f"--task probe needs a bundled set with one label per document "
                             f"(bbc-news, movie-polarity); got {args.data!r}")
        task = ProbeTask([test.labels[i] for i in picked], site=args.probe_site)
    model, tok = load_model(args, model_name)
    if task == "next_token":
        check_predicts_tokens(model, "--task next_token", "use --task probe")
    check_max_length(model, args.max_length, "--max-length", tok)
    lens = conceptlens.attach(model, tok)
    result = faithfulness(lens, chosen, texts, task=task, mode=args.mode, controls=args.controls, control_set=base,
                          n_controls=args.n_controls, seed=args.seed, batch_size=args.batch_size,
                          max_length=args.max_length, progress=not args.no_progress,
                          positions=slice(1, None) if args.positions == "after-first" else "all")
    label, held = ", ".join(map(str, args.concept)), "held-out " if test is not None and split in ("", "test") else ""
    print(f"{full}\nablating concept{'s' if len(args.concept) > 1 else ''} {label}{' (centred)' if centre else ''} "
          f"at {full.site} by {args.mode}, positions {args.positions}; {len(texts)} {held}documents of {args.data}\n")
    print(result.summary())
    return 0

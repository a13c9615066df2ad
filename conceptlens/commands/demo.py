"""`conceptlens demo`: the main job on SmolLM2 and BBC News, offline, in a few minutes.

One streaming pass fits Deleuzian concepts, a TopK SAE and k-means at one middle block (no
activation is saved); a description pass over held-out articles records each concept's top
contexts, histogram and topic probes; a quality table puts every number next to its
baseline; the static report is written; and of the concepts that best predict one topic, the
one that steers other prompts furthest toward it steers unrelated prompts next to a
diff-of-means vector, a random direction chosen alike and a prompt prefix, all judged by a
MiniLM topic classifier and by fluency (`demo_steer`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from conceptlens.commands._args import count, nonempty_text, out_dir, positive_int, token_length
from conceptlens.commands.demo_steer import PROMPTS, SCREEN_PROMPTS, steer_example
from conceptlens.evaluate.probing import RANDOM_DRAWS
from conceptlens.evaluate.readings import READINGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--site", default="blocks.15.resid_out",
                        help="where every set is fitted, probed and steered (SmolLM2's block 15, chosen by validation; "
                             "on Gemma-3-270m blocks.12.resid_out: EVALUATION.md)")
    parser.add_argument("--max-tokens", type=positive_int, default=80_000,
                        help="tokens of the fit pass (Deleuzian and k-means read them all)")
    parser.add_argument("--sae-tokens", type=positive_int, default=40_000,
                        help="the TopK SAE's own budget within the pass: it is fed the first of them "
                             "(chosen on train folds: EVALUATION.md, 'The budget at 32 concepts')")
    parser.add_argument("--describe-tokens", type=positive_int, default=30_000, help="tokens of the description pass")
    parser.add_argument("--concepts", type=positive_int, default=DENSE_CONCEPTS, help="Deleuzian and k-means concepts")
    parser.add_argument("--width", type=positive_int, default=SHORT_FIT_WIDTH, help="TopK SAE latents")
    parser.add_argument("--k", type=positive_int, default=SHORT_FIT_K, help="TopK SAE active latents per token")
    parser.add_argument("--probe-docs", type=positive_int, nargs=2, default=[240, 1000], metavar=("TRAIN", "TEST"),
                        help="bbc-news articles of the k-sparse probe table: train (train split, after the fit's) "
                             "and held-out test (the test split's, then train-split articles after the probes'; none "
                             "repeats a text the fit or the probes read)")
    parser.add_argument("--probe-length", type=token_length, default=64, help="tokens per probed article")
    parser.add_argument("--probe-draws", type=positive_int, default=RANDOM_DRAWS,
                        help=f"draws of the matched random control (default: {RANDOM_DRAWS})")
    parser.add_argument("--probe-read", choices=READINGS, default="code",
                        help="read sets by their codes (TopK code, assigned concept; SAEBench reads an SAE's code), "
                             "the control through the same nonlinearity, or by their activations (default: code)")
    parser.add_argument("--ce-docs", type=positive_int, default=12,
                        help="held-out articles of CE-loss recovered (next to zero- and mean-ablation)")
    parser.add_argument("--topic", default="sports", help="the topic the steering example steers toward")
    parser.add_argument("--prompt", type=nonempty_text, nargs="+", default=list(PROMPTS),
                        help="unrelated prompts the steering comparison starts from")
    parser.add_argument("--judge-model", default="minilm-l6",
                        help="encoder of the topic judge (logistic regression on its mean-pooled embeddings)")
    parser.add_argument("--judge-docs", type=positive_int, default=600,
                        help="train-split articles the judge learns from (a seeded draw)")
    parser.add_argument("--out", type=out_dir, default="runs/demo",
                        help="run folder (concepts, descriptions, report); one that holds another run is refused")
    parser.add_argument("--overwrite", action="store_true",
                        help="clear the files of the run --out holds first, once the model and site are checked "
                             "(as `fit --overwrite`: other files stay)")
    parser.add_argument("--seed", type=count, default=0)
    parser.add_argument("--no-progress", action="store_true")
    for action in parser._actions:  # every default in --help, where the help does not say it already
        if action.default not in (None, argparse.SUPPRESS) and action.default is not False \
                and "default" not in (action.help or ""):
            action.help = (f"{action.help} " if action.help else "") + "(default: %(default)s)"


SHORT_FIT_WIDTH = 2048
SHORT_FIT_K = 8
SAE_LR_MULTIPLE = 2.0
"""The demo's SAE: width 2048, k 8, twice `short_budget_lr`, chosen by validation on train-split
articles only (`benchmarks/demo_defaults.py`, EVALUATION.md "demo defaults"): its k = 5 code-read
probe beat the matched random TopK encoder outside the intervals in 33 of 45 (seed, fold, topic)
runs, against 10 for width 1024 k 32 at 1x (26 for width 1024 k 8 at 2x)."""

DENSE_CONCEPTS = 32
"""Deleuzian and k-means concepts, chosen by validation on train-split articles only
(`benchmarks/demo_defaults.py`, EVALUATION.md "Demo defaults"): on document means, the k = 5
code-read probe beat its matched random control (as many random directions, one-hot by largest
cosine) outside the intervals in 44 (k-means) and 40 (Deleuzian without skew weighting) of 45
(seed, fold, topic) runs at 32 concepts, against 34 and 30 at 128. A token's code is its one-hot
concept, so a 64-token article spread over 128 concepts measures each concept's share from about
one token; over 32, from four."""

FIT_DOCUMENT_TOKENS = 128  # FitConfig.max_length: n fit tokens hold at least n / 128 documents


def pools_documents(max_tokens: int, concepts: int) -> bool:
    """Whether the dense sets fit document means (Deleuzian in the paper's mode without skew
    weighting, k-means with `unit="document"`) rather than tokens: when the budget holds a document
    per concept. On train-split articles outside the fit (`benchmarks/demo_defaults.py`,
    EVALUATION.md), document means turned Deleuzian's lexical concepts into topical ones (best
    concept's probe loss 0.203 against 0.325 over tokens), and k-means' k = 5 code-read probe from
    16 to 34 wins of 45 over its matched control (128 concepts). Skew weighting (1 / |skewness|)
    takes weight off skewed differences; over document means the skewed ones are the topics (a
    topic is present in a fifth of the articles), and without it Deleuzian's probe won 40 of 45
    against 34 at 32 concepts (30 against 32 at 128)."""
    return max_tokens // FIT_DOCUMENT_TOKENS >= concepts


def sae_batch_size(max_tokens: int, steps: int = 300) -> int:
    """Tokens per SAE step so that a fit of `max_tokens` takes about `steps` optimiser steps:
    a power of two in [128, 4096] (4096, the usual size, needs 1.2M tokens for 300 steps); at 40k
    tokens batch 128 (312 steps) reached held-out FVU 0.40 where batch 256 (156 steps) reached 0.44."""
    size = 128
    while size * 2 <= min(4096, max_tokens // steps):
        size *= 2
    return size


def run_config(args: argparse.Namespace):
    """The demo's run as a `fit` RunConfig (written to RUN/run.toml, so `conceptlens describe` and
    `conceptlens report` work on the demo's folder): three extractors at one site, the SAE's
    batch, mixing buffer and lr scaled with the budget. Checks every option without a model."""
    from conceptlens.commands import run_config as rc

    sae_tokens = min(args.sae_tokens, args.max_tokens)
    batch = sae_batch_size(sae_tokens)
    buffer = max(2048, min(16384, args.max_tokens // 4))
    documents = pools_documents(args.max_tokens, args.concepts)
    cfg = rc.from_dict({
        "model": args.model, "data": "bbc-news:train", "sites": [args.site], "out": args.out, "shuffle": args.seed,
        **({"dtype": args.dtype} if getattr(args, "dtype", None) else {}),
        "fit": {"max_tokens": args.max_tokens, "checkpoint_every": max(args.max_tokens // 2, 1)},
        "describe": {"data": "bbc-news:test", "max_tokens": args.describe_tokens},
        "extractor": [
            {"method": "deleuzian", "name": "deleuzian", "n_concepts": args.concepts, "buffer_size": buffer,
             "batch_size": min(2048, buffer // 2),
             **({"mode": "paper", "unit": "document", "skew_weighting": False} if documents else {}),
             "seed": args.seed},
            {"method": "topk", "name": "topk", "width": args.width, "k": args.k, "batch_size": batch,
             "buffer_size": 8 * batch, "warmup_tokens": min(4096, 4 * batch), "seed": args.seed,
             **({"max_tokens": sae_tokens} if sae_tokens < args.max_tokens else {})},
            {"method": "kmeans", "name": "kmeans", "n_concepts": args.concepts, "seed": args.seed,
             **({"unit": "document"} if documents else {})}]})
    rc.budget_lrs(cfg)  # the SAE's lr for this budget, as `conceptlens fit` chooses it, then the demo's multiple
    for spec in cfg.extractors:
        if spec["method"] == "topk":
            spec["lr"] *= SAE_LR_MULTIPLE
    return cfg


def _check(args: argparse.Namespace) -> None:
    for name in ("max_tokens", "sae_tokens", "describe_tokens", "concepts", "width", "k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {getattr(args, name)}")
    if args.k > args.width:
        raise ValueError(f"--k {args.k} must not exceed --width {args.width}")
    chosen_on = [p for p in args.prompt if p in SCREEN_PROMPTS]
    if chosen_on:
        raise ValueError(f"--prompt {chosen_on[0]!r} is one of the prompts the steered concept is chosen on "
                         f"({'; '.join(SCREEN_PROMPTS)}): give prompts other than these")


def run(args: argparse.Namespace) -> int:
    from conceptlens import data
    from conceptlens.commands import run_folder
    from conceptlens.evaluate import results
    from conceptlens.models import check_name
    from conceptlens.runlock import lock

    start = time.perf_counter()
    _check(args)
    topics = data.load("bbc-news", "test").label_names
    if args.topic not in topics:
        raise ValueError(f"--topic {args.topic!r} is not a bbc-news topic; choose one of {', '.join(topics)}")
    for model in (args.model, args.judge_model):
        check_name(model)
    cfg, out = run_config(args), Path(args.out)
    with lock(out, "demo"):  # before the model loads: a second writer fails at once
        if args.overwrite:
            run_folder.owned(out)  # a run.toml that is not a run's is refused now; the clear waits for the site
        else:
            run_folder.check(out, cfg)  # the same run again resumes; another run's folder is refused
            results.check_file(out, args.model)
        return _run(args, cfg, out, start)


def _run(args: argparse.Namespace, cfg, out: Path, start: float) -> int:
    import conceptlens
    from conceptlens.commands import run_folder
    from conceptlens.commands._common import load_model
    from conceptlens.fit_keys import canonical_key
    from conceptlens.report import write_report

    model, tok = load_model(args)
    lens = conceptlens.attach(model, tok)
    site = lens.site(str(canonical_key(lens, args.site)))  # one no extractor can fit: refused before any write
    if args.overwrite and (cleared := run_folder.clear(out)):  # only now: a bad site loses nothing
        print(f"--overwrite: removed the {len(cleared)} files of the run {out} held (other files stay)")
    print(f"{lens}\n")
    for name in ("embed", site.name, f"blocks.{site.name.split('.')[1]}.attn.k", "final"):
        print(" ", lens.site(name).describe())
    took: dict[str, float] = {}

    def timed(phase: str, fn, *params):
        t = time.perf_counter()
        result = fn(*params)
        took[phase] = time.perf_counter() - t
        return result

    report = timed("fit", _fit, lens, cfg, args, out)
    test_labels, descriptions = timed("describe", _describe, lens, report, cfg, args, out)
    timed("quality", _quality, descriptions, report, out)
    rows = timed("probes", _probe, lens, tok, report, args)
    timed("steering", steer_example, lens, tok, descriptions, test_labels, rows, args, out)
    print("\nWriting the report")
    summary = timed("report", lambda: write_report(out, progress=not args.no_progress))
    print(f"{summary.pages:,} pages, {summary.bytes / 1e6:.1f} MB in {summary.seconds:.1f} s")
    print(f"\nDone in {time.perf_counter() - start:.0f} s ("
          + ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in took.items()) + "). Open:\n"
          f"  {summary.path.resolve().as_uri()}\n"
          f"  run folder {out}/ (run.toml, checkpoint.pt for a rerun to resume, fit_report.json, concepts/ with "
          f"the probes' random control, describe/, quality.json, eval.json, steering.json, report/)")
    return 0


def _fit(lens, cfg, args: argparse.Namespace, out: Path):
    from conceptlens._io import atomic_write
    from conceptlens.commands import run_config as rc
    from conceptlens.commands.fit import jsonable, source
    from conceptlens.norm_audit import NormAudit

    plan, site = rc.build(cfg), cfg.sites[0]
    audit = plan[site]["norms"] = NormAudit(seed=args.seed)  # an audit, not an extractor: not in run.toml
    sae, dz, km = plan[site]["topk"].config, plan[site]["deleuzian"].config, plan[site]["kmeans"].config
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "run.toml", lambda p: Path(p).write_text(rc.to_toml(cfg), encoding="utf-8"))
    unit = ("paper mode on document means" + ("" if dz.skew_weighting else ", no skew weighting")
            if dz.unit == "document" else "streaming over tokens")
    budgets = rc.extractor_tokens(cfg)
    own = f"its first {budgets['topk']:,} tokens, " if "topk" in budgets else ""
    print(f"\nOne streaming pass over BBC News (train split, up to {args.max_tokens:,} tokens) at {site}:\n"
          f"  Deleuzian {args.concepts} concepts ({unit}), TopK SAE width {args.width} k {args.k} "
          f"({own}batch {sae.batch_size}, about {budgets.get('topk', args.max_tokens) // sae.batch_size} optimiser "
          f"steps, lr {sae.learning_rate():.3g}), k-means {args.concepts}"
          + (" (on document means, tokens assigned to the nearest)" if km.unit == "document" else ""))
    report = lens.fit(plan, source(cfg.data, cfg.shuffle), max_tokens=args.max_tokens, checkpoint_dir=str(out),
                      checkpoint_every=cfg.fit.checkpoint_every, progress=not args.no_progress,
                      extractor_tokens=budgets)
    print(report.summary())
    print(f"  {audit.summary()}")
    steps = report.stats["topk"]
    if getattr(steps, "steps", None) is not None:
        print(f"  TopK SAE: {steps.steps} optimiser steps on {steps.tokens:,} tokens")
    fields = {k: v for k, v in vars(report).items() if k != "concepts"}
    text = json.dumps(jsonable(fields) | {"concepts": sorted(report.concepts)}, indent=1)
    atomic_write(out / "fit_report.json", lambda p: Path(p).write_text(text, encoding="utf-8"))
    return report


def _describe(lens, report, cfg, args: argparse.Namespace, out: Path):
    """(labels of the described documents, descriptions) incl. a control set of random directions."""
    from conceptlens.checkpoint import CHECKPOINT
    from conceptlens.commands.fit import source
    from conceptlens.concepts.conceptset import ConceptSet

    test, site = source(cfg.describe.data, cfg.shuffle), cfg.sites[0]
    sets = dict(report.concepts)
    d = next(iter(sets.values())).d
    n = max(len(cs) for cs in sets.values())
    # not args.seed: an SAE seeded alike starts from torch.randn of the same shape, and the control
    # must not be its initial decoder
    g = torch.Generator().manual_seed(1_000_003 + args.seed)
    mean = next((cs.mean for cs in sets.values() if cs.mean is not None), None)  # measured as the concepts are
    model = next(iter(sets.values())).model  # named as the fit names its sets (a path by its last part)
    sets["random"] = ConceptSet(torch.randn(n, d, generator=g), site, method="random", model=model, mean=mean)
    sets["random"].save(out / "concepts" / "random")
    print(f"\nDescription pass over held-out articles (test split, up to {args.describe_tokens:,} tokens), "
          f"with a control of {n} random directions")
    descriptions = lens.describe(sets, test, max_tokens=args.describe_tokens, out=str(out / "describe"),
                                 progress=not args.no_progress)
    (out / "describe" / CHECKPOINT).unlink(missing_ok=True)  # done: `conceptlens describe RUN` starts afresh
    return test.labels, descriptions


def _quality(descriptions, report, out: Path) -> None:
    from conceptlens.commands.demo_quality import format_quality, quality_rows, write_quality

    first = next(iter(descriptions.values())).info
    base = {c: v for c, v in (first.get("base_rate_entropy") or {}).items() if v is not None}
    from conceptlens.concepts.conceptset import ConceptSet

    sets = {name: ConceptSet.load(out / "concepts" / name) for name in descriptions}
    directions = {name: (cs.centred() if cs.mean is not None else cs).directions  # as the activations and the atlas
                  for name, cs in sets.items()}
    rows = quality_rows(descriptions, directions, report.stats)
    docs = first.get("documents", 0)
    print(f"\nQuality on {docs} held-out documents (probes: even documents train, odd documents test)")
    print(format_quality(rows, base))
    write_quality(rows, base, out / "quality.json",
                  note="probe: test log-loss of the best single concept per class (lower is better) vs the "
                       "base-rate entropy; 'random/n' is the same selection over n random directions")


def _probe(lens, tok, report, args: argparse.Namespace):
    """The probe table and the CE-loss lines; the probe's train rows (the steering baseline reads them)."""
    from conceptlens.commands import demo_probe

    sets = dict(report.concepts)
    site = next(iter(sets.values())).site
    t = time.perf_counter()
    lines, rows = demo_probe.run_probes(lens, tok, sets, site, n_train=args.probe_docs[0], n_test=args.probe_docs[1],
                                        max_length=args.probe_length, draws=args.probe_draws, seed=args.seed,
                                        reading=args.probe_read, fitted=report.documents)
    config = {"k": 5, "reading": args.probe_read, "probe_docs": list(args.probe_docs),
              "probe_length": args.probe_length, "random_draws": args.probe_draws, "seed": args.seed}
    demo_probe.save_part(args, sets, site, demo_probe.PART, config, time.perf_counter() - t, lines)
    t = time.perf_counter()
    recon = demo_probe.reconstruction(lens, tok, sets, args.ce_docs, args.seed, report.documents)
    demo_probe.save_part(args, sets, site, "demo: reconstruction", {"ce_docs": args.ce_docs, "seed": args.seed},
                         time.perf_counter() - t, recon)
    return rows

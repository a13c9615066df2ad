"""The demo's defaults chosen by validation: each candidate's k = 5 code-reading probe vs its matched control.

    HF_HUB_OFFLINE=1 python benchmarks/demo_defaults.py [--seeds 0 1 2] [--folds 3] [--fold-docs 240]
        [--lengths 64 128] [--sites blocks.10.resid_out blocks.20.resid_out] [--variant kmeans:spherical=true]
        [--train-docs 0 240] [--max-tokens 40000] [--fit-length 128] [--json out.json]
        [--table-only out.json]

Per seed (the demo's --seed: the fit's shuffle, every extractor's init, the controls' draws), one
streaming pass fits every candidate on the demo's fit data (bbc-news train, shuffled with the seed,
`--max-tokens` tokens for every candidate, the SAE too (no `--sae-tokens` budget of its own), options
from `commands.demo.run_config`): at the demo's site the TopK SAE at
k x width x lr multiple (of `short_budget_lr`) and Deleuzian / k-means at each concept count (with
`--variant METHOD:KEY=VALUE`, that method's candidates again with that extractor option); at the other `--sites` the demo's SAE and each concept count of Deleuzian and k-means.
Every length of `--lengths` probes the other sites' sets and the demo site's `--long-sets`. Validation never touches the test split: the
`folds x fold-docs` train-split articles after the fit's documents in the seed's shuffled order (so
none was fitted on) are read once per site and probe length (`evaluate.readings.probe_readers`, the
code reading, `--draws` control draws) and cut into folds; each fold in turn trains the probes (240
articles, as the demo) and the other folds test them (`evaluate.probing.probing_lines`, one line per
topic, the demo's protocol); with `--train-docs N`, each fold tests instead and the probes train on
the first N articles of the other folds (the table's "split" column: train/test articles). Prints per candidate and topic: wins (probe above the control outside
both 95% bootstrap intervals, `evaluate.lines.verdict`) over seeds x folds, and the mean margin
(probe accuracy minus the control's) with a 95% t-interval over the seeds' fold means.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

DEMO_SITE = "blocks.15.resid_out"


class Candidate(NamedTuple):
    name: str
    """a set name (a safe folder name): site, method and options"""
    site: str
    method: str
    options: dict[str, Any]
    """demo flags (concepts, width, k), "lr_mult" for the SAE, "spec" for extractor options the demo has no
    flag for (e.g. k-means' spherical)"""


def candidates(ks: list[int], widths: list[int], mults: list[float], counts: list[int],
               sites: list[str], variants: list[str] = (), demo_site: str = DEMO_SITE) -> list[Candidate]:
    """The grid at `demo_site`, then the demo's SAE and the dense sets at each count at each other site;
    then each `variants` entry "method:key=value" (value read as JSON, else a string) as a copy of that
    method's candidates."""
    from conceptlens.commands.demo import SAE_LR_MULTIPLE, SHORT_FIT_K, SHORT_FIT_WIDTH

    def block(site: str) -> str:
        return "b" + site.split(".")[1]

    out = [Candidate(f"{block(demo_site)}_topk_w{w}_k{k}_lr{m:g}x", demo_site, "topk",
                     {"width": w, "k": k, "lr_mult": m}) for w in widths for k in ks for m in mults]
    out += [Candidate(f"{block(demo_site)}_{method}_{n}", demo_site, method, {"concepts": n})
            for method in ("deleuzian", "kmeans") for n in counts]
    for site in sites:
        out += [Candidate(f"{block(site)}_topk_w{SHORT_FIT_WIDTH}_k{SHORT_FIT_K}_lr{SAE_LR_MULTIPLE:g}x", site, "topk",
                          {"width": SHORT_FIT_WIDTH, "k": SHORT_FIT_K, "lr_mult": SAE_LR_MULTIPLE}),
                *(Candidate(f"{block(site)}_{m}_{n}", site, m, {"concepts": n})
                  for m in ("deleuzian", "kmeans") for n in counts)]
    base = list(out)
    for variant in variants:
        method, _, option = variant.partition(":")
        key, eq, value = option.partition("=")
        if method not in ("topk", "deleuzian", "kmeans") or not key or not eq:
            raise ValueError(f"--variant {variant!r}: write METHOD:KEY=VALUE with METHOD one of topk, deleuzian, "
                             "kmeans (e.g. kmeans:spherical=true)")
        out += [Candidate(f"{c.name}_{key}-{value}", c.site, c.method,
                          c.options | {"spec": c.options.get("spec", {}) | {key: _value(value)}})
                for c in base if c.method == method]
    return out


def _value(text: str) -> Any:
    """A `--variant` value: JSON (true, 0.5, [1, 2]) or else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def demo_args(site: str, seed: int, max_tokens: int, **flags: Any) -> argparse.Namespace:
    """The demo's parsed flags with these changed (its defaults otherwise)."""
    from conceptlens.commands import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = ["--site", site, "--seed", str(seed), "--max-tokens", str(max_tokens), "--sae-tokens", str(max_tokens)]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    return parser.parse_args(argv)


def fit_plan(cands: list[Candidate], seed: int, max_tokens: int,
             model: str = "smollm2-135m") -> dict[str, dict[str, Any]]:
    """{site: {name: extractor}}: each candidate built from the demo's own run config (its SAE lr from
    `budget_lrs`, times lr_mult), renamed after the candidate."""
    from conceptlens.commands import demo
    from conceptlens.commands import run_config as rc

    specs = []
    for c in cands:
        flags = {k: v for k, v in c.options.items() if k not in ("lr_mult", "spec")}
        cfg = demo.run_config(demo_args(c.site, seed, max_tokens, model=model, **flags))
        spec = dict(next(s for s in cfg.extractors if s["method"] == c.method))
        if "lr_mult" in c.options:  # a multiple of `short_budget_lr`, not of the demo's own multiple of it
            spec["lr"] *= c.options["lr_mult"] / demo.SAE_LR_MULTIPLE
        spec = spec | c.options.get("spec", {}) | {"name": c.name, "site": c.site}
        if "max_tokens" in spec:
            raise ValueError(f"candidate {c.name}: every candidate is fitted on --max-tokens here; a budget of "
                             "its own (max_tokens=) is not applied, so it is refused")
        specs.append(spec)
    sites = sorted({c.site for c in cands})
    cfg = rc.from_dict({"model": model, "data": "bbc-news:train", "sites": sites, "shuffle": seed,
                        "extractor": specs})
    return rc.build(cfg)


def subset(probed: Any, docs: torch.Tensor) -> Any:
    """The rows of documents `docs` (ids of `probed.doc`), documents renumbered 0.. in that order."""
    from conceptlens.evaluate.activations import Probed

    new = torch.full((int(probed.doc.max()) + 1,), -1, dtype=torch.long)
    new[docs] = torch.arange(len(docs))
    rows = (new[probed.doc] >= 0).nonzero().flatten()
    return Probed(probed.x[rows], {k: v[rows] for k, v in probed.z.items()}, probed.y[rows], new[probed.doc[rows]])


def pool_documents(texts: list[str], seeds: list[int], fitted: int, size: int) -> list[int]:
    """`size` train-split article ids that no seed's fit reads (each seed's fit reads a prefix, at most
    `fitted` long, of its shuffled order, as `commands.sources.source` shuffles), in seed 0's order;
    none repeats a read or pooled text (bbc-news repeats some articles), so no fold tests on another's."""
    orders = [torch.randperm(len(texts), generator=torch.Generator().manual_seed(s)).tolist() for s in seeds]
    seen = {texts[i] for order in orders for i in order[:fitted]}
    pool = []
    for i in orders[0]:
        if len(pool) < size and texts[i] not in seen:
            seen.add(texts[i])
            pool.append(i)
    if len(pool) < size:
        raise ValueError(f"only {len(pool)} train articles lie outside the fits; lower --folds or --fold-docs")
    return pool


def site_tokens(lens: Any, tok: Any, site: str, texts: list[str], labels: list[int], length: int) -> tuple:
    """(x `(N, d)`, doc `(N,)`, y `(D,)`): the token rows of the documents at `site` (as the probes see them,
    `evaluate.activations.collect`), kept to be read by every seed's sets."""
    from conceptlens.evaluate import activations as act

    xs, docs = [], []
    batches = act.task_batches(tok, texts, labels, token_level=False, tag_ids={}, batch_size=16, max_length=length)
    act.collect(lens, site, {}, batches, lambda x, doc: (xs.append(x.clone()), docs.append(doc.clone())))
    return torch.cat(xs), torch.cat(docs), torch.tensor(labels)


def read(tokens: tuple, sets: dict[str, Any], draws: int, seed: int, chunk: int = 64) -> Any:
    """Document rows: every set and its control draws read by their codes on the kept tokens, then
    mean-pooled per document (`evaluate.activations.pool_documents`), `chunk` documents at a time."""
    from conceptlens.evaluate.activations import Probed, pool_documents
    from conceptlens.evaluate.readings import probe_readers

    x, doc, y = tokens
    readers = probe_readers(sets, ("code",), draws=draws, seed=seed)
    parts = []
    for a in range(0, len(y), chunk):
        rows = ((doc >= a) & (doc < a + chunk)).nonzero().flatten()
        part = pool_documents(readers, x[rows], doc[rows] - a, y[a:a + chunk])
        parts.append(part._replace(doc=part.doc + a))
    return Probed(torch.cat([p.x for p in parts]), {k: torch.cat([p.z[k] for p in parts]) for k in readers},
                  torch.cat([p.y for p in parts]), torch.cat([p.doc for p in parts]))


def validate(probed: Any, class_names: list[str], folds: int, seed: int, n_train: int = 0) -> list[dict[str, Any]]:
    """Per fold (trains the probes; the other folds test them), per set and topic: the demo's line.
    With `n_train`, each fold tests instead and the probes train on the first `n_train` articles
    of the other folds."""
    from conceptlens.evaluate.lines import verdict
    from conceptlens.evaluate.probing import probing_lines

    n = int(probed.doc.max()) + 1
    cut = torch.arange(n).chunk(folds)
    if n_train > n - len(cut[0]):
        raise ValueError(f"the probes cannot train on {n_train} articles: the other folds hold {n - len(cut[0])}")
    out = []
    for f, train_docs in enumerate(cut):
        test_docs = torch.cat([c for j, c in enumerate(cut) if j != f])
        if n_train:
            train_docs, test_docs = test_docs[:n_train], train_docs
        lines = probing_lines("bbc-news", subset(probed, train_docs), subset(probed, test_docs), class_names,
                              reading="code", ks=(5,), seed=seed, by_task=True)
        out += [{"fold": f, "set": ln.extractor, "topic": ln.metric.split(" ")[0], "value": ln.value.value,
                 "control": ln.baselines[0][1].value, "win": verdict(ln) == "wins"} for ln in lines]
    return out


def run_seed(lens: Any, cands: list[Candidate], tokens: dict[tuple[str, int], tuple], class_names: list[str],
             args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """Fit every candidate with this seed, then validate each site's sets on the kept pool tokens."""
    from conceptlens.commands.sources import source

    t = time.perf_counter()
    report = lens.fit(fit_plan(cands, seed, args.max_tokens, args.model), source("bbc-news:train", seed),
                      max_tokens=args.max_tokens, max_length=args.fit_length, progress=False)
    if report.documents > args.fitted:
        raise ValueError(f"the fit read {report.documents} documents, more than --fitted {args.fitted}: raise it")
    print(f"seed {seed}: fitted {len(report.concepts)} sets on {report.tokens:,} tokens of {report.documents} "
          f"documents in {time.perf_counter() - t:.0f} s", flush=True)
    records = []
    for (site, length), kept in tokens.items():
        t = time.perf_counter()
        sets = {c.name: report.concepts[c.name] for c in cands
                if c.site == site and (length == args.lengths[0] or c.name in args.long_sets or site != args.site)}
        probed = read(kept, sets, args.draws, seed)
        for n_train in args.train_docs:
            got = validate(probed, class_names, args.folds, seed, n_train)
            split = f"{n_train}/{args.fold_docs}" if n_train else f"{args.fold_docs}/{(args.folds - 1) * args.fold_docs}"
            records += [r | {"seed": seed, "length": length, "split": split, "model": args.model} for r in got]
        print(f"  {site} length {length}: {len(sets)} sets read and probed in {time.perf_counter() - t:.0f} s",
              flush=True)
    return records


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval (nan half-width for one value)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def table(records: list[dict[str, Any]]) -> str:
    """Candidates down (by model, site, length and train/test split; "-" for records written before the split
    was), topics across: `wins/runs margin [low, high]`, total wins. A candidate of a model other than the
    first records' is named `model:set` (records before `--model` are SmolLM2's)."""
    topics = list(dict.fromkeys(r["topic"] for r in records))
    model = lambda r: r.get("model", "smollm2-135m")
    first = model(records[0]) if records else ""
    keys = list(dict.fromkeys((model(r), r["set"], r["length"], r.get("split", "-")) for r in records))
    out = [f"{'candidate':<26}{'len':>4}{'split':>10}" + "".join(f" {t:>28}" for t in topics) + f"{'wins':>9}"]
    for m, name, length, split in keys:
        mine = [r for r in records if model(r) == m and r["set"] == name and r["length"] == length
                and r.get("split", "-") == split]
        shown = name if m == first else f"{Path(m).name}:{name}"
        row, total = f"{shown:<26}{length:>4}{split:>10}", 0
        for topic in topics:
            cell = [r for r in mine if r["topic"] == topic]
            wins = sum(r["win"] for r in cell)
            total += wins
            by_seed: dict[int, list[float]] = {}
            for r in cell:
                by_seed.setdefault(r["seed"], []).append(r["value"] - r["control"])
            mean, low, high = interval([sum(v) / len(v) for v in by_seed.values()])
            row += f" {f'{wins}/{len(cell)} {mean:+.3f} [{low:+.3f},{high:+.3f}]':>28}"
        out.append(row + f" {f'{total}/{len(mine)}':>8}")
    return "\n".join(out)


def main() -> None:
    from conceptlens.evaluate.probing import RANDOM_DRAWS
    from conceptlens.commands.demo import FIT_DOCUMENT_TOKENS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fit-seeds", type=int, nargs="*", default=None,
                        help="fit and score only these of --seeds now (the pool stays --seeds'; merge the --json files)")
    parser.add_argument("--folds", type=int, default=3)
    parser.add_argument("--fold-docs", type=int, default=240, help="train-split articles per fold (the demo's 240)")
    parser.add_argument("--max-tokens", type=int, default=40_000, help="the fit's budget (the demo's)")
    parser.add_argument("--fit-length", type=int, default=FIT_DOCUMENT_TOKENS,
                        help=f"tokens the fit reads per document (the demo's {FIT_DOCUMENT_TOKENS})")
    parser.add_argument("--train-docs", type=int, nargs="+", default=[0],
                        help="each fold tests, the probes train on this many articles of the other folds (0: "
                             "each fold trains, the others test); several: each in turn, on the same fits")
    parser.add_argument("--draws", type=int, default=RANDOM_DRAWS, help=f"control draws (the demo's {RANDOM_DRAWS})")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128], help="probe lengths (tokens per article)")
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--lr-mults", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--concepts", type=int, nargs="+", default=[32, 128, 256, 512])
    parser.add_argument("--model", default="smollm2-135m", help="the model (a registered name or a file)")
    parser.add_argument("--site", default=DEMO_SITE, help="the demo site: the grid of --ks, --widths, --lr-mults "
                                                          "and --concepts is fitted here")
    parser.add_argument("--sites", nargs="*", default=["blocks.10.resid_out", "blocks.20.resid_out"],
                        help="other sites, at the demo's SAE and each --concepts count")
    parser.add_argument("--fitted", type=int, default=400,
                        help="pool articles come after this many of every seed's shuffled order (the fit reads fewer)")
    parser.add_argument("--long-sets", nargs="*", default=["b15_topk_w2048_k8_lr2x", "b15_deleuzian_32",
                                                           "b15_kmeans_32"],
                        help="sets of the demo site also probed at the later --lengths (the demo's defaults; "
                             "other sites' sets are probed at every length)")
    parser.add_argument("--variant", nargs="*", default=[], metavar="METHOD:KEY=VALUE",
                        help="also each candidate of METHOD with this extractor option (JSON value), e.g. "
                             "kmeans:spherical=true deleuzian:skew_weighting=false")
    parser.add_argument("--only", nargs="*", default=None, help="fit only these candidates (names as printed)")
    parser.add_argument("--json", default=None, help="write every record here (after each seed)")
    parser.add_argument("--cache", default=None, help="keep the pool's site activations in this folder for reruns")
    parser.add_argument("--table-only", nargs="+", default=None, help="print the table of these --json files and stop")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.table_only:
        print(table([r for path in args.table_only for r in json.loads(Path(path).read_text())]))
        return
    if max(args.train_docs) > (args.folds - 1) * args.fold_docs:
        parser.error(f"--train-docs {max(args.train_docs)}: the probes train on the other folds' "
                     f"{(args.folds - 1) * args.fold_docs} articles at most")
    try:
        cands = candidates(args.ks, args.widths, args.lr_mults, args.concepts, args.sites, args.variant, args.site)
    except ValueError as e:
        parser.error(str(e))
    import conceptlens
    from conceptlens import data, models

    torch.set_num_threads(args.threads)
    model, tok = models.load(args.model)
    lens = conceptlens.attach(model, tok)
    cands = [c for c in cands if not args.only or c.name in args.only]
    full = data.load("bbc-news", "train")
    pool = pool_documents(full.texts, args.seeds, args.fitted, args.folds * args.fold_docs)
    texts, labels = [full.texts[i] for i in pool], [full.label_names.index(full.labels[i]) for i in pool]
    tokens = {}
    for site in dict.fromkeys(c.site for c in cands):
        for length in args.lengths:
            t = time.perf_counter()
            key = (f"{Path(args.model).name}-{site}-{length}-{args.folds * args.fold_docs}-"
                   f"{'-'.join(map(str, args.seeds))}-after{args.fitted}")
            path = Path(args.cache or ".") / f"{key}.pt"  # every input of the pool and its rows
            if args.cache and path.is_file():
                tokens[site, length] = torch.load(path)
            else:
                tokens[site, length] = site_tokens(lens, tok, site, texts, labels, length)
                if args.cache:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(tokens[site, length], path)
            print(f"{len(pool)} pool articles at {site}, {length} tokens each: {time.perf_counter() - t:.0f} s",
                  flush=True)
    records: list[dict[str, Any]] = []
    for seed in args.fit_seeds or args.seeds:
        records += run_seed(lens, cands, tokens, full.label_names, args, seed)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f)
        print(table(records), flush=True)
    print(table(records))
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()

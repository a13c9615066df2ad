"""`conceptlens fit [run.toml]`: stream-fit concept extractors into a run folder, then describe them.

    conceptlens fit --model smollm2-135m --data bbc-news --site blocks.15.resid_out \\
        --extractor "topk:width=4608,k=32" --extractor "kmeans:n_concepts=512" --max-tokens 50000 --out runs/x
    conceptlens fit run.toml --max-tokens 100000          # flags override the file
    conceptlens fit ... --extractor "crosscoder:site=blocks.3.resid_out+blocks.6.resid_out,width=4096,k=32"

Writes RUN/run.toml (the resolved config), RUN/checkpoint.pt (every --checkpoint-every tokens),
RUN/concepts/<NAME>/ (one ConceptSet per extractor), RUN/fit_report.json, and unless
--no-describe the description pass into RUN/describe/<NAME>/. Ctrl-C finishes the batch, writes
a checkpoint and says its token count; the same command again resumes there (under torchrun, which
passes a second Ctrl-C on to the ranks at once, it resumes from the last --checkpoint-every
checkpoint). A distributed run folder equals one process's with batch W * --batch-size, the
description pass included: rank 0 describes with that batch, which run.toml records as [describe]
batch_size (set it lower where one device cannot hold it). RUN holds one
run: a folder of another run is refused unless --overwrite clears that run's files (once the model
has loaded and the sites are checked, so a mistake loses nothing; never a file behind a symbolic
link, nor any in a folder whose run.toml is not a run's), and it is locked while written (a second
writer fails at once). Every option is checked before the model loads. Bundled sets are read in a seeded shuffled order (they are stored sorted by
label); the description pass reads the documents after those the fit consumed, unless
--describe-data names another source. With --max-tokens, an SAE whose spec sets no lr= gets the lr
for its budget (`short_budget_lr`: the steps --max-tokens / batch_size), printed and written into
RUN/run.toml; a resumed run keeps the lr its run.toml records.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from conceptlens._io import atomic_write
from conceptlens.commands import run_config as rc
from conceptlens.commands import fit_summary, run_folder
from conceptlens.commands._args import int_list
from conceptlens.commands.describe import add_describe_options
from conceptlens.commands.sources import source
from conceptlens.data import SET_NAMES

DEFAULT_CHECKPOINT_EVERY = 20_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?",
                        help="a run.toml (flags override it; its relative paths are from the current folder)")
    parser.add_argument("--model", help="registered name (smollm2-135m, minilm-l6), local folder or hub id")
    parser.add_argument("--data", help=f"bundled set, SET or SET:SPLIT (train, the default, test or all; sets: "
                        f"{', '.join(SET_NAMES)}), or a .txt (one document per line) or .jsonl ({{\"text\": ...}} "
                        "per line) file")
    parser.add_argument("--out", help="run folder (default runs/fit)")
    parser.add_argument("--site", action="append", help="site to read (repeatable), e.g. blocks.15.resid_out")
    parser.add_argument("--extractor", action="append", metavar="SPEC",
                        help=f"METHOD:key=value,... (repeatable). A one-site method is fitted once per --site, "
                             f"or at the one site= picks among them; a method of several sites names them with "
                             f"site= (A->B transcoder, A+B crosscoder, A+B->C+D) and needs no --site; name= "
                             f"optional. Methods: {', '.join(rc.METHODS)}")
    parser.add_argument("--batch-size", type=int, help="documents per forward (16)")
    parser.add_argument("--max-length", type=int, help="tokens per document (128)")
    parser.add_argument("--max-tokens", type=int, help="stop the fit at the batch that reaches this many tokens (default: "
                        "all; the last batch is whole, so a fit may read up to a batch more); an SAE without lr= then "
                        "gets the lr for this budget")
    parser.add_argument("--checkpoint-every", type=int, help=f"tokens between checkpoints ({DEFAULT_CHECKPOINT_EVERY})")
    parser.add_argument("--no-resume", action="store_true", help="start again even if RUN holds a checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="RUN may hold another run: clear the files that run wrote (no other file), then start")
    parser.add_argument("--shuffle", type=int, help="seed of the document order of bundled sets (0)")
    parser.add_argument("--no-shuffle", action="store_true", help="read bundled sets in their stored order")
    parser.add_argument("--distributed", action="store_true",
                        help="fit across the processes torchrun started (implied when WORLD_SIZE > 1): documents "
                             "sharded by rank, --batch-size per rank, rank 0 writes the run folder and describes")
    parser.add_argument("--no-describe", action="store_true", help="skip the description pass")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    add_describe_options(parser)


def resolve(args: argparse.Namespace) -> rc.RunConfig:
    """The file (if any) with the flags laid over it, checked."""
    raw = rc.read_toml(args.config) if args.config else {}
    for section in ("fit", "describe"):  # flags are laid into these tables: a value there must be one
        if not isinstance(raw.get(section, {}), dict):
            raise ValueError(f"[{section}] must be a table; got {section} = {raw[section]!r}")
    for key in ("model", "data", "out"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    if args.site:
        raw["sites"] = args.site
    if args.extractor:
        raw["extractor"] = [rc.parse_extractor(spec) for spec in args.extractor]
    if getattr(args, "dtype", None) is not None:
        raw["dtype"] = args.dtype
    if args.no_shuffle:
        raw["shuffle"] = False
    elif args.shuffle is not None:
        raw["shuffle"] = args.shuffle
    fit = raw.setdefault("fit", {})
    for key in ("batch_size", "max_length", "max_tokens", "checkpoint_every"):
        if getattr(args, key) is not None:
            fit[key] = getattr(args, key)
    if args.no_resume or args.overwrite:
        fit["resume"] = False
    describe = raw.setdefault("describe", {})
    flags = {"enabled": False if args.no_describe else None, "data": args.describe_data,
             "max_tokens": args.describe_tokens, "top_n": args.top_n, "prompt": args.prompt,
             "window": int_list(args.window, "--window") if args.window else None,
             "steer": args.steer}
    describe.update({k: v for k, v in flags.items() if v is not None})
    _record_local_paths_absolute(raw)
    cfg = rc.from_dict(raw)
    if cfg.fit.checkpoint_every is None:
        cfg.fit.checkpoint_every = DEFAULT_CHECKPOINT_EVERY
    return cfg


def _record_local_paths_absolute(raw: dict[str, Any]) -> None:
    """A model folder or data file given relative to the current folder is recorded by its
    absolute path, so `describe RUN` or a resume run from elsewhere reads the same files, not
    whatever another folder holds under that name (a registered model or bundled set name that
    is no local path stays as it is)."""
    from conceptlens.models import REGISTRY

    def absolute(value: Any, local: Callable[[Path], bool]) -> Any:
        return os.path.abspath(Path(value).expanduser()) if isinstance(value, str) and value and \
            local(Path(value).expanduser()) else value

    if raw.get("model") not in REGISTRY:
        raw["model"] = absolute(raw.get("model"), Path.exists)
    raw["data"] = absolute(raw.get("data"), Path.is_file)  # a folder named like a bundled set (an --out) is no data
    describe = raw.get("describe")
    if isinstance(describe, dict) and "data" in describe:
        describe["data"] = absolute(describe["data"], Path.is_file)


def jsonable(value: Any) -> Any:
    """Reports to JSON: dataclasses and named tuples as dicts, small tensors as lists, NaN as null."""
    import torch

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "_asdict"):
        return jsonable(value._asdict())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return jsonable(value.item() if value.numel() == 1 else value.tolist()) if value.numel() <= 4096 else \
            {"shape": list(value.shape), "mean": float(value.float().mean())}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def planned_concepts(extractor: Any) -> int | None:
    """How many concepts an extractor not yet fitted will give (its n_concepts, n_codes or width),
    or None when its config names none of them."""
    config = getattr(extractor, "config", None)
    for key in ("n_concepts", "n_codes", "width"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _check_steer_indices(cfg: rc.RunConfig, plan: Any) -> None:
    """describe.steer's SET:INDEX within each set's planned size, before the model loads (the
    description pass would refuse them after the fit)."""
    if not (cfg.describe.enabled and cfg.describe.steer):
        return
    from conceptlens.describe.steering import SteeringRequest

    sizes = {name: planned_concepts(ex) for group in plan.values() for name, ex in group.items()}
    SteeringRequest(list(cfg.describe.steer)).chosen({n: 2**62 if c is None else c for n, c in sizes.items()})


def run(args: argparse.Namespace) -> int:
    from conceptlens.models import check_name
    from conceptlens.runlock import lock

    cfg = resolve(args)
    check_name(cfg.model)
    held = Path(cfg.out) / "run.toml"  # a run in its folder keeps its recorded lr (see budget_lrs)
    given = {e["name"] for e in cfg.extractors if "lr" in e}
    chosen = rc.budget_lrs(cfg, rc.from_dict(rc.read_toml(held)) if held.is_file() and not args.overwrite else None)
    kept = {e["name"]: e["lr"] for e in cfg.extractors
            if e["name"] not in given | chosen.keys() and e.get("lr") is not None}
    plan = rc.build(cfg)
    _check_steer_indices(cfg, plan)
    texts = source(cfg.data, cfg.shuffle)
    budgets = rc.extractor_tokens(cfg)
    if cfg.describe.enabled and not cfg.describe.data and cfg.fit.max_tokens is None and \
            not all(e["name"] in budgets for e in cfg.extractors):
        raise ValueError(f"without --max-tokens the fit reads all of {cfg.data}, and the description pass reads the "
                         "documents after the fit's: pass --max-tokens N, --describe-data DATA, or --no-describe")
    if cfg.describe.enabled and cfg.describe.data:
        source(cfg.describe.data, cfg.shuffle)
    out = Path(cfg.out)
    distributed = args.distributed or int(os.environ.get("WORLD_SIZE", "1")) > 1
    writes = not distributed or int(os.environ.get("RANK", "0")) == 0  # torchrun: rank 0 writes the run folder
    with lock(out, "fit") if writes else nullcontext():  # before the model loads: a second writer fails at once
        if not args.overwrite:
            run_folder.check(out, cfg)
        elif writes:
            run_folder.owned(out)  # a run.toml that is not a run's is refused now; its files are cleared once
        return _fit_and_describe(args, cfg, plan, texts, out, distributed, writes, chosen, kept)


def _fit_and_describe(args: argparse.Namespace, cfg: rc.RunConfig, plan: Any, texts: Any, out: Path,
                      distributed: bool, writes: bool, chosen: dict[str, float], kept: dict[str, float]) -> int:
    import conceptlens
    from conceptlens.commands._common import load_model
    from conceptlens.commands.describe import describe_run
    from conceptlens.checkpoint import CHECKPOINT, check_budget
    from conceptlens.fit import FitConfig
    from conceptlens.batching import check_max_length
    from conceptlens.fit_keys import canonical_key, key_name

    model, tok = load_model(args, cfg.model, cfg.dtype)
    lens = conceptlens.attach(model, tok)
    for site in cfg.sites:
        lens.site(site)
    for spec in cfg.extractors:  # the sites an extractor of several sites names, before anything is written
        canonical_key(lens, rc.extractor_key(spec))
    check_max_length(model, cfg.fit.max_length, "--max-length", tok)  # (the fit checks it again, after run.toml)
    if writes and args.overwrite and (cleared := run_folder.clear(out)):  # only now: a bad site loses nothing
        print(f"--overwrite: removed the {len(cleared)} files of the run {out} held (other files stay)")
    if cfg.fit.resume:  # a checkpoint past a lowered --max-tokens: refused before run.toml records the budget
        check_budget(out / CHECKPOINT, cfg.fit.max_tokens)
    if distributed and cfg.describe.batch_size is None:  # rank 0 describes alone, with one process's batch
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = dataclasses.replace(cfg, describe=dataclasses.replace(cfg.describe,
                                                                    batch_size=cfg.fit.batch_size * world))
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        written = dataclasses.replace(cfg, fit=dataclasses.replace(cfg.fit, resume=True))  # a rerun of it resumes
        atomic_write(out / "run.toml", lambda p: Path(p).write_text(rc.to_toml(written), encoding="utf-8"))
        at: dict[str, list[str]] = {}  # "a+b" for a crosscoder, which has no --site
        for key, group in plan.items():
            for name, extractor in group.items():
                at.setdefault(key_name(canonical_key(lens, key), extractor), []).append(name)
        where = "; ".join(f"{', '.join(names)} at {site}" for site, names in at.items())
        print(f"{lens}\nfitting {where} -> {out}")
        budgets = {e["name"]: rc.entry_budget(e, cfg.fit.max_tokens) or 0 for e in cfg.extractors}
        for line in fit_summary.budget_lr_lines(chosen, plan, budgets):
            print(line)
        for name, lr in kept.items():  # also under --no-resume: the lr is part of the run's identity
            print(f"  {name}: Adam lr {lr:.3g} as {out / 'run.toml'} records it (--overwrite chooses it again)")
    config = FitConfig(**dataclasses.asdict(cfg.fit), checkpoint_dir=str(out), progress=writes and not args.no_progress,
                       distributed=distributed, extractor_tokens=rc.extractor_tokens(cfg))
    report = lens.fit(plan, texts, config=config)
    documents = report.documents
    if distributed:  # ranks read interleaved documents in lockstep: together, the stream's first ones
        import torch
        import torch.distributed as dist

        total = torch.tensor([documents], dtype=torch.int64)
        dist.all_reduce(total)
        documents = int(total)
    if not writes:
        return 0
    report = dataclasses.replace(report, documents=documents)  # every rank's, as one process counts them
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report) if f.name != "concepts"}
    text = json.dumps(jsonable(fields) | {"concepts": sorted(report.concepts)}, indent=1)
    atomic_write(out / "fit_report.json", lambda p: Path(p).write_text(text, encoding="utf-8"))
    print(report.summary())
    print("\n".join(["extractors:", *fit_summary.extractor_lines(report.stats)]))
    for line in fit_summary.few_steps_warnings(report.stats):
        print(line, file=sys.stderr)
    for name, cs in report.concepts.items():
        print(f"  {name}: {cs} -> {out / 'concepts' / name}")
    failed = [name for name, s in report.stats.items() if isinstance(s, dict) and "error" in s]
    if failed and not report.concepts:  # nothing to describe or use: not a success
        raise ValueError(f"no extractor was fitted ({', '.join(failed)}: too few rows; the fit above says how many "
                         "it kept): give more tokens (--max-tokens), longer documents (--max-length) or more data")
    if cfg.describe.enabled:
        describe_run(lens, cfg, report.concepts, documents, out, progress=not args.no_progress)
    return 0

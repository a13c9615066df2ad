"""`conceptlens describe RUN`: the description pass over a fitted run folder.

    conceptlens describe runs/x                       # RUN/describe/<NAME>/ for every RUN/concepts/<NAME>
    conceptlens describe runs/x --describe-tokens 50000 --steer kmeans:3,topk:17 --prompt "The weather"

Reads RUN/run.toml for the model, data and defaults; the documents described are those after
the ones the fit consumed (RUN/fit_report.json), or --describe-data. Labelled bundled sets
(bbc-news, movie-polarity) add per-class probe losses. Checkpoints into RUN/describe/ and
resumes like the fit (--no-resume starts again); a finished pass removes its checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Mapping

from conceptlens.commands import run_config as rc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run folder written by conceptlens fit")
    parser.add_argument("--concepts", action="append", help="describe only this concepts/<NAME> (repeatable)")
    parser.add_argument("--no-resume", action="store_true",
                        help="start the pass again even if RUN/describe holds a checkpoint of an interrupted one")
    add_describe_options(parser)


def add_describe_options(parser: argparse.ArgumentParser) -> None:
    """The description pass's options, shared by `describe` and `fit`."""
    parser.add_argument("--describe-data", help="describe on this source instead of the documents after the fit's (default: run.toml's "
                        "describe.data, if any)")
    parser.add_argument("--describe-tokens", type=int, help="tokens of the description pass (default: run.toml's, else 20000)")
    parser.add_argument("--top-n", type=int, help="top contexts kept per concept (default: run.toml's, else 16)")
    parser.add_argument("--window", help="tokens left,right of each top token (default: run.toml's, else 8,4)")
    parser.add_argument("--steer", type=steer_names,
                        help="concepts to record steering samples for, as SET:INDEX, e.g. kmeans:12,topk:5")
    parser.add_argument("--prompt", help="first prompt of the steering samples (two more are fixed)")


def steer_names(text: str) -> list[str]:
    """'kmeans:12, topk:5' -> ['kmeans:12', 'topk:5'], each checked to be SET:INDEX."""
    from conceptlens.describe.steering import _named

    try:
        return [f"{name}:{index}" for name, index in (_named(v) for v in text.split(",") if v.strip())]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def describe_run(lens: Any, cfg: rc.RunConfig, concept_sets: Mapping[str, Any], consumed: int, out: Path,
                 progress: bool = True) -> dict:
    """Describe `concept_sets` as `cfg.describe` says, into out/describe/<NAME>/ (`progress`: its bar)."""
    from conceptlens.checkpoint import CHECKPOINT
    from conceptlens.commands.sources import source
    from conceptlens.describe import SteeringRequest

    from conceptlens.fit_keys import cross_layer

    d = cfg.describe
    for name in [n for n, cs in concept_sets.items() if cross_layer(cs.config.get("fit"))]:
        print(f"not describing {name}: it reads other sites than those its directions live at (a transcoder's "
              "source, a crosscoder's several sites); its latents' contexts need its encoder, not its directions")
    concept_sets = {n: cs for n, cs in concept_sets.items() if not cross_layer(cs.config.get("fit"))}
    if not concept_sets:
        return {}
    data = source(d.data or cfg.data, cfg.shuffle)
    skip = 0 if d.data else consumed
    if skip and not _documents_after(data, skip):
        raise ValueError(f"the fit read all {skip:,} documents of {cfg.data}, so none is left to describe (the pass "
                         "reads the documents after the fit's): pass --describe-data DATA (held-out text) or "
                         "--no-describe; the fit is kept (a shorter one needs --overwrite and a smaller --max-tokens)")
    prompts = (d.prompt, *SteeringRequest.prompts[1:])
    steering = SteeringRequest(list(d.steer), prompts=prompts) if d.steer else None
    print(f"\ndescribing {', '.join(concept_sets)} on {d.max_tokens or 'all'} tokens of "
          f"{d.data or cfg.data} (documents from {skip})")
    streaming = {**dataclasses.asdict(cfg.fit), "max_tokens": d.max_tokens,  # the fit's batches, the pass's budget
                 "batch_size": d.batch_size or cfg.fit.batch_size,
                 "progress": progress}
    descriptions = lens.describe(dict(concept_sets), data, skip_documents=skip, top_n=d.top_n, window=tuple(d.window),
                                 out=str(out / "describe"), steering=steering, **streaming)
    for name, desc in descriptions.items():
        print(f"  {name}: {desc.info['tokens']:,} tokens, {desc.info['documents']:,} documents -> "
              f"{out / 'describe' / name}")
    (out / "describe" / CHECKPOINT).unlink(missing_ok=True)  # done: a pass over other sets starts afresh
    for line in warnings(descriptions):
        print(f"  warning: {line}")
    return descriptions


def _documents_after(data: Any, skip: int) -> bool:
    """Whether `data` (a TextSet or a file, as `source` gives it) holds a document after its first `skip`."""
    from itertools import islice

    from conceptlens import data as datasets

    return next(islice(datasets.iter_texts(data), skip, None), None) is not None


def warnings(descriptions: Mapping[str, Any]) -> list[str]:
    """One line per set whose concepts one token heads, and per site whose variance a few large-norm tokens carry."""
    from collections import Counter

    from conceptlens.report.legends import HEADS_SHARE

    out, sites = [], set()
    for name, desc in descriptions.items():
        heads = Counter(c["contexts"][0]["tokens"][c["contexts"][0]["center"]] for c in desc.contexts if c["contexts"])
        if heads and not desc.info.get("control"):
            token, count = heads.most_common(1)[0]
            if count > HEADS_SHARE * desc.info["n_concepts"]:
                n = desc.info["n_concepts"]
                out.append(f"{token!r} is the first top token of {count} of the {n} {name} concepts")
        norms, site = desc.info.get("norms") or {}, desc.info.get("site")
        if norms.get("dominated") and site not in sites:
            sites.add(site)
            largest = ", ".join(f"{t!r} x{c}" for t, c in norms.get("largest") or [])
            out.append(f"at {site} the 1% largest-norm tokens carry {norms['top_share']:.0%} of the variance "
                       f"(largest: {largest})")
    return out


def run(args: argparse.Namespace) -> int:
    from conceptlens.runlock import lock

    with lock(args.run_dir, "describe", create=False):  # before the model loads: a second writer fails at once
        return _describe(args)


def _describe(args: argparse.Namespace) -> int:
    import conceptlens
    from conceptlens.commands._common import load_model
    from conceptlens.commands._args import int_list
    from conceptlens.commands.sources import source
    from conceptlens.concepts.conceptset import CONFIG_FILE, ConceptSet

    out = Path(args.run_dir)
    if not (out / "run.toml").is_file():
        raise FileNotFoundError(f"{out / 'run.toml'} not found: give a run folder written by conceptlens fit")
    raw = rc.read_toml(out / "run.toml")
    describe = raw.setdefault("describe", {})
    flags = {"data": args.describe_data, "max_tokens": args.describe_tokens, "top_n": args.top_n,
             "prompt": args.prompt, "window": int_list(args.window, "--window") if args.window else None,
             "steer": args.steer}
    describe.update({k: v for k, v in flags.items() if v is not None})
    if args.no_resume:
        raw.setdefault("fit", {})["resume"] = False
    cfg = rc.from_dict(raw)
    found = sorted(p.name for p in (out / "concepts").glob("*") if (p / CONFIG_FILE).is_file())
    report_path = out / "fit_report.json"
    consumed = fit_documents(report_path) if report_path.is_file() else 0
    fitted = fit_concepts(report_path) if report_path.is_file() else None
    if fitted is not None:  # a folder the last fit did not write is an earlier fit's: its documents are others
        # (a control, random directions, is the description pass's own: described again with the rest)
        found = [name for name in found if name in fitted or _control(out / "concepts" / name / CONFIG_FILE)]
    chosen = args.concepts or found
    missing = sorted(set(chosen) - set(found))
    if not found or missing:
        stale = " (an earlier fit's: the last fit, fit_report.json, wrote no such set)" if missing and \
            fitted is not None and (out / "concepts" / missing[0] / CONFIG_FILE).is_file() else ""
        raise ValueError(f"no concept set {missing[0] if missing else ''!r} in {out / 'concepts'}{stale}; "
                         f"found {found}")
    sets = {name: ConceptSet.load(out / "concepts" / name) for name in chosen}
    source(cfg.describe.data or cfg.data, cfg.shuffle)  # a missing or empty data file: before the model loads
    _check_model(out, cfg.model, sets)
    if cfg.describe.steer:  # SET:INDEX among the sets described here, before the model loads
        from conceptlens.describe import SteeringRequest
        from conceptlens.fit_keys import cross_layer

        SteeringRequest(list(cfg.describe.steer)).chosen(
            {name: len(cs) for name, cs in sets.items() if not cross_layer(cs.config.get("fit"))})
    model, tok = load_model(args, cfg.model, cfg.dtype)
    describe_run(conceptlens.attach(model, tok), cfg, sets, consumed, out)
    return 0


def _control(config: Path) -> bool:
    """Whether the saved set at `config` is a control (random directions) rather than a fit's concepts."""
    from conceptlens._content import read_json
    from conceptlens.describe.run import CONTROL_METHODS

    saved = read_json(config)
    return isinstance(saved, dict) and saved.get("method") in CONTROL_METHODS


def fit_concepts(path: Path) -> list[str] | None:
    """The sets the fit of RUN/fit_report.json wrote (None where it does not list them)."""
    from conceptlens._content import field, read_json

    report = field(path, "the file", read_json(path), dict)
    names = report.get("concepts")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


def fit_documents(path: Path) -> int:
    """The documents a fit read, from its RUN/fit_report.json (checked)."""
    from conceptlens._content import MAX_COUNT, field, read_json

    report = field(path, "the file", read_json(path), dict)
    return field(path, "documents", report.get("documents"), int, low=0, high=MAX_COUNT)


def _check_model(out: Path, model: str, sets: Mapping[str, Any]) -> None:
    """Refuse to describe a set on another model than the one that fitted it (run.toml edited)."""
    from conceptlens.models import portable_id

    wanted = portable_id(model)
    for name, cs in sets.items():
        if cs.model and cs.model != wanted:
            raise ValueError(f"{out / 'concepts' / name} was fitted on model {cs.model!r}; {out / 'run.toml'} "
                             f"names {wanted!r}: describe a set with the model that fitted it")

"""`conceptlens eval RUN_DIR --suite ...`: the evaluation suite (`conceptlens.evaluate`) on fitted sets.

    conceptlens eval runs/demo                                   # every set; reconstruction, probing, absorption
    conceptlens eval runs/demo --suite probing --task bbc-news --concepts topk
    conceptlens eval runs/demo/concepts/topk --suite quality --task wsj-pos   # the older single-concept table
    conceptlens eval --suite synthetic                           # no run: SAELens's synthetic benchmark

Prints one markdown table per site: each figure with its 95% interval (a bootstrap over
held-out documents) next to its baselines, and saves every figure (the per-concept probe scores
too) in RUN_DIR/eval.json as each part finishes (`evaluate.results`), where `conceptlens report`
finds it. See EVALUATION.md for the definitions.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from conceptlens.commands import run_folder
from conceptlens.commands._args import count, existing_dir, positive_int, seed, token_length
from conceptlens.evaluate.probing import KS, RANDOM_DRAWS
from conceptlens.evaluate.readings import READINGS
from conceptlens.evaluate.suite import DEFAULT_SUITES, PROBE_TASKS, SUITES, SuiteConfig
from conceptlens.evaluate.synthetic_data import SyntheticConfig


def _choices(valid: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none)'}; choose from {', '.join(valid)}")
        return tuple(dict.fromkeys(items))  # each once, in the order given
    return parse


def _ks(text: str) -> tuple[int, ...]:
    return tuple(positive_int(t) for t in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=existing_dir, nargs="?",
                        help="a ConceptSet folder, or a fit checkpoint_dir holding concepts/<name>/ "
                             "(not needed for --suite synthetic alone)")
    parser.add_argument("--suite", type=_choices(SUITES, "suite"), default=DEFAULT_SUITES,
                        help=f"comma-separated parts, from {', '.join(SUITES)} (default: {','.join(DEFAULT_SUITES)})")
    parser.add_argument("--task", "--tasks", dest="tasks", type=_choices(PROBE_TASKS, "task"), default=PROBE_TASKS,
                        help=f"labelled sets to probe, comma-separated (default: all of {', '.join(PROBE_TASKS)})")
    parser.add_argument("--concepts", help="comma-separated concepts/<name> of a checkpoint_dir (default: all)")
    parser.add_argument("--model", help="model to load (default: the one RUN/run.toml loaded, else the one the "
                        "sets name)")
    parser.add_argument("--max-docs", type=positive_int, default=400, help="documents (sentences) per split")
    parser.add_argument("--max-length", type=token_length, default=128, help="tokens per document")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--max-classes", type=positive_int, default=8, help="wsj-pos: probe the most frequent tags only")
    parser.add_argument("--ks", type=_ks, default=KS, help="k of the k-sparse probes (default: 1,2,5,20)")
    parser.add_argument("--random-draws", type=positive_int, default=RANDOM_DRAWS,
                        help=f"draws of the random-direction control (default: {RANDOM_DRAWS})")
    parser.add_argument("--probe-read", type=_choices(READINGS, "reading"), default=READINGS,
                        help="probing: read sets (and their controls the same way) by their activations, by their "
                             f"codes (an SAE's TopK code against a random TopK encoder), or both (default: "
                             f"{','.join(READINGS)})")
    parser.add_argument("--ce-docs", type=positive_int, default=32, help="held-out documents of the reconstruction part")
    parser.add_argument("--absorption-words", type=positive_int, default=2000, help="vocabulary tokens of absorption")
    parser.add_argument("--probe-candidates", type=count, default=16,
                        help="quality part: concepts per class screened for the probe (0: every concept)")
    parser.add_argument("--concept-top", type=count, default=5,
                        help="probing: latents per task scored alone, for the atlas's concept pages (0: none)")
    parser.add_argument("--seed", type=seed, default=0, help="which documents are drawn")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write RUN_DIR/eval.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--synthetic-seeds", type=positive_int, default=3,
                        help="synthetic part: fits per extractor (seeds 0..N-1; intervals over them)")
    parser.add_argument("--synthetic-steps", type=positive_int, default=SyntheticConfig.steps,
                        help="synthetic part: training batches of 1024 rows per fit")


def _sets(run_dir: str, names: str | None) -> tuple[dict, dict[str, Path]]:
    """name -> ConceptSet, and name -> its folder."""
    from conceptlens.commands._common import check_one_site
    from conceptlens.evaluate.activations import concept_set_names, load_concepts
    from conceptlens.fit_keys import cross_layer

    found = concept_set_names(run_dir)
    if found:
        wanted = found if names is None else [n.strip() for n in names.split(",") if n.strip()]
        folders = {name: Path(run_dir) / "concepts" / name for name in wanted}
    else:  # a set's own folder
        folders = {Path(run_dir).name: Path(run_dir)}
    sets = {name: load_concepts(run_dir, name if found else None) for name in folders}
    for name in [n for n, cs in sets.items() if cross_layer(cs.config.get("fit"))]:  # the suites read one site
        if names is not None or not found:
            raise ValueError(f"{name} reads other sites than its directions' (a transcoder or crosscoder); the "
                             "suites evaluate sets of one site")
        print(f"not evaluating {name}: it reads other sites than its directions' (a transcoder or crosscoder)")
        del sets[name]
    for name, cs in sets.items():
        check_one_site(cs.site, folders[name], cs.method, "eval")
    if not sets:
        raise ValueError(f"{run_dir} holds no set of one site to evaluate (found {', '.join(found)})")
    return sets, {name: folders[name] for name in sets}


def run(args: argparse.Namespace) -> int:
    suites = tuple(s for s in args.suite if s != "synthetic")
    if suites and args.run_dir is None:
        raise ValueError(f"--suite {','.join(suites)} needs a RUN_DIR (only the synthetic part runs without one)")
    if "absorption" in suites:
        from conceptlens.evaluate.absorption import MIN_WORDS

        if args.absorption_words < MIN_WORDS:  # before the model loads
            raise ValueError(f"--absorption-words {args.absorption_words}: absorption needs at least {MIN_WORDS} "
                             "words (a fifth of them test the letter probes)")
    if suites and not args.no_save:  # the folder eval.json goes to: writable, and no other writer, from the start
        import os

        from conceptlens.runlock import lock

        if not os.access(args.run_dir, os.W_OK):
            raise PermissionError(f"{args.run_dir} is not writable, so eval.json could not be saved: pass --no-save "
                                  "to print only")
        with lock(args.run_dir, "eval", create=False):
            _run_folder(args, suites)
    elif suites:
        _run_folder(args, suites)
    if "synthetic" in args.suite:
        _synthetic(args)
    return 0


def _synthetic(args: argparse.Namespace) -> None:
    from conceptlens.evaluate.lines import format_lines
    from conceptlens.evaluate.synthetic import synthetic_lines

    config = SyntheticConfig(seeds=tuple(range(args.synthetic_seeds)), steps=args.synthetic_steps)
    print(f"\n## synthetic (SAELens's generator: {config.num_features} features in {config.hidden_dim} dims, "
          f"{config.steps} batches of {config.batch_size} per fit; 95% intervals: Student's t over "
          f"{len(config.seeds)} seeds)", flush=True)
    wall, cpu = time.perf_counter(), time.process_time()
    lines = synthetic_lines(config, progress=None if args.no_progress else print)
    took = f"{time.perf_counter() - wall:.0f} s wall, {time.process_time() - cpu:.0f} s CPU"
    print(f"\n### synthetic ({took})\n\n{format_lines(lines)}", flush=True)


def _model_name(args: argparse.Namespace, sets: dict, recorded: Any = "read") -> str:
    """--model, else the model a run folder's run.toml loaded (`recorded`, as `_recorded` reads it, or
    read here: a local folder or .gguf, which the sets name only by its last component), else the one
    model the sets name."""
    if recorded == "read":
        recorded = _recorded(run_folder.run_of(Path(args.run_dir)))
    if args.model:
        return args.model
    if recorded is not None:
        return recorded["model"]
    models = {cs.model for cs in sets.values()}
    unnamed = [name for name, cs in sets.items() if cs.model is None]
    if unnamed:
        raise ValueError(f"{unnamed[0]}: {sets[unnamed[0]]} names no model; pass --model")
    if len(models) > 1:
        raise ValueError(f"the sets name different models {sorted(models)}; pass --model")
    return models.pop()


def _fit_read(run_dir: Path) -> tuple[str, int | None, int] | None:
    """`SuiteConfig.fit_read` of a run folder whose fit read a labelled set the probes use, any split
    (its run.toml's data and shuffle, its fit_report.json's documents), else None."""
    from conceptlens.commands.describe import fit_documents

    run_dir = run_folder.run_of(run_dir)  # a set folder of a run: the run's fit
    recorded, report = _recorded(run_dir), run_dir / "fit_report.json"
    if recorded is None or recorded["data"] is None or not report.is_file():
        return None
    name, _, split = recorded["data"].partition(":")
    if name not in PROBE_TASKS or Path(recorded["data"]).is_file():
        return None
    return recorded["data"], recorded["shuffle"], fit_documents(report)  # as the fit read it: None is the stored order


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    """What eval reads of a run folder's run.toml (None: it has none): its model (a name), data (a
    name), shuffle (`shuffle_seed`) and the model's dtype, each checked; a one-line ValueError naming the file."""
    from conceptlens.commands import run_config as rc

    path = run_dir / "run.toml"
    if not path.is_file():
        return None
    raw = rc.read_toml(path)
    try:
        for key in ("model", "data"):
            if key in raw or key == "model":
                if not isinstance(raw.get(key), str) or not raw[key].strip():
                    raise ValueError(f"{key} must be a name (a non-empty string); got {raw.get(key)!r}")
        return {"model": raw["model"], "data": raw.get("data"), "shuffle": rc.shuffle_seed(raw),
                "dtype": rc.model_dtype(raw)}
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _run_folder(args: argparse.Namespace, suites: tuple[str, ...]) -> None:
    import conceptlens
    from conceptlens.batching import check_max_length
    from conceptlens.commands._common import load_model
    from conceptlens.evaluate import results
    from conceptlens.evaluate.bootstrap import DRAWS

    config = SuiteConfig(suites=suites, tasks=args.tasks, max_docs=args.max_docs, max_length=args.max_length,
                         batch_size=args.batch_size, max_classes=args.max_classes, recon_docs=args.ce_docs,
                         absorption_words=args.absorption_words, ks=args.ks, random_draws=args.random_draws,
                         readings=args.probe_read,
                         probe_candidates=args.probe_candidates or None, concept_top=args.concept_top, seed=args.seed,
                         fit_read=_fit_read(Path(args.run_dir)), progress=not args.no_progress)
    sets, folders = _sets(args.run_dir, args.concepts)
    for name, cs in sets.items():
        if cs.site is None:
            raise ValueError(f"{name}: {cs} names no site; set cs.site and save it again")
        if ("probing" in suites or "quality" in suites) and max(args.ks) > len(cs) and tuple(args.ks) != KS:
            raise ValueError(f"--ks {max(args.ks)} is more latents than {name} has ({len(cs)}): a k-sparse probe "
                             f"chooses k of them; give ks up to {len(cs)}")
    fewest = min(len(cs) for cs in sets.values())
    if tuple(args.ks) == KS and max(KS) > fewest:  # the defaults: those a set of `fewest` latents can take
        config = dataclasses.replace(config, ks=tuple(k for k in KS if k <= fewest) or (1,))
    recorded = _recorded(run_folder.run_of(Path(args.run_dir)))
    model_name = _model_name(args, sets, recorded)
    if not args.no_save:  # before the model loads: its parts could not be saved (--no-save saves none)
        results.check_file(args.run_dir, model_name)
    model, tok = load_model(args, model_name, recorded["dtype"] if recorded and not args.model else None)  # the run's
    check_max_length(model, args.max_length, "--max-length", tok)
    lens = conceptlens.attach(model, tok)
    by_site: dict[str, dict] = {}
    for name, cs in sets.items():
        site = lens.site(cs.site)
        width = math.prod(int(s) for s in site.shape[2:])
        if width != cs.d:
            raise ValueError(f"{name} has width {cs.d} but {site.name} has width {width}")
        by_site.setdefault(site.name, {})[name] = cs
    probes = any(part in config.suites for part in ("probing", "quality"))  # the parts with a random control
    print(f"95% intervals: bootstrap over held-out documents ({DRAWS} replicates)"
          + (f"; the random control pools its {args.random_draws} draws" if probes else "")
          + f". Suites: {', '.join(config.suites)}.")
    if config.fit_read is not None and probes:
        print(f"Probes neither learn nor are scored on any of the {config.fit_read[2]:,} {config.fit_read[0]} "
              "documents the fit read.")
    for site_name, group in by_site.items():
        _run_site(args, lens, tok, model_name, site_name, group, folders, config)


def _run_site(args: argparse.Namespace, lens, tok, model_name: str, site: str, group: dict, folders: dict[str, Path],
              config: SuiteConfig) -> None:
    """Every part on the sets of one site: print each part's table as it finishes, and save it."""
    from conceptlens.evaluate import results
    from conceptlens.evaluate.activations import concept_encoder
    from conceptlens.evaluate.lines import format_lines, verdict
    from conceptlens.evaluate.suite import part_config, run_parts

    kinds = {n: concept_encoder(cs).kind for n, cs in group.items()}
    print(f"\n## {site}\n\nconcept activations: {'; '.join(f'{n}: {k}' for n, k in kinds.items())}", flush=True)
    infos = {n: results.set_info(cs, folders[n], site, kinds[n]) for n, cs in group.items()}
    wall, cpu = time.perf_counter(), time.process_time()
    for part, all_lines in run_parts(lens, tok, group, config):
        took = f"{time.perf_counter() - wall:.0f} s wall, {time.process_time() - cpu:.0f} s CPU"
        lines = [ln for ln in all_lines if ln.concept is None]  # per-concept scores: saved, for the concept pages
        footer = f"\n\n{len(all_lines) - len(lines)} per-concept scores" if len(lines) < len(all_lines) else ""
        if not args.no_save:
            part_info = results.Part(model_name, infos, site, part, part_config(config, part),
                                     time.perf_counter() - wall)
            where = results.save_part(args.run_dir, part_info, all_lines, results.interval_text(config.random_draws))
            hint = f"; `conceptlens report {args.run_dir}` shows them" if (where.parent / "describe").is_dir() else ""
            footer = (footer or "\n") + f"\nsaved in {where}{hint}"
        print(f"\n### {part} ({took})\n\n{format_lines(lines)}{footer}", flush=True)
        wall, cpu = time.perf_counter(), time.process_time()
        losses = [f"{ln.extractor} {ln.metric}" for ln in lines if verdict(ln) == "loses"
                  and " minus " not in ln.metric]  # paired steering lines: against their row, printed below
        if losses:
            print(f"\nloses to its matched control (intervals apart): {'; '.join(losses)}", flush=True)
        if part == "steering":
            from conceptlens.evaluate.steering import against_diff_of_means

            print(f"\nsteering against the supervised vector (AxBench found SAEs lose to it):\n"
                  f"{against_diff_of_means(lines)}", flush=True)

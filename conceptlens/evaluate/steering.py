"""The `steering` part of the suite, AxBench-style: can a set's best concept for a label steer
unrelated prompts toward it, next to a diff-of-means vector, a random direction and a prompt?

    lines = steering_lines(lens, tok, site, {"topk": cs}, SteeringConfig())

Labels: every bbc-news topic, and positive and negative of movie-polarity. Per label:
- **the set's concept** with the largest difference of mean activation between the label's
  documents and the others, on `train_docs` documents of the train split only (their first
  `train_length` tokens; documents are
  read as mean activations over their tokens, the probing part's reading via `concept_encoder`);
  it steers along its direction (centred when the set carries a mean, as the demo does);
- **diff-of-means**: mean site activation of the label's documents minus the others', same documents;
- **random**: one seeded Gaussian direction;
- **prompt prefix**: no edit, the prompts prefixed with "Write about LABEL. " (topics) or
  "Write something LABEL. " (sentiment).
Each direction is swept over `alphas` (in robust norms, `Add(..., scale="robust_norm")`) with
`steering.compare.compare`; the judge (`steering.judge.TopicJudge`: logistic regression on
mean-pooled MiniLM embeddings, not the steered model) is trained on `judge_tokens` tokens of
train-split documents the concepts are not chosen on, and its accuracy is measured on `judge_docs`
test-split documents, whole and those of the continuations' length (lines of their own); the
score is the judge's mean P(label) over the prompts at the best alpha within the fluency budget
(at least half the continuations within 2x the unsteered continuations' median perplexity under
the unsteered model and with at most half their token 3-grams repeated, `best_within_budget`),
with a bootstrap interval over prompts at that alpha. A direction leaves the sweep at its first
alpha over the budget. The alpha is chosen
on the same prompts, which flatters every swept row alike (not the prefix row).
Every row is judged on the same prompts, so each set's row also gets its difference to the
diff-of-means row and to the random row (each at its own best alpha) with a paired bootstrap: a
replicate draws the prompts once for both rows. Its verdict (against no difference) says whether
the concept steers worse than, like, or better than that row outside the interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from conceptlens.evaluate import activations as act
from conceptlens.evaluate.bootstrap import Estimate, bootstrap, paired_difference
from conceptlens.evaluate.lines import Line, verdict
from conceptlens.evaluate.results import JUDGE
from conceptlens.interface import AttachedModel
from conceptlens.steering.compare import PROMPTS, compare

TASKS = {"bbc-news": "Write about {}. ", "movie-polarity": "Write something {}. "}
"""Labelled sets whose labels are steered toward, and the prompting baseline's prefix."""
PAIRED = ("diff-of-means", "random")
"""Rows each set's row is compared with, paired over the prompts."""
NAN = Estimate(math.nan, math.nan, math.nan)


@dataclass
class SteeringConfig:
    prompts: tuple[str, ...] = PROMPTS
    alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)
    """alpha 1 is word salad for most directions on SmolLM2 (perplexity in the thousands); 2 was never reached"""
    max_new_tokens: int = 12
    train_docs: int = 160
    """train-split documents the best concept and the diff-of-means vector are chosen on"""
    train_length: int = 64
    """tokens read of each of them (a label's mean needs no more; their forwards cost as much as the sweeps)"""
    judge_tokens: int = 40_000
    """judge-encoder tokens of train-split text (documents the concepts are not chosen on, each cut to
    `max_length`) the judge is fitted on: ~310 BBC articles, ~1450 movie-review sentences (fitted on
    200 sentences its held-out accuracy was 0.635)"""
    judge_docs: int = 300
    """test-split documents the judge is scored on"""
    short_tokens: int = 16
    """the judge is also scored on held-out texts of at most this many tokens: the continuations' length"""
    judge_model: str = "minilm-l6"
    max_length: int = 128
    batch_size: int = 16
    seed: int = 0


def select_concepts(train: act.Probed, label: int) -> dict[str, int]:
    """Per set, the concept whose document-mean activation is highest on `label`'s documents
    relative to the others' (mean difference, signed): read from train-split rows only."""
    pos = train.y == label
    return {name: int((z[pos].double().mean(0) - z[~pos].double().mean(0)).argmax()) for name, z in train.z.items()}


def diff_of_means(train: act.Probed, label: int) -> torch.Tensor:
    """Mean document activation of `label`'s train documents minus the others'."""
    pos = train.y == label
    return (train.x[pos].double().mean(0) - train.x[~pos].double().mean(0)).float()


def steer_direction(cs: Any, j: int) -> torch.Tensor:
    """Concept `j` of `cs` as it steers: centred where the set carries a mean."""
    return (cs.centred() if cs.mean is not None else cs).directions[j]


def _per_prompt(row: dict[str, Any]) -> torch.Tensor | None:
    """`(prompts, 2)` judged score and 1 per prompt at the row's best alpha within the budget (0, 0
    for an empty continuation); None when no alpha is within it."""
    if row["best"] is None:
        return None
    scores = torch.tensor(row["scores"][row["alphas"].index(row["best"][0])], dtype=torch.float64)
    return torch.stack([scores.nan_to_num(0.0), (~scores.isnan()).double()], 1)


def _mean(t: torch.Tensor) -> torch.Tensor:
    return t[..., 0] / t[..., 1]


def _at_best(row: dict[str, Any], seed: int) -> Estimate:
    """The row's mean judged score at its best alpha within the budget, with a bootstrap over prompts."""
    per_prompt = _per_prompt(row)
    return NAN if per_prompt is None else bootstrap(per_prompt, _mean, seed=seed)


def _paired(row: dict[str, Any], base: dict[str, Any], seed: int) -> Estimate:
    """The row's score minus `base`'s, each at its own best alpha, with a paired bootstrap over the prompts."""
    a, b = _per_prompt(row), _per_prompt(base)
    return NAN if a is None or b is None else paired_difference(a, b, _mean, seed=seed)


def _paired_line(name: str, metric: str, base: str, diff: Estimate, prompts: int) -> Line:
    """A set's row minus a baseline row, against no difference: its verdict is the paired interval's."""
    said = {"wins": "better than", "loses": "worse than", "overlaps": "like"}
    line = Line(name, f"{metric} minus {base}", diff, [("no difference", Estimate(0.0, 0.0, 0.0))])
    how = said.get(verdict(line), "not comparable with")  # nan: a row over the budget at every alpha
    return line._replace(note=f"steers {how} {base} (paired bootstrap over the {prompts} prompts)")


def _judge(task: str, encoder: Any, encoder_tok: Any, tok: Any, chosen_on: list[int],
           config: SteeringConfig) -> tuple[Any, list[Line]]:
    """The task's judge, fitted on train-split documents the concepts are not chosen on, nor copies of
    them (up to `judge_tokens` encoder tokens), and its accuracy on held-out test-split documents: whole, and
    those of at most `short_tokens` tokens of the steered model (the continuations' length; their
    openings where fewer than 50 are that short)."""
    from conceptlens import data
    from conceptlens.steering.judge import TopicJudge

    train, test = data.load(task, "train"), data.load(task, "test")
    skip, fit, used = {train.texts[i] for i in chosen_on}, [], 0  # by text: a set may repeat a document
    for i in act.pick(len(train), len(train), config.seed + 1):
        if train.texts[i] not in skip and used < config.judge_tokens:
            fit.append(i)
            used += len(encoder_tok(train.texts[i], truncation=True, max_length=config.max_length)["input_ids"])
    name = lambda full, i: full.label_names[act.label_of(full, i, False)]  # noqa: E731
    judge = TopicJudge(encoder, encoder_tok, [train.texts[i] for i in fit], [name(train, i) for i in fit],
                       max_length=config.max_length, seed=config.seed)
    learnt = {train.texts[i] for i in fit}  # a test document that repeats one the judge learned on is not held out
    held = act.pick_unread(test, config.judge_docs, config.seed + 1, learnt)
    ids = {i: tok(test.texts[i], add_special_tokens=False)["input_ids"] for i in held}
    short = [i for i in held if len(ids[i]) <= config.short_tokens]
    kind = f"the {len(short)} of at most {config.short_tokens} tokens"
    if len(short) < 50:
        short, kind = held, f"their first {config.short_tokens} tokens"
    texts = {"whole": [test.texts[i] for i in held],
             "short": [tok.decode(ids[i][:config.short_tokens]) for i in short]}
    labels = {"whole": [name(test, i) for i in held], "short": [name(test, i) for i in short]}
    lines = []
    for part, metric, note in (("short", f"{task} judge held-out accuracy, texts of the continuations' length",
                                f"{len(held)} held-out test-split docs, {kind}"),
                               ("whole", f"{task} judge held-out accuracy", f"{len(held)} held-out test-split docs")):
        right = torch.tensor(judge.classifier.predict(judge.embed(texts[part])) == labels[part], dtype=torch.float64)
        accuracy = bootstrap(torch.stack([right, torch.ones_like(right)], 1), lambda t: t[..., 0] / t[..., 1],
                             seed=config.seed)
        lines.append(Line(JUDGE, metric, accuracy, [], f"{config.judge_model} mean-pooled, logistic regression "
                          f"fitted on {len(fit)} train-split docs ({used} tokens); {note}"))
    return judge, lines


def steering_lines(lens: AttachedModel, tok: Any, site: str, sets: Mapping[str, Any], config: SteeringConfig,
                   record: list | None = None) -> list[Line]:
    """Per label of `TASKS`, one line per set: its best concept's judged score within the fluency
    budget next to random, diff-of-means and prompt-prefix rows; and each judge's own accuracy.
    `record`, when given, receives (task, label, judge, compare's rows) per label."""
    from conceptlens import data, models
    from conceptlens.steering.prompt_cache import PromptCache
    from conceptlens.steering.units import robust_norm

    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    norm = robust_norm(lens, site)
    prompts = PromptCache(lens.model, tok, config.prompts)  # one unsteered forward for every label
    encoders = {name: act.concept_encoder(cs) for name, cs in sets.items()}
    hidden = next(iter(sets.values())).d
    encoder, encoder_tok = models.load(config.judge_model)
    lines = []
    for task, prefix in TASKS.items():
        full = data.load(task, "train")
        picked = act.pick(len(full), config.train_docs, config.seed)
        judge, accuracy = _judge(task, encoder, encoder_tok, tok, picked, config)
        lines.extend(accuracy)
        batches = act.task_batches(tok, [full.texts[i] for i in picked],
                                   [act.label_of(full, i, False) for i in picked], token_level=False, tag_ids={},
                                   batch_size=config.batch_size, max_length=config.train_length)
        train = act.collect(lens, site, encoders, batches)
        for c, label in enumerate(full.label_names):
            if not 0 < int((train.y == c).sum()) < len(train.y):
                continue  # a label absent from (or alone in) the drawn documents has no difference to follow
            chosen = select_concepts(train, c)
            directions = {f"{name}:{j}": steer_direction(sets[name], j) for name, j in chosen.items()}
            directions["diff-of-means"] = diff_of_means(train, c)
            g = torch.Generator().manual_seed(3_000_017 + config.seed + c)
            directions["random"] = torch.randn(hidden, generator=g)
            rows = compare(lens, tok, site, norm, directions, judge.topic(label), label, prompts,
                           config.alphas, config.max_new_tokens, prefix=prefix.format(label))
            if record is not None:
                record.append((task, label, judge, rows))
            lines.extend(label_lines(task, label, {name: (j, f"{name}:{j}") for name, j in chosen.items()}, rows,
                                     config.seed))
    return lines


def label_lines(task: str, label: str, chosen: Mapping[str, tuple[int, str]], rows: list[dict[str, Any]],
                seed: int, how: str = "") -> list[Line]:
    """The lines of one label from `compare`'s rows (the concepts' rows, "diff-of-means", "random",
    then the prompt-prefix row last): per set of `chosen` (set -> (concept, its row's name)), its
    concept's score next to the random, diff-of-means and prefix rows, its paired differences to the
    `PAIRED` rows, and these lines again for that concept's page (`concept=`). `how`: how the
    concept and the random direction were chosen, said in the note."""
    found = {r["row"]: (r, _at_best(r, seed)) for r in rows}
    prompts = len(rows[0]["scores"][0])
    unsteered = rows[0]["p"][rows[0]["alphas"].index(0.0)] if 0.0 in rows[0]["alphas"] else float("nan")
    bases = [("random direction", found["random"][1]), ("diff-of-means", found["diff-of-means"][1]),
             ("prompt prefix", _at_best(rows[-1], seed))]
    dom = found["diff-of-means"][0]["best"]
    lines = []
    for name, (j, key) in chosen.items():
        row, est = found[key]
        at = "over budget" if row["best"] is None else f"alpha {row['best'][0]:g}"
        metric = f"steer {task} {label}: P({label})"
        line = Line(name, metric, est, bases, f"concept {j} at {at}; diff-of-means at "
                    f"{'over budget' if dom is None else f'alpha {dom[0]:g}'}; unsteered {unsteered:.3f}; "
                    f"intervals: bootstrap over the {prompts} prompts" + (f"; {how}" if how else ""))
        paired = [_paired_line(name, metric, base, _paired(row, found[base][0], seed), prompts) for base in PAIRED]
        lines += [line, *paired, *(ln._replace(concept=j) for ln in (line, *paired))]
    return lines


def against_diff_of_means(lines: list[Line]) -> str:
    """One plain sentence per set: on how many labels its concept steers worse than, like, or better
    than the label's diff-of-means vector by the paired 95% interval over the prompts (AxBench found
    SAEs steer worse), and on how many its point value is lower. Labels where a row is over the
    budget at every alpha are left out. Empty without steering lines."""
    tally: dict[str, list[int]] = {}
    for ln in lines:
        if ln.concept is not None:
            continue  # a concept page's copy of its set's line
        if not (ln.metric.startswith("steer ") and ln.metric.endswith(" minus diff-of-means")):
            continue
        if verdict(ln):  # a set comparable on no label gets no sentence
            counts = tally.setdefault(ln.extractor, [0, 0, 0, 0])  # worse, like, better; lower point value
            counts[("loses", "overlaps", "wins").index(verdict(ln))] += 1
            counts[3] += ln.value.value < 0
    said = []
    for name, (worse, like, better, lower) in tally.items():
        overall = ("where the intervals tell them apart, it steers worse than the supervised vector" if worse > better
                   else "where the intervals tell them apart, it steers better than the supervised vector"
                   if better > worse else "neither steers better where the intervals tell them apart")
        said.append(f"{name}: its chosen concept steers worse than diff-of-means on {worse} of {worse + like + better} "
                    f"labels, like it on {like}, better on {better} (paired 95% intervals over the prompts; lower on "
                    f"{lower} by the point value): {overall}")
    return "\n".join(said)

"""A topic judge that is not the steered model: a logistic-regression classifier on mean-pooled
sentence-encoder embeddings, usable as `sweep(..., judge=...)`.

    encoder, enc_tok = conceptlens.models.load("minilm-l6")
    news = conceptlens.data.load("bbc-news", "train")
    judge = TopicJudge(encoder, enc_tok, news.texts, news.labels)
    judge.accuracy(test.texts, test.labels)                 # held-out accuracy
    result = sweep(lens, edit, alphas, prompts, score, judge=judge.topic("sports"))
    result.judged["P(sports)"]                              # (A, P) P(topic) of each continuation
    best_within_budget(result, "P(sports)")                 # (alpha, mean P) among the fluent alphas

The judge reads only the continuation (not the prompt), so a prompt that names the topic does
not score by itself.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import torch

from conceptlens.batching import encode_batch
from conceptlens.devices import input_device

if TYPE_CHECKING:
    from conceptlens.steering.sweep import Generation, SweepResult


class TopicJudge:
    """P(topic | text) from a logistic regression (scikit-learn, default L2) on the encoder's
    last hidden state averaged over the text's tokens (padding excluded), texts cut to
    `max_length` tokens. Any Hugging Face encoder or decoder serves as `encoder`."""

    def __init__(self, encoder: Any, tokenizer: Any, texts: Sequence[str], labels: Sequence[Any], *,
                 max_length: int = 128, batch_size: int = 32, seed: int = 0) -> None:
        from sklearn.linear_model import LogisticRegression

        if len(texts) != len(labels) or len(set(labels)) < 2:
            raise ValueError(f"TopicJudge needs as many labels as texts and at least two classes; got "
                             f"{len(texts)} texts, {len(labels)} labels, {len(set(labels))} classes")
        self.encoder, self.tokenizer = encoder, tokenizer
        self.max_length, self.batch_size = max_length, batch_size
        self.classifier = LogisticRegression(max_iter=2000, random_state=seed)
        self.classifier.fit(self.embed(texts), np.asarray(labels))
        self.classes: list[Any] = list(self.classifier.classes_)

    @torch.no_grad()
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(n, d) float64 mean-pooled last hidden states; batches of texts of similar length (little padding)."""
        device = input_device(self.encoder)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        rows = []
        for start in range(0, len(texts), self.batch_size):
            batch = encode_batch(self.tokenizer, [texts[i] or " " for i in order[start:start + self.batch_size]],
                                 self.max_length)
            out = self.encoder(**{k: v.to(device) for k, v in batch.items()}, output_hidden_states=True)
            hidden = out.hidden_states[-1].double().cpu()  # (B, T, d)
            mask = batch["attention_mask"].double()[..., None]
            rows.append((hidden * mask).sum(1) / mask.sum(1).clamp_min(1))
        if not rows:
            return np.zeros((0, self.encoder.config.hidden_size))
        return torch.cat(rows)[torch.argsort(torch.tensor(order))].numpy()

    def probabilities(self, texts: Sequence[str]) -> np.ndarray:
        """(n, classes) P(class | text), columns in `self.classes` order."""
        return self.classifier.predict_proba(self.embed(texts))

    def accuracy(self, texts: Sequence[str], labels: Sequence[Any]) -> float:
        """Share of `texts` whose most probable class is their label."""
        return float(np.mean(self.classifier.predict(self.embed(texts)) == np.asarray(labels)))

    def topic(self, topic: Any) -> Callable[[Sequence[Generation]], Mapping[str, list[float]]]:
        """A sweep judge: generations -> {"P(topic)": per-prompt probability of `topic`}
        (nan for an empty continuation)."""
        if topic not in self.classes:
            raise ValueError(f"{topic!r} is not a class of the judge; choose one of "
                             f"{', '.join(map(str, self.classes))}")
        column = self.classes.index(topic)

        def judge(generations: Sequence[Generation]) -> Mapping[str, list[float]]:
            texts = [g.text for g in generations]
            p = self.probabilities(texts)[:, column]
            return {f"P({topic})": [float(v) if t.strip() else math.nan for v, t in zip(p, texts)]}
        return judge


def best_within_budget(result: SweepResult, name: str) -> tuple[float, float] | None:
    """(alpha, mean judged score) of the alpha with the highest mean `result.judged[name]` among
    the alphas within the fluency budget: those between 0 and each side's `best_alpha` walk (every
    alpha of a sign fluent up to it, 0 included). None without fluency or when no alpha is fluent."""
    if result.judged is None or name not in result.judged:
        raise ValueError(f"the sweep has no judged score {name!r}; it has {sorted(result.judged or {})}")
    fluent = result.fluent
    if fluent is None:
        return None
    means = result.judged[name].nanmean(1).nan_to_num(nan=-math.inf)  # an all-empty alpha never wins
    best = None
    for sign in (1.0, -1.0):
        for i in sorted((i for i, a in enumerate(result.alphas) if a * sign >= 0), key=lambda i: abs(result.alphas[i])):
            if not fluent[i]:
                break
            if best is None or float(means[i]) > float(means[best]):
                best = i
    return None if best is None else (result.alphas[best], float(result.judged[name][best].nanmean()))

"""Claim (CLVQ-VAE, 003): ablating a code's direction hurts a downstream probe far more than a
random direction does.

Paper (RoBERTa / ERASER movie reviews, CLS representation): probe accuracy drops by up to 93.2%
when code directions are removed, against a random-direction control.

    python reproductions/vq_ablation.py              # about 5 minutes on 2 cores

Setting here: SmolLM2 block 15, movie-polarity (2 classes) and bbc-news (5 topics) document
means. A VQ codebook (K = 64, EMA, top-5 sampling) is fitted on the tokens of the training
documents; a multinomial logistic probe on clean training document means. On the test
documents we project out the span of n codes (the n most used, n = 1, 2, 4) and compare the
probe's accuracy drop with three controls of the same rank (mean over 20 draws):
isotropic random directions (the usual control), n random codes of the same codebook
(matched: codes share the activation mean), and the same n codes centred (code - mean).

CLVQ (`clvq` argument, or all): a CLVQTranscoder (K = 64, MLP decoder) from block 10 to block
15 on the same training tokens, 8 passes. Its codes live in the encoder's z_e space, so the
probe is fitted on z_e of the block-10 document means (the paper's CLS-like representation run
through the encoder), and the codes are projected out of z_e of the test documents; same
controls. The usage order comes from the codes' assignments of the training tokens.
"""

from __future__ import annotations

import sys

import torch

from _common import Clock, activations, cached, report, threads, token_rows

from conceptlens.concepts.clvq import CLVQTranscoder
from conceptlens.concepts.vq import VQCodebook
from conceptlens.metrics.faithfulness import fit_probe, probe_scores, random_orthonormal


def project_out(x: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    q = torch.linalg.qr(directions.double().T).Q  # (d, n) orthonormal span
    x = x.double()
    return (x - (x @ q) @ q.T).float()


def _train_tokens(task: str, n_docs: int, site: str = "blocks.15.resid_out") -> torch.Tensor:
    from conceptlens import data
    from conceptlens.evaluate.activations import pick

    texts = data.load(task, "train")
    picked = pick(len(texts), n_docs, 0)
    x, _ = token_rows("smollm2-135m", [texts.texts[i] for i in picked], site, max_length=128)
    return x


def ablation_rows(name: str, codes: torch.Tensor, usage: torch.Tensor, mean: torch.Tensor, train, test,
                  g: torch.Generator) -> list[tuple]:
    """Accuracy drops of the probe when the n most used codes, n random codes, n isotropic
    directions (means over 20 draws) or the n centred codes are projected out of test.x."""
    probe = fit_probe(train.x, train.y)
    clean = probe_scores(probe, test.x, test.y)["accuracy"]

    def drop(directions: torch.Tensor) -> float:
        return clean - probe_scores(probe, project_out(test.x, directions), test.y)["accuracy"]

    rows, used = [], usage.argsort(descending=True)
    for n in (1, 2, 4):
        top = codes[used[:n]]
        iso = [drop(random_orthonormal(n, codes.shape[1], g)) for _ in range(20)]
        rand = [drop(codes[torch.randperm(len(codes), generator=g)[:n]]) for _ in range(20)]
        rows.append((name, n, clean, drop(top), sum(iso) / 20, sum(rand) / 20, drop(top - mean)))
    return rows


def vq_rows(task: str, g: torch.Generator) -> list[tuple]:
    train = activations("smollm2-135m", task, "train", "blocks.15.resid_out", max_docs=300)
    test = activations("smollm2-135m", task, "test", "blocks.15.resid_out", max_docs=150)
    tokens = cached("train-tokens", _train_tokens, task=task, n_docs=150)
    vq = VQCodebook(64, seed=0)
    for chunk in tokens[torch.randperm(len(tokens), generator=g)].split(2048):
        vq.update(chunk)
    vq.flush()
    codes = vq.codes.float()
    usage = torch.bincount(vq.assign(tokens), minlength=len(codes))
    return ablation_rows(f"VQ {task}", codes, usage, tokens.mean(0), train, test, g)


@torch.no_grad()
def _z_e(tc: CLVQTranscoder, split):
    return type(split)(tc.encoder(split.x.float()), split.y)


def clvq_rows(task: str, g: torch.Generator) -> list[tuple]:
    src_site = "blocks.10.resid_out"
    train = activations("smollm2-135m", task, "train", src_site, max_docs=300)
    test = activations("smollm2-135m", task, "test", src_site, max_docs=150)
    src = cached("train-tokens", _train_tokens, task=task, n_docs=150, site=src_site)
    tgt = cached("train-tokens", _train_tokens, task=task, n_docs=150)
    tc = CLVQTranscoder(64, seed=0)
    for _ in range(8):
        order = torch.randperm(len(src), generator=g)
        for a, b in zip(src[order].split(2048), tgt[order].split(2048)):
            tc.update(a, b)
    tc.flush()
    codes = tc.vq.codes.float()
    with torch.no_grad():
        z = tc.encoder(src)
    usage = tc.encode(src).sum(0)
    print(f"  CLVQ {task}: target FVU {tc.stats().fvu:.3f}, encoder mix {tc.stats().mix:.3f}", flush=True)
    return ablation_rows(f"CLVQ {task} (z_e)", codes, usage, z.mean(0), _z_e(tc, train), _z_e(tc, test), g)


def main() -> None:
    threads(2)
    clock, rows = Clock(), []
    g = torch.Generator().manual_seed(0)
    only = sys.argv[1:]  # "vq" and/or "clvq": run those parts only
    for task in ("movie-polarity", "bbc-news"):
        for part, fn in (("vq", vq_rows), ("clvq", clvq_rows)):
            if not only or part in only:
                rows += fn(task, g)
                print(f"[{clock}] {part} {task} done", flush=True)
    report("probe accuracy drop when n code directions are projected out (test documents)", rows,
           ("codes", "n", "clean acc", "top codes", "isotropic ctrl", "random-codes ctrl", "centred top codes"))
    print(f"\ntotal {clock}")


if __name__ == "__main__":
    main()

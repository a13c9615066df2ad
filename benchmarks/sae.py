"""TopK SAE training: ours vs a minimal PyTorch step vs SAELens, on the same batches.

    python benchmarks/sae.py [--steps 12] [--distinct 6] [--batch 4096] [--k 32] [--threads 1]

Activations: SmolLM2-135M block-15 residuals of BBC News articles (first position and
tokens above 10x the median norm dropped), or Gaussian d=576 if the model or articles are
not installed. Width 8d. Every implementation gets the same batches (the `--distinct` captured
ones, cycled) and the same Adam learning rate; steps are interleaved so that machine load
hits all alike, and the first step (initialisation) is not timed. Prints tokens/s and the
held-out FVU after the same number of tokens, each as a ratio to ours. SAELens runs when
`sae_lens` is importable (it is not a dependency: use a separate environment).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from typing import Callable

import torch

from conceptlens.concepts.sae import TopKSAE
from conceptlens.concepts.sae.topk import topk_relu


def bbc_block15(n_tokens: int) -> torch.Tensor:
    """Block-15 residuals of BBC News articles, at least `n_tokens` rows after filtering."""
    import conceptlens
    from conceptlens import data, models

    texts = data.load("bbc-news", split="all").texts[::7]  # spread over the five topics
    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    rows, count = [], 0
    with torch.inference_mode(), lens.capture("blocks.15.resid_out") as cap:  # stops after block 15
        for i in range(0, len(texts), 8):
            batch = tok(texts[i:i + 8], return_tensors="pt", padding=True, truncation=True, max_length=256)
            captured, meta = cap.forward(**batch)
            acts = captured["blocks.15.resid_out"][meta.position > 0]  # the first token is an attention sink
            norms = acts.norm(dim=1)
            rows.append(acts[norms < 10 * norms.median()])
            count += rows[-1].shape[0]
            if count >= n_tokens:
                break
    x = torch.cat(rows).clone()  # a normal tensor, not an inference-mode one
    if x.shape[0] < n_tokens:
        raise RuntimeError(f"only {x.shape[0]} tokens captured; wanted {n_tokens}")
    return x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))][:n_tokens]


def activations(n_tokens: int) -> tuple[torch.Tensor, str]:
    try:
        return bbc_block15(n_tokens), "SmolLM2-135M blocks.15.resid_out over BBC News"
    except (ImportError, OSError, RuntimeError, KeyError, ValueError) as err:
        g = torch.Generator().manual_seed(0)
        return 1.0 + torch.randn(n_tokens, 576, generator=g), f"Gaussian d=576 ({type(err).__name__}: {err})"


class Minimal:
    """The shortest faithful TopK step: tied init, unit-norm decoder, MSE, Adam; no AuxK, no stats."""

    def __init__(self, first: torch.Tensor, width: int, k: int, lr: float) -> None:
        d = first.shape[1]
        self.scale = (d / first.pow(2).sum(1).mean()).sqrt()
        g = torch.Generator().manual_seed(0)
        W_dec = torch.randn(width, d, generator=g)
        W_dec /= W_dec.norm(dim=1, keepdim=True)
        self.W_enc = W_dec.T.clone().requires_grad_()
        self.W_dec = W_dec.requires_grad_()
        self.b_enc = torch.zeros(width, requires_grad=True)
        self.b_dec = (first * self.scale).mean(0).requires_grad_()
        self.k = k
        self.opt = torch.optim.Adam([self.W_enc, self.b_enc, self.W_dec, self.b_dec], lr=lr)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = topk_relu((x - self.b_dec) @ self.W_enc + self.b_enc, self.k)
        return z @ self.W_dec + self.b_dec

    def step(self, batch: torch.Tensor) -> None:
        x = batch * self.scale
        loss = (x - self.forward(x)).pow(2).sum(-1).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            g, W = self.W_dec.grad, self.W_dec
            g -= (g * W).sum(1, keepdim=True) * W
            self.opt.step()
            W /= W.norm(dim=1, keepdim=True)

    @torch.no_grad()
    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x * self.scale) / self.scale


class SAELens:
    """SAELens's TopK training SAE, stepped as its SAETrainer does (forward, backward, clip, Adam)."""

    def __init__(self, first: torch.Tensor, width: int, k: int, lr: float) -> None:
        from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig

        d = first.shape[1]
        self.scale = (d / first.pow(2).sum(1).mean()).sqrt()
        torch.manual_seed(0)
        self.sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d, d_sae=width, k=k))
        self.opt = torch.optim.Adam(self.sae.parameters(), lr=lr)
        self.since_fired = torch.zeros(width)
        self.steps = 0

    def step(self, batch: torch.Tensor) -> None:
        from sae_lens.saes.sae import TrainStepInput

        self.sae.train()
        out = self.sae.training_forward_pass(TrainStepInput(
            sae_in=batch * self.scale, coefficients={}, dead_neuron_mask=self.since_fired > 10_000_000 // 4096,
            n_training_steps=self.steps, is_logging_step=False))
        with torch.no_grad():
            self.since_fired += 1
            self.since_fired[out.feature_acts.bool().any(0)] = 0
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.sae.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1

    @torch.no_grad()
    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        return self.sae.decode(self.sae.encode(x * self.scale)) / self.scale


class Ours:
    def __init__(self, first: torch.Tensor, width: int, k: int, lr: float) -> None:
        # buffer = batch: each update of one batch takes exactly one step on those rows
        self.sae = TopKSAE(width=width, k=k, lr=lr, batch_size=first.shape[0], buffer_size=first.shape[0],
                           warmup_tokens=first.shape[0], seed=0)

    def step(self, batch: torch.Tensor) -> None:
        self.sae.update(batch)

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        return self.sae.reconstruct(x)


def fvu(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return ((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--distinct", type=int, default=6, help="distinct training batches (cycled)")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    distinct = min(args.distinct, args.steps)
    x, source = activations((distinct + 1) * args.batch)
    batches, held_out = list(x[:-args.batch].split(args.batch)), x[-args.batch:]
    d = x.shape[1]
    width = 8 * d
    lr = TopKSAE(width=width, k=args.k).config.learning_rate()
    makers: dict[str, Callable] = {"ours (TopKSAE.update)": Ours, "minimal PyTorch step": Minimal}
    if importlib.util.find_spec("sae_lens") is not None:
        makers["SAELens TopKTrainingSAE"] = SAELens
    impls = {name: make(batches[0], width, args.k, lr) for name, make in makers.items()}
    seconds = dict.fromkeys(impls, 0.0)
    for step in range(args.steps):
        batch = batches[step % distinct]
        for name, impl in impls.items():
            start = time.perf_counter()
            impl.step(batch)
            if step > 0:  # the first step includes initialisation
                seconds[name] += time.perf_counter() - start
    print(f"activations: {source}")
    print(f"TopK SAE d={d} width={width} k={args.k} batch={args.batch} lr={lr:.2e}; {args.steps} steps "
          f"({distinct} distinct batches), {torch.get_num_threads()} threads; sae_lens "
          f"{'present' if 'SAELens TopKTrainingSAE' in impls else 'not importable'}")
    ours = next(iter(impls))
    tokens = (args.steps - 1) * args.batch
    fvus = {name: fvu(held_out, impl.reconstruct(held_out)) for name, impl in impls.items()}
    print(f"  {'':<26s} {'tokens/s':>10s} {'speed vs ours':>14s} {'held-out FVU':>13s} {'FVU vs ours':>12s}")
    for name in impls:
        rate = tokens / seconds[name]
        print(f"  {name:<26s} {rate:10.0f} {rate / (tokens / seconds[ours]):14.3f} "
              f"{fvus[name]:13.4f} {fvus[name] / fvus[ours]:12.3f}")


if __name__ == "__main__":
    main()

"""The trainers `benchmarks/peers.py` compares, behind one small interface, and its FVU.

Each trainer takes raw `(B, d)` float32 rows, one optimiser step per `step(batch)`, with its
own recommended hyper-parameters, and gives raw-unit reconstructions for evaluation:

- ours: `conceptlens.concepts.sae` TopK / BatchTopK / JumpReLU with their default config
  (Adam, lr 2e-4 * sqrt(16384 / width), geometric-median b_dec, inputs scaled to E||x||^2 = d,
  AuxK for TopK); the mixing buffer is one batch since the rows come shuffled. `ours-topk-lr10x`
  (and `-lr3x`, and the same for BatchTopK and JumpReLU) is that model at 10x (3x) the lr, the
  short-budget setting `peers_ablate.py` supports (not the library default; `conceptlens fit`
  gives 7.4x at 262 steps of 4096, `short_budget_lr`, see `lr_budget.py`). `ours-topk-budget` (and
  the same for BatchTopK and JumpReLU) is that model at the lr `conceptlens fit` gives it for the
  run's steps: what a user of the command line trains.
- SAELens: its own `SAETrainer.step` (the seam its `fit` loop and `MultiSAETrainer` call) on
  a `TopKTrainingSAE` / `BatchTopKTrainingSAE`, with `SAETrainerConfig`'s defaults (Adam lr
  3e-4, constant schedule, grad-norm clip 1, no activation normalisation).
- sparsify: `SparseCoder` stepped as its `Trainer.fit` does for `loss_fn="fvu"` with the
  default optimiser (schedule-free SignSGD, momentum 0.95, lr 5e-3 / sqrt(width / 2**14)),
  b_dec set to the first batch's mean, unit decoder rows, no AuxK (`auxk_alpha=0`); evaluated
  at the schedule-free averaged weights (`optimizer.eval()`), as its trainer saves them.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Protocol

import torch
from torch import Tensor


class Trainer(Protocol):
    def step(self, batch: Tensor) -> None: ...

    def reconstruct(self, x: Tensor) -> Tensor: ...


def fvu(x: Tensor, x_hat: Tensor) -> float:
    """Fraction of variance unexplained: sum ||x - x_hat||^2 / sum ||x - mean(x)||^2 (rows x `(N, d)`)."""
    x, x_hat = x.double(), x_hat.double()
    return ((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum()).item()


def l0(trainer: Trainer, x: Tensor) -> float:
    """Mean number of active latents per row, where the trainer exposes its encoder."""
    encode = getattr(trainer, "encode", None)
    return float("nan") if encode is None else (encode(x) != 0).sum(1).double().mean().item()


class Ours:
    def __init__(self, cls: type, d: int, width: int, k: int, batch: int, **overrides: object) -> None:
        sparsity = {"k": k} if "k" in {f for f in cls.Config.__dataclass_fields__} else {}
        self.sae = cls(width=width, batch_size=batch, buffer_size=batch, warmup_tokens=batch, seed=0,
                       **{**sparsity, **overrides})

    def step(self, batch: Tensor) -> None:
        self.sae.update(batch)

    def reconstruct(self, x: Tensor) -> Tensor:
        return self.sae.reconstruct(x)

    def encode(self, x: Tensor) -> Tensor:
        return self.sae.encode(x)


class SAELens:
    def __init__(self, arch: str, d: int, width: int, k: int, batch: int) -> None:
        from sae_lens import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig, TopKTrainingSAE, TopKTrainingSAEConfig
        from sae_lens.config import SAETrainerConfig
        from sae_lens.training.sae_trainer import SAETrainer

        sae_cls, cfg_cls = {"topk": (TopKTrainingSAE, TopKTrainingSAEConfig),
                            "batchtopk": (BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig)}[arch]
        torch.manual_seed(0)
        self.sae = sae_cls(cfg_cls(d_in=d, d_sae=width, k=k))
        cfg = SAETrainerConfig(total_training_samples=10**12, train_batch_size_samples=batch)
        cfg.lr_end = cfg.lr / 10  # what LanguageModelSAERunnerConfig sets (unused by the constant schedule)
        self.trainer = SAETrainer(cfg, self.sae, data_provider=iter(()))

    def step(self, batch: Tensor) -> None:
        self.trainer.step(batch)
        self.trainer.n_training_steps += 1  # as SAETrainer.fit does after each step

    @torch.no_grad()
    def encode(self, x: Tensor) -> Tensor:
        return self.deployed().encode(x)

    @torch.no_grad()
    def reconstruct(self, x: Tensor) -> Tensor:
        sae = self.deployed()
        return sae.decode(sae.encode(x))

    def deployed(self) -> Any:
        """The SAE as SAELens deploys it (`save_inference_model`, then `SAE.load_from_disk`): a BatchTopK
        SAE becomes a JumpReLU at its learned threshold, as ours is scored, so no held-out row's code
        depends on the rows scored beside it (the training SAE's `encode` takes top-k over the batch)."""
        import tempfile

        from sae_lens import SAE

        with tempfile.TemporaryDirectory() as folder:
            self.sae.save_inference_model(folder)
            return SAE.load_from_disk(folder).eval()


class Sparsify:
    def __init__(self, d: int, width: int, k: int, batch: int, adam_lr: float | None = None) -> None:
        """sparsify's default ("signum"); `adam_lr` swaps in plain Adam at that lr (an ablation)."""
        from schedulefree import ScheduleFreeWrapper
        from sparsify import SparseCoder, SparseCoderConfig
        from sparsify.sign_sgd import SignSGD

        torch.manual_seed(0)
        self.sae = SparseCoder(d, SparseCoderConfig(num_latents=width, k=k), "cpu", dtype=torch.float32)
        lr = 5e-3 / (width / 2**14) ** 0.5  # sparsify's default for its default optimiser, "signum"
        self.opt: torch.optim.Optimizer = (torch.optim.Adam(self.sae.parameters(), lr=adam_lr) if adam_lr else
                                           ScheduleFreeWrapper(SignSGD([dict(params=self.sae.parameters(), lr=lr)]),
                                                               momentum=0.95))
        if not adam_lr:
            self.opt.train()
        self.steps = 0
        self.average = True  # evaluate at the schedule-free average (False: at the training weights)

    def step(self, batch: Tensor) -> None:
        if self.steps == 0:
            self.sae.b_dec.data = batch.mean(0)
        self.sae.set_decoder_norm_to_unit_norm()
        self.sae(batch).fvu.backward()
        self.sae.remove_gradient_parallel_to_decoder_directions()
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1

    @torch.no_grad()
    def _at_average(self, fn: Callable[[], Tensor]) -> Tensor:
        if not self.average or not hasattr(self.opt, "eval"):  # plain Adam: no average to swap in
            return fn()
        training = [p.detach().clone() for p in self.sae.parameters()]
        self.opt.eval()  # swap in the schedule-free average, as sparsify's trainer does to save
        try:
            return fn()
        finally:
            self.opt.train()
            for p, saved in zip(self.sae.parameters(), training):  # the round trip is not exact in floats
                p.copy_(saved)

    def encode(self, x: Tensor) -> Tensor:
        def dense() -> Tensor:
            acts, idx, _ = self.sae.encode(x)
            return torch.zeros(x.shape[0], self.sae.num_latents).scatter_(1, idx, acts)
        return self._at_average(dense)

    def reconstruct(self, x: Tensor) -> Tensor:
        return self._at_average(lambda: self.sae.decode(*self.sae.encode(x)[:2]))


def default_lr(cls: type, width: int) -> float:
    """The library's default learning rate of SAE class `cls` at `width` (it depends on the width only)."""
    return float(cls.Config(width=width, **({"k": 1} if "k" in cls.Config.__dataclass_fields__ else {})).learning_rate())


def makers(d: int, width: int, k: int, batch: int, steps: int | None = None) -> dict[str, Callable[[], Trainer]]:
    """Every trainer that can run here, by name: ours always, the peers when importable; given the run's
    `steps`, also ours at the lr `conceptlens fit` gives an SAE for that budget (`-budget`)."""
    from conceptlens.concepts.sae import BatchTopKSAE, JumpReLUSAE, TopKSAE
    from conceptlens.concepts.sae.config import short_budget_lr

    out: dict[str, Callable[[], Trainer]] = {}
    for arch, cls in (("topk", TopKSAE), ("batchtopk", BatchTopKSAE), ("jumprelu", JumpReLUSAE)):
        out[f"ours-{arch}"] = lambda cls=cls: Ours(cls, d, width, k, batch)
        # 3x / 10x the default lr: what peers_ablate.py found for fits of < ~1000 steps (not a library default)
        for times in (3, 10):
            out[f"ours-{arch}-lr{times}x"] = lambda cls=cls, times=times: Ours(
                cls, d, width, k, batch, lr=times * default_lr(cls, width))
        if steps is not None:
            out[f"ours-{arch}-budget"] = lambda cls=cls: Ours(cls, d, width, k, batch,
                                                             lr=short_budget_lr(width, max(1, steps), batch))
    if importlib.util.find_spec("sae_lens") is not None:
        out["saelens-topk"] = lambda: SAELens("topk", d, width, k, batch)
        out["saelens-batchtopk"] = lambda: SAELens("batchtopk", d, width, k, batch)
    if importlib.util.find_spec("sparsify") is not None and importlib.util.find_spec("schedulefree") is not None:
        out["sparsify-topk"] = lambda: Sparsify(d, width, k, batch)
    return out

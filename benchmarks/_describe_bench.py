"""run_all's describe section: the description pass against the capture-only pass, its streaming
part and its finish apart (what scales with the tokens and what is paid once per pass)."""

from __future__ import annotations

import time

import torch

from _model_benches import _Nothing, _rounds, _texts, fit_sites
from _suite import Context, sync


def describe_overhead(ctx: Context) -> None:
    """The description pass of three sets at block 15 and at the last block, as a ratio to the capture-only pass."""
    import conceptlens
    from conceptlens import ConceptSet
    from conceptlens.concepts.sae import TopKSAE

    model, tok = ctx.model()
    docs = _texts(48 if ctx.quick else 160)
    lens = conceptlens.attach(model, tok)
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    sae = TopKSAE(width=8 * d, k=32, batch_size=256, warmup_tokens=256, seed=0)
    sae.update(torch.randn(512, d, generator=g) * 10)
    sae.flush()
    for site in fit_sites(model):
        topk = sae.concept_set()
        topk.site = site
        sets = {"topk": topk,
                "kmeans": ConceptSet(torch.randn(512, d, generator=g) * 10, site, method="kmeans"),
                "deleuzian": ConceptSet(torch.randn(512, d, generator=g), site, method="deleuzian")}
        streamed: list[float] = []  # seconds of each describe call's streaming pass (its fit)
        name = "describe 3 sets (TopK 8x, k-means 512, Deleuzian 512)"
        fns = {"capture-only (no-op extractor)": lambda: lens.fit({site: _Nothing()}, docs, batch_size=16,
                                                                  max_length=128, progress=False),
               name: lambda: _streaming_timed(ctx, streamed, lambda: lens.describe(
                   sets, docs, batch_size=16, max_length=128, progress=False))}
        times = _rounds(fns, 2 if ctx.quick else 4, ctx.device)
        parts = {name: times[name], "streaming part (the pass itself; scales with the tokens)": streamed}
        base = min(times["capture-only (no-op extractor)"])
        for label, t in {"capture-only (no-op extractor)": times["capture-only (no-op extractor)"], **parts}.items():
            ctx.add("describe", f"at {site}: {label}", f"{min(t):.2f} s ({min(t):.2f}-{max(t):.2f})", min(t) / base,
                    "of capture-only to the same site", "<= 1.15x" if label == name else "")
        finish = [total - part for total, part in zip(times[name], streamed)]
        ctx.add("describe", f"at {site}: finish (once per pass, {sum(len(cs) for cs in sets.values())} concepts; "
                "fixed)", f"{min(finish):.2f} s ({min(finish):.2f}-{max(finish):.2f})")


def _streaming_timed(ctx: Context, streamed: list[float], describe) -> None:
    """Run `describe`, appending the seconds its streaming pass (`conceptlens.fit.fit`) took; the rest is its finish."""
    import conceptlens.fit as fit_module

    plain, spent = fit_module.fit, []

    def timed_fit(*args, **kwargs):
        start = time.perf_counter()
        out = plain(*args, **kwargs)
        sync(ctx.device)
        spent.append(time.perf_counter() - start)
        return out

    fit_module.fit = timed_fit
    try:
        describe()
    finally:
        fit_module.fit = plain
    streamed.append(sum(spent))

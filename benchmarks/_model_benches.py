"""run_all sections that run SmolLM2: capture, stop-early, fit overhead, steering, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from _floors import encoder_floor, ready_codebook, site_rows
from _suite import Context, sync, timed

SITE = "blocks.15.resid_out"


def _texts(n: int) -> list[str]:
    from conceptlens import data

    texts = data.load("bbc-news", split="all").texts
    return (texts[::7] + texts)[:n]


def _rounds(fns: dict, rounds: int, device) -> dict[str, list[float]]:
    """Seconds of each function in interleaved rounds: drift hits all alike. One untimed call of the
    first function warms what they share (the model's pages, BLAS and allocator); a function's own
    first-call cost falls in its first round, which the best of the rounds leaves out (an untimed
    call of each was a third of a quick run's fit and describe sections)."""
    next(iter(fns.values()))()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return times


def _interleaved(fns: dict, rounds: int, device) -> dict[str, float]:
    """Best time of each function over interleaved rounds, as the fit and describe rows (a median of
    3 rounds moves with one slow round by more than the 5% a capture row measures)."""
    return {name: min(t) for name, t in _rounds(fns, rounds, device).items()}


def capture(ctx: Context) -> None:
    """Full forward capturing all 30 resid_out: bare vs raw hooks vs lens.capture vs nnsight; stop-early."""
    import conceptlens

    model, tok = ctx.model()
    batch = tok(_texts(8), return_tensors="pt", padding=True, truncation=True, max_length=128).to(ctx.device)
    keep = batch["attention_mask"].bool()
    layers = model.model.layers
    lens = conceptlens.attach(model, tok)
    sites = [f"blocks.{i}.resid_out" for i in range(len(layers))]
    full = lens.capture(sites, on_batch=lambda acts, meta: None)
    early = lens.capture("blocks.2.resid_out")

    def raw_hooks():
        got = []
        handles = [layer.register_forward_hook(lambda m, a, out: got.append(out.detach()[keep].float()))
                   for layer in layers]
        try:
            model(**batch)
        finally:
            for h in handles:
                h.remove()

    def with_capture():
        with full:
            model(**batch)

    def stop_early():
        with early:
            early.forward(**batch)

    fns = {"bare forward": lambda: model(**batch), "raw forward hooks (30 sites)": raw_hooks,
           "lens.capture (30 resid_out)": with_capture}
    try:
        from nnsight import NNsight

        wrapped = NNsight(model)

        def nnsight_trace():
            saved: list = []  # filled inside the trace (nnsight runs its body apart from this frame)
            with wrapped.trace(**batch):
                for i in range(len(layers)):
                    saved.append(wrapped.model.layers[i].output.save())
            return [s[keep].float() for s in saved]

        fns["nnsight trace .save() (30 layers)"] = nnsight_trace
    except ImportError:
        print("  nnsight is not installed: its row is left out")
    class _Stop(Exception):
        pass

    def raw_stop_early():
        # What a user writes by hand to read block 2 without running the rest: a hook that raises.
        got = []

        def hook(m, a, out):
            got.append(out.detach()[keep].float())
            raise _Stop

        handle = layers[2].register_forward_hook(hook)
        try:
            model(**batch)
        except _Stop:
            pass
        finally:
            handle.remove()

    fns["raw hook at blocks.2, raise to stop"] = raw_stop_early
    fns["lens capture-only blocks.2 (stops early)"] = stop_early
    with torch.inference_mode():
        seconds = _interleaved(fns, 3 if ctx.quick else 7, ctx.device)
    tokens = int(keep.sum())
    base = seconds["bare forward"]
    early = seconds["raw hook at blocks.2, raise to stop"]
    for name, s in seconds.items():
        stops = "blocks.2" in name
        ctx.add("capture", name, f"{s * 1e3:.0f} ms, {tokens / s:.0f} tok/s", s / (early if stops else base),
                "of the raw stop-early hook" if stops else "of bare forward",
                "<= 1.05x" if name.startswith("lens") else "")


class _Nothing:
    """A no-op extractor: `lens.fit` with it is the capture-only pass (forward to the site + row filter)."""

    def update(self, x):
        pass

    def state_dict(self):
        return {}


def fit_sites(model) -> list[str]:
    """An early site (block 15, where the fit stops halfway) and the last block (where it stops nowhere)."""
    last = model.config.num_hidden_layers - 1
    return [SITE, f"blocks.{last}.resid_out"]


def fit_makers(d: int) -> dict:
    from conceptlens.concepts.deleuzian import Deleuzian
    from conceptlens.concepts.kmeans import StreamingKMeans
    from conceptlens.concepts.sae import BatchTopKSAE, MatryoshkaSAE, TopKSAE
    from conceptlens.concepts.vq import VQCodebook

    return {
        "capture-only (no-op extractor)": _Nothing,
        "StreamingKMeans k=4096": lambda: StreamingKMeans(n_concepts=4096, batch_size=4096),
        "Deleuzian k=512": lambda: Deleuzian(n_concepts=512),
        "TopKSAE width 16x, k=32": lambda: TopKSAE(width=16 * d, k=32),
        "BatchTopKSAE width 16x, k=32": lambda: BatchTopKSAE(width=16 * d, k=32),
        "MatryoshkaSAE width 16x, k=32": lambda: MatryoshkaSAE(width=16 * d, k=32),
        # 48 quick documents give ~6,100 rows, under the default init_size 16 * 512: this row is the
        # initialisation alone (k-means++ and Lloyd at flush); the steps have their own row
        "VQCodebook 512 codes, fresh (initialisation only when rows < 8,192)": lambda: VQCodebook(n_codes=512),
    }


def fit_overhead(ctx: Context) -> None:
    """lens.fit per extractor at block 15 and at the last block, as a ratio to the capture-only pass to that site."""
    import conceptlens

    model, tok = ctx.model()
    n_docs = 48 if ctx.quick else 256
    docs = _texts(n_docs)
    lens = conceptlens.attach(model, tok)
    makers = fit_makers(model.config.hidden_size)
    rounds = 2 if ctx.quick else 5
    for site in fit_sites(model):
        rows = site_rows(lens, site, docs)
        # A fresh extractor per call: its initialisation is part of what the user pays.
        site_makers = {**makers, "VQCodebook 512 codes, EMA steps from a ready codebook": ready_codebook(rows, 512)}
        fns = {name: (lambda make=make: lens.fit({site: make()}, docs, batch_size=8, max_length=128,
                                                 progress=False))
               for name, make in site_makers.items()}
        seconds, spread = _interleaved_spread(fns, rounds, ctx.device)
        base = seconds["capture-only (no-op extractor)"]
        for name, s in seconds.items():
            lo, hi = spread[name]
            ctx.add("fit", f"lens.fit at {site}: {name}", f"{s:.2f} s ({lo:.2f}-{hi:.2f})", s / base,
                    "of capture-only to the same site", "" if name.startswith("capture") else "<= 1.10x")
        width = 16 * model.config.hidden_size
        floor = encoder_floor(rows, width, 32, rounds, ctx.device)
        gflop = 2 * sum(len(x) for x in rows) * model.config.hidden_size * width / 1e9
        ctx.add("fit", f"lens.fit at {site}: floor of a TopK SAE 16x, k=32 (capture-only + x @ W_enc + top-k, "
                f"{gflop:.0f} GFLOP)", f"{base + floor:.2f} s (+{floor:.2f} s)", (base + floor) / base,
                "of capture-only to the same site")


def _interleaved_spread(fns: dict, rounds: int, device) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Best time of each function over interleaved rounds, and its range."""
    times = _rounds(fns, rounds, device)
    return {name: min(t) for name, t in times.items()}, {name: (min(t), max(t)) for name, t in times.items()}


def steer(ctx: Context) -> None:
    """Greedy generation with one Add at blocks.15: bare vs lens.steer vs nnsight tracer.iter."""
    import conceptlens
    from conceptlens.steering import Add

    model, tok = ctx.model()
    tok.padding_side = "left"
    inputs = tok(["I went to the shop and"], return_tensors="pt").to(ctx.device)
    new = 16 if ctx.quick else 32
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    vector = 8.0 * vector / vector.norm()
    lens = conceptlens.attach(model, tok)

    def steered():
        with lens.steer(Add(vector, site=SITE)):
            return model.generate(**inputs, **gen)

    fns = {"bare generate": lambda: model.generate(**inputs, **gen), "lens.steer Add (all positions)": steered}
    try:
        from nnsight import TransformersModel

        wrapped = TransformersModel(model, tokenizer=tok)

        def nnsight_generate():
            with wrapped.generate(dict(inputs), **gen) as tracer:
                for _ in tracer.iter[:new]:
                    wrapped.model.layers[15].output[:] += vector
                out = tracer.result.save()
            return out

        fns["nnsight tracer.iter Add"] = nnsight_generate
    except ImportError:
        print("  nnsight is not installed: its row is left out")
    with torch.inference_mode():
        seconds = _interleaved(fns, 3 if ctx.quick else 9, ctx.device)
    base = seconds["bare generate"]
    for name, s in seconds.items():
        ctx.add("steer", name, f"{s * 1e3:.0f} ms / {new} tokens", s / base, "of bare generate",
                "<= 1.03x" if name.startswith("lens") else "")


def memory(ctx: Context) -> None:
    """Peak memory of a fit over 10x the tokens vs 1x (a child process per run: clean peaks)."""
    small = 2048 if ctx.quick else 4096
    peaks = {}
    for n in (small, 10 * small):
        out = subprocess.run([sys.executable, __file__, "--memory-child", str(n), str(ctx.device)],
                             capture_output=True, text=True, check=True, env={**os.environ})
        peaks[n] = json.loads(out.stdout.strip().splitlines()[-1])
    a, b = peaks[small], peaks[10 * small]
    for key, label in (("fit_peak_mb", "growth of peak RSS during the fit"), ("device_peak_mb", "device peak")):
        if a.get(key) is None:
            continue
        ratio = b[key] / a[key] if a[key] else None
        ctx.add("memory", f"{label}, {10 * small} vs {small} tokens", f"{b[key]:.0f} MB vs {a[key]:.0f} MB",
                ratio, "of 1x", "~1x (streaming)")
    ctx.add("memory", "process peak RSS (model included), 10x vs 1x",
            f"{b['peak_mb']:.0f} MB vs {a['peak_mb']:.0f} MB", b["peak_mb"] / a["peak_mb"], "of 1x")


def _memory_child(n_tokens: int, device: str) -> None:
    import conceptlens
    from conceptlens import models
    from conceptlens.concepts.kmeans import StreamingKMeans
    from conceptlens.concepts.sae import TopKSAE

    def rss(field: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024

    model, tok = models.load("smollm2-135m")
    model.to(device)
    lens = conceptlens.attach(model, tok)
    with torch.inference_mode():  # warm the allocator with one short forward first
        model(**tok(["warm up"], return_tensors="pt").to(device))
    before = rss("VmRSS")
    extractors = {SITE: TopKSAE(width=4608, k=32, batch_size=1024), "blocks.5.resid_out": StreamingKMeans(256)}
    lens.fit(extractors, _texts(4000), batch_size=8, max_length=128, max_tokens=n_tokens, progress=False)
    sync(torch.device(device))
    peak = rss("VmHWM")
    gpu = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
    print(json.dumps({"fit_peak_mb": peak - before, "peak_mb": peak, "device_peak_mb": gpu}))


if __name__ == "__main__" and sys.argv[1:2] == ["--memory-child"]:
    _memory_child(int(sys.argv[2]), sys.argv[3])

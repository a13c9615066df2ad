"""Cross-layer dictionaries on a real model: a transcoder, a crosscoder and a cross-layer transcoder
on SmolLM2-135M at a small budget, with FVU per target and CE-loss recovered when spliced in.

    python reproductions/cross_layer.py [train_tokens]      # default 10000

One streamed fit (`lens.fit`, one forward per batch) trains, on bbc-news training texts:
- Transcoder (ReLU, defaults) at block 5: blocks.5.mlp.in -> blocks.5.mlp_out, width 2304 (4x);
- Crosscoder (TopK, k 32) over blocks.4/5/6.resid_out, width 2304;
- CrossLayerTranscoder (TopK, k 16 per layer) over blocks 4-6: each MLP's input -> its own and
  later MLP outputs, width 3 x 768.
Held out (bbc-news test texts): FVU per target on the held-out tokens (first token of each text
left out, as the fit does), and CE-loss recovered on 8 texts of 64 tokens: the transcoder and
the CLT replace their targets causally in one forward (`splice_replacement`), the crosscoder
replaces one site at a time from the clean activations (`splice_crosscoder`). Batch 256 rows:
the default budget gives each dictionary about 35 steps, so the numbers are those of a short
fit, far from converged ones.
"""

from __future__ import annotations

import sys

import torch

from _common import Clock, report, threads

import conceptlens
from conceptlens import data, models
from conceptlens.batching import encode_batch
from conceptlens.concepts.sae import CrossLayerTranscoder, Crosscoder, Transcoder
from conceptlens.concepts.sae.crosscoder import fvu_per_site
from conceptlens.metrics.splice_sites import splice_crosscoder, splice_replacement

BLOCKS = (4, 5, 6)
INS = tuple(f"blocks.{b}.mlp.in" for b in BLOCKS)
OUTS = tuple(f"blocks.{b}.mlp_out" for b in BLOCKS)
RESID = tuple(f"blocks.{b}.resid_out" for b in BLOCKS)


@torch.no_grad()
def held_out(lens, tok, texts: list[str], sites: list[str]) -> dict[str, torch.Tensor]:
    """Rows of every site for the held-out texts, first token of each text left out."""
    rows: dict[str, list[torch.Tensor]] = {s: [] for s in sites}
    with lens.capture(sites) as cap:
        for start in range(0, len(texts), 16):
            acts, meta = cap.forward(**encode_batch(tok, texts[start:start + 16], 64))
            inner = meta.position > 0
            for s in sites:
                rows[s].append(acts[s][inner].float())
    return {s: torch.cat(v) for s, v in rows.items()}


def main(train_tokens: int) -> None:
    threads()
    clock = Clock()
    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    small = dict(batch_size=256, warmup_tokens=1024, seed=0)
    tc = Transcoder(width=2304, **small)
    cc = Crosscoder(width=2304, k=32, **small)
    clt = CrossLayerTranscoder(width=3 * 768, k=16, **small)
    train = data.load("bbc-news", "train").texts
    lens.fit({(INS[1], OUTS[1]): tc, RESID: cc, (INS, OUTS): clt}, train, batch_size=16, max_length=64,
             max_tokens=train_tokens, progress=False)
    print(f"fitted on {train_tokens:,} tokens in {clock}: steps transcoder {tc.stats().steps}, "
          f"crosscoder {cc.stats().steps}, CLT {clt.stats().steps}")
    test = data.load("bbc-news", "test").texts[:40]
    rows = held_out(lens, tok, test, [*INS, *OUTS, *RESID])
    fvu_tc = fvu_per_site([rows[OUTS[1]]], [tc.reconstruct(rows[INS[1]])])[0]
    fvu_cc = cc.fvu(*[rows[s] for s in RESID])
    fvu_clt = clt.fvu([rows[s] for s in INS], [rows[s] for s in OUTS])
    batch = encode_batch(tok, test[:8], 64)
    ce_tc = splice_replacement(lens, [INS[1]], [OUTS[1]], tc, batch)
    ce_clt = splice_replacement(lens, INS, OUTS, clt, batch)
    ce_cc = splice_crosscoder(lens, RESID, cc, batch)
    out = [("transcoder", OUTS[1], fvu_tc, ce_tc.recovered, ce_tc.clean, ce_tc.spliced, ce_tc.zero_ablated)]
    out += [("crosscoder", s, f, ce_cc[s].recovered, ce_cc[s].clean, ce_cc[s].spliced, ce_cc[s].zero_ablated)
            for s, f in zip(RESID, fvu_cc)]
    out += [("CLT", s, f, None, None, None, None) for s, f in zip(OUTS, fvu_clt)]
    out += [("CLT (all 3 spliced)", "+".join(OUTS), None, ce_clt.recovered, ce_clt.clean, ce_clt.spliced,
             ce_clt.zero_ablated)]
    report(f"SmolLM2-135M, {train_tokens:,} training tokens, {rows[INS[0]].shape[0]:,} held-out tokens "
           f"({clock})", out, ("dictionary", "target", "held-out FVU", "CE recovered", "clean CE", "spliced CE",
                               "zero CE"))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)

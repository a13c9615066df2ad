"""CE-loss recovered, KL and FVU of the reconstruction part against a manual splice with a plain forward hook."""

import math

import pytest
import torch
import torch.nn.functional as F

import conceptlens
from conceptlens.evaluate.activations import ConceptEncoder
from conceptlens.evaluate import reconstruction
from conceptlens.evaluate.reconstruction import reconstruction_lines
from conceptlens.steering import sweep_scores
from conceptlens.metrics.quality import fvu
from tests.conftest import tiny_model


def _encoder(d: int = 32, n: int = 48) -> ConceptEncoder:
    w = torch.randn(n, d, generator=torch.Generator().manual_seed(5)) / math.sqrt(d)
    return ConceptEncoder("relu", lambda x: torch.relu(x @ w.T - 0.2), lambda z: z @ w)


def _manual(model, batch, edit):
    """Logits with block 0's output replaced by edit(rows) on real tokens after each sequence's first."""
    where = batch["attention_mask"].bool() & (batch["attention_mask"].cumsum(1) > 1)
    seen = []

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        seen.append(hidden[where].clone())
        if edit is None:
            return None
        hidden = hidden.clone()
        hidden[where] = edit(hidden[where])
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.model.layers[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(**batch).logits, seen[0]
    finally:
        handle.remove()


@pytest.mark.parametrize("predictions_per_slice", [None, 3])
@pytest.mark.parametrize("rows_per_forward", [None, 1, 2])
def test_reconstruction_figures_equal_a_manual_splice_with_a_forward_hook(rows_per_forward, predictions_per_slice,
                                                                         monkeypatch):
    """Also when a batch's logits exceed `sweep_scores.LOGITS_BYTES` and its rows run in slices (here of 1 and 2 of
    its 3 rows), and when a sequence's float64 terms exceed `sweep_scores.CHUNK_BYTES` and its predictions are
    scored in slices (here of 3 of its 8): the same figures as the whole batches of the manual splice."""
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    sizes = []
    if predictions_per_slice is not None:
        vocab = model.get_output_embeddings().weight.shape[0]
        monkeypatch.setattr(sweep_scores, "CHUNK_BYTES", predictions_per_slice * 8 * vocab)
        slices = []
        log_softmax = F.log_softmax
        monkeypatch.setattr(reconstruction.F, "log_softmax",
                            lambda x, dim: slices.append(len(x)) or log_softmax(x, dim))
    if rows_per_forward is not None:
        vocab = model.get_output_embeddings().weight.shape[0]
        monkeypatch.setattr(sweep_scores, "LOGITS_BYTES", rows_per_forward * 9 * vocab * 4)
        model.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(len(kwargs["input_ids"])),
                                        with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(3, 99, (3, 9), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0  # right padding
        batches.append({"input_ids": ids, "attention_mask": mask})
    enc = _encoder()
    mean = torch.randn(32, generator=g)
    lines = reconstruction_lines(lens, "blocks.0.resid_out", {"sae": enc}, batches, mean)
    if rows_per_forward is not None:  # clean, the set, zero and mean: 4 forwards per slice
        assert sizes == [n for _ in batches for n in ([1, 1, 1] if rows_per_forward == 1 else [2, 1]) for _ in range(4)]
        sizes.clear()
    by_metric = {ln.metric: ln for ln in lines}
    if predictions_per_slice is not None:  # 8 predictions in full rows, 5 in the padded one; 2 calls a slice
        monkeypatch.undo()
        assert max(slices) == 3 and sorted(set(slices)) == [2, 3] and len(slices) == 2 * 4 * 2 * (3 + 3 + 2)

    totals = {k: 0.0 for k in ("clean", "sae", "zero", "mean", "kl_sae", "kl_zero", "kl_mean")}
    tokens, rows = 0, []
    edits = {"sae": lambda h: enc.decode(enc.encode(h)), "zero": torch.zeros_like, "mean": lambda h: mean.expand_as(h)}
    for batch in batches:
        clean, x = _manual(model, batch, None)
        rows.append(x)
        valid = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).bool()
        targets = batch["input_ids"][:, 1:][valid]
        clean_logp = F.log_softmax(clean[:, :-1][valid].double(), -1)
        totals["clean"] += float(F.nll_loss(clean_logp, targets, reduction="sum"))
        tokens += int(valid.sum())
        for name, edit in edits.items():
            logp = F.log_softmax(_manual(model, batch, edit)[0][:, :-1][valid].double(), -1)
            totals[name] += float(F.nll_loss(logp, targets, reduction="sum"))
            totals[f"kl_{name}"] += float(F.kl_div(logp, clean_logp, log_target=True, reduction="sum"))
    recovered = (totals["zero"] - totals["sae"]) / (totals["zero"] - totals["clean"])
    mean_recovered = (totals["zero"] - totals["mean"]) / (totals["zero"] - totals["clean"])
    ce = by_metric["CE loss recovered"]
    assert ce.value.value == pytest.approx(recovered, rel=1e-6)
    assert dict(ce.baselines)["mean-ablation"].value == pytest.approx(mean_recovered, rel=1e-6)
    kl = by_metric["KL to clean (nats/token)"]
    assert kl.value.value == pytest.approx(totals["kl_sae"] / tokens, rel=1e-6)
    assert dict(kl.baselines)["zero-ablation"].value == pytest.approx(totals["kl_zero"] / tokens, rel=1e-6)
    assert dict(kl.baselines)["mean-ablation"].value == pytest.approx(totals["kl_mean"] / tokens, rel=1e-6)
    x = torch.cat(rows)
    z = enc.encode(x)
    assert by_metric["FVU"].value.value == pytest.approx(fvu(x, enc.decode(z)), rel=1e-6)
    assert by_metric["L0"].value.value == pytest.approx(float((z != 0).double().sum(1).mean()), rel=1e-9)
    rate = (z != 0).double().mean(0)
    assert by_metric["dead fraction"].value.value == float((rate == 0).double().mean())
    assert math.isnan(by_metric["dead fraction"].value.low)  # resampling documents biases a never-fired count
    assert by_metric["dense fraction (>10% of tokens)"].value.value == float((rate > 0.1).double().mean())
    for line in lines:
        assert line.value.low <= line.value.value <= line.value.high or math.isnan(line.value.low)


def test_an_encoder_gets_fvu_and_sparsity_and_says_why_there_is_no_ce_or_kl():
    """BERT predicts no next token: the part stopped at CE-loss recovered; FVU, L0, dead and dense
    fractions need only the site's rows (each sequence's first left out, as the splice leaves it)."""
    model = tiny_model("bert")
    lens = conceptlens.attach(model)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(3, 99, (3, 9), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask})
    enc = _encoder()
    lines = reconstruction_lines(lens, "blocks.0.resid_out", {"sae": enc}, batches, torch.zeros(32))
    by_metric = {ln.metric: ln for ln in lines}
    assert list(by_metric) == ["FVU", "L0", "dead fraction", "dense fraction (>10% of tokens)"]
    assert by_metric["FVU"].note.endswith("no CE loss recovered or KL: BertForMaskedLM is an encoder, it predicts "
                                          "no next token")
    with pytest.raises(ValueError, match="CE-loss recovered needs a decoder-only language model; "
                                         "T5ForConditionalGeneration is not one"):  # one line, as before
        reconstruction_lines(conceptlens.attach(tiny_model("t5")), "blocks.0.resid_out", {"sae": enc}, batches,
                             torch.zeros(32))
    rows = []
    handle = model.bert.encoder.layer[0].register_forward_hook(
        lambda m, a, out: rows.append((out[0] if isinstance(out, tuple) else out).clone()))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    x = torch.cat([h[b["attention_mask"].bool() & (b["attention_mask"].cumsum(1) > 1)] for h, b in zip(rows, batches)])
    z = enc.encode(x)
    assert by_metric["FVU"].value.value == pytest.approx(fvu(x, enc.decode(z)), rel=1e-6)
    assert by_metric["L0"].value.value == pytest.approx(float((z != 0).double().sum(1).mean()), rel=1e-9)

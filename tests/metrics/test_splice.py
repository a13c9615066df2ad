import pytest
import torch

import conceptlens
from conceptlens.metrics.faithfulness import next_token_loss_sum
from conceptlens.metrics.splice import splice_ce, splice_mask
from tests.conftest import tiny_inputs, tiny_model


class Doubler:
    """Stands in for an SAE: anything with reconstruct(x) works."""

    def reconstruct(self, x):
        return 2 * x


def _lens(family="llama"):
    return conceptlens.attach(tiny_model(family))


def _right_padded(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("site", ["blocks.0.resid_out", "blocks.1.mlp_out", "blocks.0.attn.k"])
def test_identity_recovers_everything_and_zeros_nothing(site):
    lens = _lens()
    batch = tiny_inputs("llama", length=9)
    identity = splice_ce(lens, site, lambda x: x.clone(), batch)
    assert identity.spliced == identity.clean and identity.recovered == 1.0
    zeros = splice_ce(lens, site, torch.zeros_like, batch)
    assert zeros.spliced == zeros.zero_ablated and zeros.recovered == 0.0
    assert zeros.zero_ablated != zeros.clean and zeros.tokens == identity.tokens == 3 * 8 - 2


def test_clean_loss_equals_the_models_own_loss():
    lens, batch = _lens(), _right_padded()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        reference = lens.model(**batch, labels=labels).loss.item()
    result = splice_ce(lens, "blocks.0.resid_out", Doubler(), batch)
    assert result.clean == pytest.approx(reference, rel=1e-6)
    assert result.tokens == int((labels[:, 1:] != -100).sum())


def test_spliced_loss_equals_feeding_the_edited_embeddings():
    lens, batch = _lens(), tiny_inputs("llama", length=9)  # row 0 left-padded
    where = splice_mask(batch["attention_mask"])
    embeds = lens.model.get_input_embeddings()(batch["input_ids"]).detach()
    edited = torch.where(where[..., None], 2 * embeds, embeds)
    with torch.no_grad():
        logits = lens.model(inputs_embeds=edited, attention_mask=batch["attention_mask"]).logits
    total, n = next_token_loss_sum(logits, batch["input_ids"], batch["attention_mask"])
    result = splice_ce(lens, "embed", Doubler(), batch)
    assert result.spliced == pytest.approx(total / n, rel=1e-6)
    assert result.spliced != result.clean


def test_batches_pool_by_token_count():
    lens = _lens()
    batches = [_right_padded(0), tiny_inputs("llama", length=9, seed=1)]
    parts = [splice_ce(lens, "blocks.1.resid_out", Doubler(), b) for b in batches]
    pooled = splice_ce(lens, "blocks.1.resid_out", Doubler(), iter(batches))
    assert pooled.tokens == sum(p.tokens for p in parts)
    for field in ("clean", "spliced", "zero_ablated"):
        expected = sum(getattr(p, field) * p.tokens for p in parts) / pooled.tokens
        assert getattr(pooled, field) == pytest.approx(expected, rel=1e-12)


def test_splice_mask_skips_each_sequences_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert splice_mask(mask).tolist() == [[False, False, False, True, True], [False, True, True, False, False]]
    assert torch.equal(splice_mask(mask, skip_first=False), mask.bool())


def test_first_token_is_spliced_only_when_asked():
    lens, batch = _lens(), tiny_inputs("llama", length=9)
    kept = splice_ce(lens, "blocks.0.resid_out", Doubler(), batch)
    spliced = splice_ce(lens, "blocks.0.resid_out", Doubler(), batch, skip_first=False)
    assert kept.clean == spliced.clean and kept.spliced != spliced.spliced


def test_errors_say_what_is_wrong():
    lens, batch = _lens(), tiny_inputs("llama", length=9)
    with pytest.raises(TypeError, match="reconstruct"):
        splice_ce(lens, "blocks.0.resid_out", 3.0, batch)
    with pytest.raises(ValueError, match=r"returned shape \(.*, 16\) for rows of shape \(.*, 32\)"):
        splice_ce(lens, "blocks.0.resid_out", lambda x: x[:, :16], batch)
    with pytest.raises(ValueError, match="decoder-only"):
        splice_ce(_lens("bert"), "blocks.0.resid_out", Doubler(), tiny_inputs("bert"))
    with pytest.raises(KeyError, match="blocks.7"):
        splice_ce(lens, "blocks.7.resid_out", Doubler(), batch)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in lens.model.modules())


def test_metrics_package_exports_every_name_lazily():
    import subprocess
    import sys

    import conceptlens.metrics as metrics

    for name in metrics.__all__:
        assert getattr(metrics, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        metrics.nope
    code = "import sys, conceptlens.metrics; print('networkx' in sys.modules, 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split() == ["False", "False"]

"""The cached prompt forward against the uncached references: generations (unsteered and
steered at generated positions) equal `sweep._generate` on the same rows without a cache, and
perplexity equals `continuation_perplexity` prompt by prompt."""

from __future__ import annotations

import torch

from conceptlens.steering import Add
from conceptlens.steering.compare import RowsAdd
from conceptlens.steering.prompt_cache import PromptCache
from conceptlens.steering.sweep import _generate, _left_padded
from conceptlens.steering.sweep_scores import Generation, continuation_perplexity
from tests.steering.test_sweep import PROMPTS, setup  # noqa: F401  (fixture)


def test_generations_equal_uncached_ones_unsteered_and_steered(setup):
    model, tok, lens = setup
    cached = PromptCache(model, tok, PROMPTS)
    kwargs = {"do_sample": False, "max_new_tokens": 6}
    plain = _generate(model, tok, _left_padded(tok, PROMPTS), PROMPTS, kwargs, logits=False)
    assert [g.text for g in cached.unsteered(model, tok, max_new_tokens=6)] == [g.text for g in plain]
    g = torch.Generator().manual_seed(0)
    directions = torch.randn(2, model.config.hidden_size, generator=g)
    for alpha in (1.0, 8.0):
        edit = RowsAdd(directions, len(PROMPTS), alpha, norm=1.0, site="blocks.1.resid_out")
        with lens.steer(edit, positions="generated"):
            fast = cached.generate(model, tok, 2, max_new_tokens=6)
        for r in range(2):  # each direction alone, each prompt alone, no cache
            alone = Add(directions[r], alpha, scale="robust_norm", norm=1.0, site="blocks.1.resid_out")
            for p, prompt in enumerate(PROMPTS):
                with lens.steer(alone, positions="generated"):
                    (ref,) = _generate(model, tok, _left_padded(tok, [prompt]), [prompt], kwargs, logits=False)
                got = fast[r * len(PROMPTS) + p]
                assert got.prompt == prompt and got.tokens.tolist() == ref.tokens.tolist()
    assert [g.text for g in fast[:3]] != [g.text for g in plain]  # alpha 8 does steer


def test_prompts_of_one_token_generate_as_without_the_cache(setup):
    """A batch of one-token prompts leaves no cached position before the one `generate` runs itself:
    their tiles generate as the uncached reference does, steered or not (the cache cropped to nothing
    kept the prompts' batch size and broke the tiled generation)."""
    model, tok, lens = setup
    prompts = ["w5", "w20"]
    cached = PromptCache(model, tok, prompts)
    kwargs = {"do_sample": False, "max_new_tokens": 4}
    plain = _generate(model, tok, _left_padded(tok, prompts), prompts, kwargs, logits=False)
    assert [g.tokens.tolist() for g in cached.unsteered(model, tok, max_new_tokens=4)] == \
        [g.tokens.tolist() for g in plain]
    directions = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    edit = RowsAdd(directions, len(prompts), 8.0, norm=1.0, site="blocks.1.resid_out")
    with lens.steer(edit, positions="generated"):
        fast = cached.generate(model, tok, 3, max_new_tokens=4)
    for r in range(3):
        alone = Add(directions[r], 8.0, scale="robust_norm", norm=1.0, site="blocks.1.resid_out")
        for p, prompt in enumerate(prompts):
            with lens.steer(alone, positions="generated"):
                (ref,) = _generate(model, tok, _left_padded(tok, [prompt]), [prompt], kwargs, logits=False)
            assert fast[r * len(prompts) + p].tokens.tolist() == ref.tokens.tolist()


def test_the_prompts_forward_computes_the_last_positions_logits_only(setup):
    """The cache keeps the prompts' last next-token log-probabilities; the unembedding runs on the last
    position alone (`logits_to_keep=1`), and they equal a plain forward's."""
    model, tok, _ = setup
    shapes = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    try:
        cached = PromptCache(model, tok, PROMPTS)
    finally:
        handle.remove()
    assert [s[:2] for s in shapes] == [(len(PROMPTS), 1)]
    batch = _left_padded(tok, PROMPTS)
    positions = (batch["attention_mask"].cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(**batch, position_ids=positions).logits[:, -1].double().log_softmax(-1)
    torch.testing.assert_close(cached.last, full, rtol=1e-5, atol=1e-6)


def test_perplexity_equals_the_uncached_reading_prompt_by_prompt(setup):
    model, tok, _ = setup
    cached = PromptCache(model, tok, PROMPTS)
    ids = lambda text: torch.tensor(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    continuations = ["w9 w10 w11", "", "w3", "w50 w50 w50 w50 w50", "w7 w8", "w60 w61 w62 w63"]
    generations = [Generation(PROMPTS[i % 3], c, ids(c) if c else torch.zeros(0, dtype=torch.long),
                              torch.zeros(0)) for i, c in enumerate(continuations)]
    got = cached.perplexity(model, generations)
    torch.testing.assert_close(cached.perplexity(model, generations, chunk=2), got, rtol=1e-12, atol=0,
                               equal_nan=True)  # read 2 tokens at a time: the same figures
    for i, gen in enumerate(generations):
        (ref,) = continuation_perplexity(model, tok, [gen])
        if not continuations[i]:
            assert got[i].isnan() and ref.isnan()
        else:
            torch.testing.assert_close(got[i], ref, rtol=1e-5, atol=0)


def test_continuations_whose_logits_exceed_the_bound_run_a_slice_at_a_time_with_the_same_perplexities(setup,
                                                                                                       monkeypatch):
    """Past `sweep_scores.LOGITS_BYTES` the forward over continuations runs as many rows at a time as fit
    (here 2 of the 3 prompts' tile: 5 forwards for 9 continuations, slices that cut across tiles), each
    with its own copy of those rows' cache: the figures equal the single forward's and each
    continuation read alone."""
    from conceptlens.steering import sweep_scores

    model, tok, _ = setup
    cached = PromptCache(model, tok, PROMPTS)
    ids = lambda text: torch.tensor(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    continuations = ["w9 w10 w11", "w2 w5", "w3 w4", "w50 w50 w50 w50 w50", "w7 w8", "w60 w61 w62 w63",
                     "w1 w1", "w12 w13 w14", "w40 w41"]
    generations = [Generation(PROMPTS[i % 3], c, ids(c), torch.zeros(0)) for i, c in enumerate(continuations)]
    whole = cached.perplexity(model, generations)
    rows = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(len(kwargs["input_ids"])),
                                             with_kwargs=True)
    longest = max(len(ids(c)) for c in continuations) - 1
    monkeypatch.setattr(sweep_scores, "LOGITS_BYTES", 2 * longest * model.get_output_embeddings().weight.shape[0] * 4)
    try:
        sliced = cached.perplexity(model, generations)
    finally:
        handle.remove()
    assert rows == [2, 2, 2, 2, 1]
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=0)  # forwards of other shapes: rounding may differ
    for i, gen in enumerate(generations):
        (ref,) = continuation_perplexity(model, tok, [gen])
        torch.testing.assert_close(sliced[i], ref, rtol=1e-5, atol=0)

"""Per-extractor budgets (`FitConfig.extractor_tokens`): in one pass, an extractor with its own budget
ends exactly where a fit of that many tokens ends it, the others go on, and a fit stopped between
the budgets resumes to the same states."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.concepts.deleuzian import Deleuzian
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.concepts.sae import TopKSAE
from tests.conftest import CharTokenizer, assert_same_state, tiny_model

SITE = "blocks.1.resid_out"
DOCS = [f"document {i}: " + "abcdefghij"[i % 10] * (5 + i % 7) + " and so on" for i in range(120)]
OPTIONS = dict(batch_size=8, max_length=24, progress=False)


def _extractors() -> dict[str, object]:
    torch.manual_seed(0)  # the SAE's init and the global generator the others may draw from
    return {"sae": TopKSAE(width=32, k=4, batch_size=64, buffer_size=128, warmup_tokens=64),
            "km": StreamingKMeans(n_concepts=4, init_size=32),
            "del": Deleuzian(n_concepts=4, buffer_size=256, batch_size=64)}


def _fit(**options):
    extractors = _extractors()
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    report = lens.fit({SITE: extractors}, DOCS, **OPTIONS, **options)
    return report, {name: e.state_dict() for name, e in extractors.items()}


def test_an_extractor_with_its_own_budget_ends_as_a_fit_of_that_budget_and_the_others_go_on():
    short, short_states = _fit(max_tokens=800)
    long, long_states = _fit(max_tokens=2400)
    both, states = _fit(max_tokens=2400, extractor_tokens={"sae": 800})
    assert short.tokens < both.tokens == long.tokens
    assert_same_state(states["sae"], short_states["sae"])  # fed the same batches, flushed the same rows
    assert_same_state(states["km"], long_states["km"])
    assert_same_state(states["del"], long_states["del"])
    assert both.concepts["sae"].config["fit"]["tokens"] == short.tokens  # what it was fed, recorded
    assert both.concepts["km"].config["fit"]["tokens"] == long.tokens
    assert torch.equal(both.concepts["sae"].directions, short.concepts["sae"].directions)
    assert both.stats["sae"].steps == short.stats["sae"].steps < long.stats["sae"].steps
    assert both.fed == {"sae": short.tokens, "km": long.tokens, "del": long.tokens}
    assert f"  sae: fed the first {short.tokens:,} tokens, its own budget" in both.summary().splitlines()
    assert "its own budget" not in long.summary()


def test_the_fit_stops_once_every_extractor_has_had_its_budget():
    alone, _ = _fit(max_tokens=1200)
    capped, _ = _fit(extractor_tokens={"sae": 800, "km": 1200, "del": 400})  # no max_tokens: the source's end
    assert capped.tokens == alone.tokens < sum(len(d) for d in DOCS)


def test_a_fit_stopped_between_the_budgets_resumes_to_the_same_states(tmp_path):
    _, whole = _fit(max_tokens=2400, extractor_tokens={"sae": 800})
    first, _ = _fit(max_tokens=1600, extractor_tokens={"sae": 800}, checkpoint_dir=str(tmp_path))
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["state"]["progress"]["stopped"]
    assert saved == {"sae": first.concepts["sae"].config["fit"]["tokens"]}
    resumed, states = _fit(max_tokens=2400, extractor_tokens={"sae": 800}, checkpoint_dir=str(tmp_path))
    assert resumed.resumed_from == first.tokens
    for name in whole:
        assert_same_state(states[name], whole[name], name)
    assert resumed.concepts["sae"].config["fit"]["tokens"] == first.concepts["sae"].config["fit"]["tokens"]


def test_a_budget_for_an_extractor_the_fit_does_not_have_is_refused_before_any_work():
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    with pytest.raises(ValueError, match=r"extractor_tokens names 'sea'.*its extractors: del, km, sae"):
        lens.fit({SITE: _extractors()}, DOCS, extractor_tokens={"sea": 10}, **OPTIONS)
    with pytest.raises(ValueError, match="extractor_tokens"):
        lens.fit({SITE: _extractors()}, DOCS, extractor_tokens={"sae": 0}, **OPTIONS)


def test_a_description_pass_does_not_take_the_fits_own_budgets():
    from conceptlens.fit import FitConfig

    report, _ = _fit(max_tokens=1200, extractor_tokens={"sae": 400})
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    fit = FitConfig(batch_size=8, max_length=24, progress=False, max_tokens=600, extractor_tokens={"sae": 100})
    described = lens.describe({"sae": report.concepts["sae"]}, DOCS, fit=fit, top_n=2)
    assert described["sae"].info["tokens"] >= 600  # the pass's budget, not the fit's 100 for "sae"


def test_a_budget_raised_after_it_was_spent_is_said_and_not_applied(tmp_path):
    first, _ = _fit(max_tokens=1600, extractor_tokens={"sae": 800}, checkpoint_dir=str(tmp_path))
    fed = first.concepts["sae"].config["fit"]["tokens"]
    with pytest.warns(UserWarning, match=rf"sae stopped at its budget after {fed:,} tokens .* stays at {fed:,}"):
        again, _ = _fit(max_tokens=2400, extractor_tokens={"sae": 2000}, checkpoint_dir=str(tmp_path))
    assert again.concepts["sae"].config["fit"]["tokens"] == fed and again.tokens > first.tokens


def test_a_budget_added_on_resume_below_the_tokens_already_fed_is_said_and_stops_there(tmp_path):
    first, _ = _fit(max_tokens=1200, checkpoint_dir=str(tmp_path))  # no budgets: the SAE was fed all 1200+
    with pytest.warns(UserWarning, match=rf"sae's budget of 400 tokens is below the {first.tokens:,} it was fed"):
        again, _ = _fit(max_tokens=2400, extractor_tokens={"sae": 400}, checkpoint_dir=str(tmp_path))
    assert again.concepts["sae"].config["fit"]["tokens"] == first.tokens < again.tokens


def test_a_checkpoint_right_after_the_batch_that_spends_a_budget_resumes_without_feeding_it_again(tmp_path):
    """The budget is marked spent before that batch's checkpoint, so the resumed fit neither feeds the
    extractor again nor warns: it ends as the fit that was never stopped."""
    import warnings

    _, whole = _fit(max_tokens=2400, extractor_tokens={"sae": 800})
    first, _ = _fit(max_tokens=800, extractor_tokens={"sae": 800}, checkpoint_dir=str(tmp_path))
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["state"]["progress"]
    assert saved["stopped"] == {"sae": saved["tokens"]} == {"sae": first.tokens}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, states = _fit(max_tokens=2400, extractor_tokens={"sae": 800}, checkpoint_dir=str(tmp_path))
    for name in whole:
        assert_same_state(states[name], whole[name], name)


def test_budgets_are_keyed_by_extractor_names():
    from conceptlens.fit import FitConfig

    with pytest.raises(ValueError, match=r"keyed by extractor names \(a pair's is 'SOURCE->TARGET'.*\('a', 'b'\)"):
        FitConfig(extractor_tokens={("a", "b"): 10})


SHALLOW = "blocks.0.resid_out"


def _two_sites(**options):
    """The SAE at the deep site, k-means at the shallow one: the report, both states, and how many
    times the last block ran."""
    extractors = _extractors()
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    calls = []
    lens.model.model.layers[1].register_forward_hook(lambda *_: calls.append(1))
    report = lens.fit({SITE: {"sae": extractors["sae"]}, SHALLOW: {"km": extractors["km"]}}, DOCS,
                      **OPTIONS, **options)
    return report, {n: extractors[n].state_dict() for n in ("sae", "km")}, len(calls)


def test_a_site_read_only_by_spent_extractors_is_captured_no_more():
    """Once the deep site's only extractor has had its budget, forwards stop at the shallow site
    (the last block runs no more), the deep site's rows count up to the budget, and every state is
    the one a fit of both sites without the narrowing gives."""
    short, short_states, short_calls = _two_sites(max_tokens=800)
    long, long_states, long_calls = _two_sites(max_tokens=2400)
    both, states, calls = _two_sites(max_tokens=2400, extractor_tokens={"sae": 800})
    assert both.tokens == long.tokens and both.batches == long.batches > short.batches
    assert calls == short_calls == short.batches < long_calls  # the last block ran for the sae's batches only
    assert both.rows[SITE] == short.rows[SITE] and both.rows[SHALLOW] == long.rows[SHALLOW]
    assert_same_state(states["sae"], short_states["sae"])
    assert_same_state(states["km"], long_states["km"])


def test_a_fit_resumed_after_the_deep_sites_budget_starts_at_the_shallow_site(tmp_path):
    """Resumed from a checkpoint taken after the deep site's budget was spent, the fit captures the
    shallow site only from its first batch (the last block never runs) and ends as the fit that was
    never stopped."""
    _, whole, _ = _two_sites(max_tokens=2400, extractor_tokens={"sae": 800})
    first, _, _ = _two_sites(max_tokens=1600, extractor_tokens={"sae": 800}, checkpoint_dir=str(tmp_path))
    resumed, states, calls = _two_sites(max_tokens=2400, extractor_tokens={"sae": 800},
                                        checkpoint_dir=str(tmp_path))
    assert resumed.resumed_from == first.tokens > 800 and resumed.batches > 0
    assert calls == 0
    for name in whole:
        assert_same_state(states[name], whole[name], name)


def test_the_progress_bar_ends_where_the_budgets_end():
    from conceptlens.fit import FitConfig, _progress
    from conceptlens.fit_keys import plan_extractors

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    plan = plan_extractors(lens, {SITE: _extractors()})
    total = lambda **c: _progress(FitConfig(progress=False, **c), plan, 0).total  # noqa: E731
    assert total(max_tokens=2400) == 2400
    assert total(max_tokens=2400, extractor_tokens={"sae": 800}) == 2400  # the others read on
    assert total(extractor_tokens={"sae": 800, "km": 1200, "del": 400}) == 1200
    assert total(max_tokens=1000, extractor_tokens={"sae": 800, "km": 1200, "del": 400}) == 1000
    assert total() is None


def test_a_checkpoint_past_a_lowered_max_tokens_is_refused_and_one_it_could_have_written_resumes(tmp_path):
    first, saved = _fit(max_tokens=1600, checkpoint_dir=str(tmp_path))
    began = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["state"]["progress"]["last_batch_from"]
    assert began < 1600 <= first.tokens  # its last batch reached the budget
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    extractors = _extractors()
    before = {name: e.state_dict() for name, e in extractors.items()}
    message = (f"holds a fit of {first.tokens:,} tokens, past max_tokens=800: .*last batch began at {began:,}; "
               f"give max_tokens above {began:,}, or start again with resume=False")
    with pytest.raises(ValueError, match=message):
        lens.fit({SITE: extractors}, DOCS, max_tokens=800, checkpoint_dir=str(tmp_path), **OPTIONS)
    for name, extractor in extractors.items():  # refused before the checkpoint's states were loaded
        assert_same_state(extractor.state_dict(), before[name], name)
    # a budget just above where its last batch began stops where it did: the resume equals a fresh fit of it
    fresh, fresh_states = _fit(max_tokens=began + 1)
    resumed, states = _fit(max_tokens=began + 1, checkpoint_dir=str(tmp_path))
    assert resumed.resumed_from == resumed.tokens == fresh.tokens == first.tokens
    for name in saved:
        assert_same_state(states[name], fresh_states[name], name)


def test_a_checkpoint_from_before_the_budget_record_stays_unchecked_and_a_damaged_record_is_the_resumes(tmp_path):
    """A checkpoint without `last_batch_from` (written before it) resumes under any budget and, saved again
    without a batch, does not claim one; a damaged record is left for the resume to name, in one line."""
    from conceptlens._io import save_object, state_digest
    from conceptlens.checkpoint import check_budget, read_checkpoint

    _fit(max_tokens=1600, checkpoint_dir=str(tmp_path))
    path = tmp_path / "checkpoint.pt"

    def rewrite(change):
        payload = torch.load(path, weights_only=True)
        change(payload["state"]["progress"])
        payload["sha256"] = state_digest(payload["state"])
        save_object(payload, path)

    rewrite(lambda progress: progress.pop("last_batch_from"))
    check_budget(path, 800)  # unknown: not refused
    resumed, _ = _fit(max_tokens=800, checkpoint_dir=str(tmp_path))  # resumed, nothing to add, saved again
    assert resumed.resumed_from == resumed.tokens and "last_batch_from" not in read_checkpoint(path)["progress"]
    rewrite(lambda progress: progress.update(last_batch_from="12"))
    check_budget(path, 800)  # no TypeError here: the resume reads the file and names what is wrong
    with pytest.raises(ValueError, match="last_batch_from must be an int"):
        _fit(max_tokens=800, checkpoint_dir=str(tmp_path))

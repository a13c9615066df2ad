"""`conceptlens steer` on a tiny random Llama saved with a word-level tokenizer in a folder."""

from __future__ import annotations

import re

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet, models
from conceptlens.cli import main
from conceptlens.commands.steer import continuations, side_by_side
from conceptlens.steering import Add, robust_norm
from tests.conftest import tiny_model
from tests.steering.test_sweep import word_tokenizer

PROMPT = "w5 w6 w7"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved tiny model and a saved 3-concept set at blocks.1.resid_out."""
    root = tmp_path_factory.mktemp("steer")
    model, tok = tiny_model("llama"), word_tokenizer()
    model.generation_config.eos_token_id = 1
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    ConceptSet(torch.randn(3, 32, generator=torch.Generator().manual_seed(0)),
               site="blocks.1.resid_out").save(root / "concepts")
    return str(root / "model"), str(root / "concepts")


def _steer(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["steer", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_word_direction_prints_both_continuations(folders, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    model_dir, _ = folders
    code, out, _ = _steer(capsys, "--model", model_dir, "--direction-word", "w50", "--site", "final",
                          "--alpha", "400", "--scale", "unit", "--prompt", PROMPT, "--max-new-tokens", "4")
    assert code == 0
    model, tok = models.load(model_dir)
    lens = conceptlens.attach(model, tok)
    direction = model.get_output_embeddings().weight[50].detach()
    bare, steered = continuations(lens, Add(direction / direction.norm(), 400.0, site="final"), PROMPT,
                                  max_new_tokens=4)
    assert steered.split()[1:] == ["w50"] * 3 and bare != steered  # the first token comes from the prompt
    assert "unembedding of 'w50', alpha 400 at final (unit direction: |v| = 400), positions=generated" in out
    assert f"{bare:<98} | {steered}" in out


def test_concept_from_a_saved_set(folders, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    model_dir, concepts_dir = folders
    code, out, _ = _steer(capsys, "--model", model_dir, "--concepts", concepts_dir, "--concept", "2", "0",
                          "--alpha", "30", "--prompt", PROMPT, "--max-new-tokens", "4", "--positions", "all")
    assert code == 0 and "concepts 2, 0, alpha 30 at blocks.1.resid_out (x robust norm " in out


def test_default_unit_is_the_robust_norm_and_sets_with_a_mean_are_centred(folders, capsys, tmp_path):
    model_dir, _ = folders
    g = torch.Generator().manual_seed(1)
    cs = ConceptSet(torch.randn(3, 32, generator=g), site="blocks.1.resid_out", method="kmeans",
                    mean=torch.randn(32, generator=g))
    cs.save(tmp_path / "km")
    code, out, _ = _steer(capsys, "--model", model_dir, "--concepts", str(tmp_path / "km"), "--concept", "1",
                          "--prompt", PROMPT, "--max-new-tokens", "2")
    model, tok = models.load(model_dir)
    norm = robust_norm(conceptlens.attach(model, tok), "blocks.1.resid_out")
    assert code == 0 and "concept 1 (centred), alpha 0.5 at blocks.1.resid_out" in out
    assert f"x robust norm {norm:.4g}: |v| = {0.5 * norm:.4g}" in out
    code, out, _ = _steer(capsys, "--model", model_dir, "--concepts", str(tmp_path / "km"), "--concept", "1",
                          "--no-centre", "--scale", "raw", "--alpha", "2", "--prompt", PROMPT, "--max-new-tokens", "2")
    assert code == 0 and "concept 1, alpha 2" in out and f"raw direction: |v| = {2 * cs.directions[1].norm():.4g}" in out


@pytest.mark.parametrize("argv, message", [
    (["--concept", "3"], "--concept 3 is out of range: .* holds 3 concepts, valid indices are 0-2"),
    (["--concept", "-4"], "valid indices are 0-2"),
    ([], "holds 3 concepts: choose with --concept I \\(0-2\\)"),
    (["--concept", "1", "--site", "blocks.0.resid_out"], "live at 'blocks.1.resid_out'"),
    (["--concept", "1", "--site", "blocks.7.resid_out"], "blocks.7.resid_out"),
])
def test_bad_concept_arguments_name_the_valid_range(folders, capsys, argv, message):
    model_dir, concepts_dir = folders
    code, _, err = _steer(capsys, "--model", model_dir, "--concepts", concepts_dir, "--prompt", PROMPT, *argv)
    assert code == 2
    assert err.startswith("conceptlens steer: error:")
    assert re.search(message, err), err


def test_word_and_missing_folder_errors(folders, capsys, tmp_path):
    model_dir, _ = folders
    code, _, err = _steer(capsys, "--model", model_dir, "--direction-word", "w5", "--concept", "1", "--prompt", "w5")
    assert code == 2 and "--direction-word" in err
    code, _, err = _steer(capsys, "--model", model_dir, "--concepts", str(tmp_path / "nope"), "--prompt", "w5")
    assert code == 2 and "nope' does not exist" in err
    code, _, err = _steer(capsys, "--model", model_dir, "--prompt", "w5")  # one of --concepts / --direction-word
    assert code == 2 and "required" in err and len(err.strip().splitlines()) == 1


def test_a_direction_at_the_attention_pattern_is_refused_in_one_line(folders, capsys):
    model_dir, _ = folders
    code, _, err = _steer(capsys, "--model", model_dir, "--direction-word", "w50", "--site", "blocks.1.attn.pattern",
                          "--prompt", PROMPT)
    assert code == 2 and "blocks.1.attn.pattern is read only" in err and len(err.strip().splitlines()) == 1


def test_a_set_at_no_model_site_is_refused_in_one_line(folders, capsys, tmp_path):
    model_dir, _ = folders
    site = "blocks.0.mlp.in->blocks.0.mlp_out:z_e"  # a CLVQ code space
    ConceptSet(torch.randn(4, 32), site=site, method="clvq").save(tmp_path / "clvq")
    code, _, err = _steer(capsys, "--model", model_dir, "--concepts", str(tmp_path / "clvq"), "--concept", "1",
                          "--prompt", PROMPT)
    assert code == 2 and f"lives at {site!r}, not at one site of the model: steer takes a set of one site" in err
    assert len(err.strip().splitlines()) == 1


def test_continuations_equal_plain_generate():
    model, tok = tiny_model("llama"), word_tokenizer()
    lens = conceptlens.attach(model, tok)
    edit = Add(torch.randn(32, generator=torch.Generator().manual_seed(2)), 20.0, site="blocks.0.resid_out")
    bare, steered = continuations(lens, edit, PROMPT, positions="all", max_new_tokens=5)
    ids = tok([PROMPT], return_tensors="pt")
    with torch.no_grad():
        plain = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        with lens.steer(edit):
            edited = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert bare == tok.decode(plain[0, 3:]) and steered == tok.decode(edited[0, 3:])


def test_side_by_side_columns():
    text = side_by_side("a", "word " * 8, "b", "five", width=63)  # two columns of 30
    assert text.splitlines() == [f"{'a':<30} | b", f"{'-' * 30} | {'-' * 30}", f"{'word ' * 5 + 'word':<30} | five",
                                 "word word".ljust(30) + " |"]
    assert side_by_side("a", "x", "b", "y", width=40) == "a:\nx\n\nb:\ny"  # narrow: stacked


def test_a_set_of_a_run_steers_the_model_its_run_fitted_and_a_bad_index_is_named_before_it_loads(folders, tmp_path,
                                                                                                capsys, monkeypatch):
    model_dir, _ = folders
    run = tmp_path / "run"
    ConceptSet(torch.randn(3, 32, generator=torch.Generator().manual_seed(0)), site="blocks.1.resid_out",
               model="model").save(run / "concepts" / "km")  # a set names a local model by its last part only
    (run / "run.toml").write_text(f'model = "{model_dir}"\ndata = "bbc-news"\nsites = ["blocks.1.resid_out"]\n')
    code, out, err = _steer(capsys, "--concepts", str(run / "concepts" / "km"), "--concept", "1", "--prompt", PROMPT,
                            "--max-new-tokens", "2")  # no --model: the run's (SmolLM2 before, width 576: refused)
    assert code == 0, err
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = _steer(capsys, "--concepts", str(run / "concepts" / "km"), "--concept", "7", "--prompt", PROMPT)
    assert code == 2 and "--concept 7 is out of range" in err
    loose = tmp_path / "loose"
    ConceptSet(torch.randn(3, 32), site="blocks.1.resid_out").save(loose)
    code, _, err = _steer(capsys, "--concepts", str(loose), "--concept", "1", "--prompt", PROMPT)
    assert code == 2 and "names no model: pass --model" in err


@pytest.mark.parametrize("command", ["steer", "sweep"])
def test_steering_an_encoder_is_refused_in_one_line(command, capsys):
    assert main([command, "--model", "minilm-l6", "--direction-word", "news", *(["--prompt", "hi"] if command ==
                                                                                "steer" else [])]) == 2
    err = capsys.readouterr().err  # a traceback ("no attribute generate") before
    assert f"{command} continues" in err and "BertModel has no language-model head (an encoder)" in err
    assert err.count("\n") == 1


def test_a_crosscoders_concept_is_steered_at_the_site_given(folders, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    model_dir, _ = folders
    sites = ["blocks.0.resid_out", "blocks.1.resid_out"]
    at_0, at_1 = torch.zeros(2, 32), torch.zeros(2, 32)
    at_0[1, 0], at_1[1, 1] = 1.0, 1.0  # concept 1: coordinate 0 at blocks.0, coordinate 1 at blocks.1
    ConceptSet(torch.cat([at_0, at_1], 1), site="+".join(sites), method="crosscoder",
               config={"widths": [32, 32], "fit": {"target_site": None, "sources": sites, "targets": sites}}
               ).save(tmp_path / "cc")
    argv = ["--model", model_dir, "--concepts", str(tmp_path / "cc"), "--concept", "1", "--prompt", PROMPT,
            "--max-new-tokens", "2", "--scale", "raw", "--alpha", "3"]
    code, _, err = _steer(capsys, *argv)  # a site error about 'blocks.0.resid_out+blocks.1.resid_out' before
    assert code == 2 and "span 2 sites (blocks.0.resid_out, blocks.1.resid_out): steer at one of them with --site" in err
    assert _steer(capsys, *argv, "--site", "blocks.2.resid_out")[0] == 2
    seen = []
    monkeypatch.setattr("conceptlens.commands.steer.continuations",
                        lambda lens, edit, *a, **k: seen.append(edit) or ("a", "b"))
    code, out, _ = _steer(capsys, *argv, "--site", "blocks.1.resid_out")
    assert code == 0 and "concept 1, alpha 3 at blocks.1.resid_out" in out
    assert seen[0].vector.tolist() == (3 * at_1[1]).tolist()


def test_a_direction_word_of_several_tokens_is_refused_with_the_pieces_and_a_one_token_spelling(folders, capsys):
    model_dir, _ = folders  # it steered along the first piece's row, silently
    argv = ["--model", model_dir, "--site", "final", "--prompt", PROMPT, "--max-new-tokens", "2"]
    code, _, err = _steer(capsys, *argv, "--direction-word", "w50 w51")
    assert code == 2 and "--direction-word 'w50 w51' is 2 tokens here ('w50', 'w51'); give a word of one token" in err


def test_the_refusal_names_the_spelling_with_a_leading_space_when_that_is_one_token():
    from types import SimpleNamespace

    from conceptlens.commands.steer import word_direction

    pieces = {"wedding": [7, 8], " wedding": [9]}  # as SmolLM2's BPE splits them

    def tokenizer(text, add_special_tokens):
        return {"input_ids": pieces[text]}

    tokenizer.decode = lambda ids: {7: "wed", 8: "ding", 9: " wedding"}[ids[0]]
    lens = SimpleNamespace(tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"^--direction-word 'wedding' is 2 tokens here \('wed', 'ding'\); "
                                         r"' wedding', with a leading space, is one$"):
        word_direction(lens, "wedding", None)
    pieces = {" wedding": [5, 6], "wedding": [6]}  # SentencePiece: the space is a piece of its own ('▁')
    tokenizer.decode = lambda ids: {5: "", 6: "wedding"}[ids[0]]
    with pytest.raises(ValueError, match=r"^--direction-word ' wedding' is 2 tokens here \('', 'wedding'\); "
                                         r"'wedding', without spaces, is one$"):
        word_direction(lens, " wedding", None)

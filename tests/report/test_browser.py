"""The report in a real headless browser (Debian's chromium + chromium-driver via selenium).

Checks that the index and a concept page load from file:// with no console errors, that the
index lists every expected concept with working links both ways, and that sorting and the
filter act on the table, that a run with `eval.json` and `peers.json` shows the suite's table
on the index and a concept's own scores on its page, and that a run folder with hostile names,
labels, tokens and suite figures runs no script and keeps numbers in order. On an atlas described for real on a tiny Llama with a byte-level
tokenizer (every non-ASCII character split into byte tokens): every figure carries its
legend, no token chip shows U+FFFD, and the random control is a quality-table row, not a
concept set. Screenshots are kept under tests/artefacts/ (ignored by git).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conceptlens.report import write_report
from tests.report.atlas_fixture import write_fake_run
from tests.report.test_evaluation_report import write_fake_eval, write_fake_peers

ARTEFACTS = Path(__file__).resolve().parents[1] / "artefacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

if not (CHROMIUM and DRIVER):
    if os.environ.get("CI"):  # .ci/run installs them: missing there is a failure, not a skip
        raise RuntimeError("chromium and chromium-driver are missing; scripts/setup.sh installs them with apt-get")
    pytest.skip("chromium / chromedriver not installed (scripts/setup.sh installs them)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

EXTRACTORS = [("topk", "topk-sae", 12), ("kmeans", "kmeans", 8)]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    profile = tmp_path_factory.mktemp("chromium-profile")  # own profile: parallel runs do not collide
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,1400", "--disable-background-networking", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    run = write_fake_run(tmp_path_factory.mktemp("browser") / "run", EXTRACTORS, hierarchy="topk")
    return write_report(run).path.parent


def _errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def _shot(driver, name: str) -> None:
    ARTEFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTEFACTS / name))
    assert (ARTEFACTS / name).stat().st_size > 10_000


def test_index_lists_concepts_and_links_to_them(browser, report):
    browser.get((report / "index.html").as_uri())
    assert _errors(browser) == []
    links = browser.find_elements(By.CSS_SELECTOR, "#concepts a.concept")
    got = sorted(a.get_attribute("href").split("/concepts/")[1] for a in links)
    assert got == sorted(f"{name}/{i}.html" for name, _, n in EXTRACTORS for i in range(n))
    first = browser.find_element(By.ID, "map-extractor").get_attribute("value")  # extractors in name order
    assert first == "kmeans" and len(browser.find_elements(By.CSS_SELECTOR, "#map a circle")) == 8
    _shot(browser, "report_index.png")
    # filter by extractor, then sort by frequency (descending on first click)
    browser.find_element(By.CSS_SELECTOR, "#extractor option[value=kmeans]").click()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#concepts tbody tr")) == 8
    browser.find_element(By.CSS_SELECTOR, "th[data-col=frequency]").click()
    freqs = [float(td.text.rstrip("%")) for td in browser.find_elements(By.CSS_SELECTOR, "#concepts tbody tr td:nth-child(3)")]
    assert freqs == sorted(freqs, reverse=True)
    # clicking a concept opens its page, which links back to the index
    browser.find_element(By.CSS_SELECTOR, "#concepts a.concept").click()
    assert "/concepts/kmeans/" in browser.current_url and browser.title.startswith("kmeans #")
    assert _errors(browser) == []
    browser.find_element(By.LINK_TEXT, "atlas index").click()
    assert browser.current_url.endswith("/index.html")


def test_concept_page_loads_and_links(browser, report):
    browser.get((report / "concepts" / "topk" / "1.html").as_uri())
    assert _errors(browser) == []
    assert browser.title.startswith("topk #1")
    assert len(browser.find_elements(By.CSS_SELECTOR, ".ctx")) == 6
    assert browser.find_elements(By.CSS_SELECTOR, "svg rect")  # histogram bars
    _shot(browser, "report_concept.png")
    nearest = browser.find_elements(By.CSS_SELECTOR, "ol a")[0]
    target = nearest.get_attribute("href")
    nearest.click()
    assert browser.current_url == target and _errors(browser) == []
    for page in ("matches.html", "hierarchy/topk.html"):
        browser.get((report / page).as_uri())
        assert _errors(browser) == [] and browser.find_elements(By.CSS_SELECTOR, "a[href*='concepts/']")


@pytest.fixture(scope="module")
def suite_report(tmp_path_factory) -> Path:
    run = write_fake_run(tmp_path_factory.mktemp("suite") / "run", EXTRACTORS)
    write_fake_eval(run, {name: n for name, _, n in EXTRACTORS})
    write_fake_peers(run)
    return write_report(run).path.parent


VERDICT_COLOURS = """return [...document.querySelectorAll('table.suite tbody td:nth-child(6) span')]
  .map(s => [s.textContent, getComputedStyle(s).color]);"""


def test_suite_table_and_a_concepts_scores_as_a_user_sees_them(browser, suite_report):
    browser.get((suite_report / "index.html").as_uri())
    assert _errors(browser) == [] and browser.execute_script(EVERY_FIGURE_HAS_A_LEGEND) == 0
    headings = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "h2, h3")]
    assert "Evaluation suite" in headings and "Quality" not in headings
    rows = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            for tr in browser.find_elements(By.CSS_SELECTOR, "table.suite tbody tr")]
    assert len(rows) == 8  # per set: three probe lines and FVU; concept 1's own score is not an index row
    k1 = next(r for r in rows if r[:2] == ["topk", "toy k=1 accuracy"])
    assert k1[2:6] == ["0.9100 [0.8800, 0.9400]", "random 12 dirs\n0.7000 [0.6500, 0.7500]",
                       "diff-of-means 0.8000 [0.7800, 0.8300]", "wins"]
    colours = dict(browser.execute_script(VERDICT_COLOURS))
    assert colours["wins"] == "rgb(10, 125, 50)" and colours["loses"] == "rgb(179, 38, 30)"  # green, red
    peers = [tr.text for tr in browser.find_elements(By.CSS_SELECTOR, "table.peers tbody tr")]
    assert peers == ["ours-topk 49,152 12.5 0.21 32 0.93", "sparsify-topk 49,152 20 0.24 32"]
    browser.execute_script("document.querySelector('table.suite').scrollIntoView()")
    _shot(browser, "report_suite_index.png")
    browser.get((suite_report / "concepts" / "topk" / "1.html").as_uri())
    assert _errors(browser) == [] and browser.execute_script(EVERY_FIGURE_HAS_A_LEGEND) == 0
    (row,) = [tr.text for tr in browser.find_elements(By.CSS_SELECTOR, "table.suite tbody tr")]
    assert row.split("\n") == ["probing toy toy sport: accuracy of this concept alone 0.6600 [0.6100, 0.7000] random 12 dirs, best 1",
                               "0.5500 [0.5000, 0.6000] diff-of-means 0.8000 [0.7800, 0.8300] wins rank 1"]
    browser.execute_script("document.querySelector('table.suite').scrollIntoView()")
    _shot(browser, "report_suite_concept.png")
    browser.get((suite_report / "concepts" / "topk" / "2.html").as_uri())
    assert not browser.find_elements(By.CSS_SELECTOR, "table.suite")
    assert "this one was not among them" in browser.find_element(By.TAG_NAME, "body").text


# A run folder from someone else: an extractor folder name that closes an attribute, markup in
# n_alive, tokens, class labels and the method, and a right-to-left override in every label.
NAME = "x' autofocus onfocus=window.__pwned=1 tabindex=0 y='<img src=x onerror=window.__pwned=5>"
ATTACKS = ["<img src=x onerror=window.__pwned=2>", "<img src=x onerror=window.__pwned=3>", "'><img src=x onerror=window.__pwned=4>"]


def _hostile_run(root: Path) -> Path:
    import json

    from tests.report.atlas_fixture import LABELS

    run = write_fake_run(root / "run", [("plain", "kmeans", 6), ("topk", "topk-sae", 6)], hierarchy="topk")
    for sub in ("describe", "concepts"):
        (run / sub / "topk").rename(run / sub / NAME)
    dag = json.loads((run / "hierarchy" / "topk.json").read_text())
    dag["graph"]["n_alive"] = ATTACKS[0]
    (run / "hierarchy" / f"{NAME}.json").write_text(json.dumps(dag))
    (run / "hierarchy" / "topk.json").unlink()
    for name in ("plain", NAME):
        folder = run / "describe" / name
        lines = [json.loads(line) for line in (folder / "contexts.jsonl").read_text().splitlines()]
        for line in lines:
            for c in line["contexts"]:
                c["tokens"][c["center"]], c["tokens"][0] = "\u202eevil", ATTACKS[1]
        (folder / "contexts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        meta = json.loads((folder / "description.json").read_text())
        meta["labels"] = [ATTACKS[2] + label for label in LABELS]
        meta["base_rate_entropy"] = {label: 0.5 for label in meta["labels"]}
        meta["method"] = ATTACKS[2]
        (folder / "description.json").write_text(json.dumps(meta))
    write_fake_eval(run, {"plain": 6}, text=ATTACKS[0], model=ATTACKS[1])
    write_fake_peers(run, text=ATTACKS[2])
    return run


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    from conceptlens.report import atlas

    run = _hostile_run(tmp_path_factory.mktemp("hostile"))
    with pytest.MonkeyPatch.context() as mp:  # as if the name had got past the name rule: pages must still escape it
        mp.setattr(atlas, "check_name", lambda name, what="": name, raising=False)
        return write_report(run).path.parent


INJECTED = """return [document.images.length, window.__pwned === undefined,
  [...document.querySelectorAll('*')].filter(e => [...e.attributes].some(a => a.name.startsWith('on'))).length,
  document.body.innerText.includes('\\u202e')]"""

ORDER = """const walk = document.createTreeWalker(document.querySelector('ol'), NodeFilter.SHOW_TEXT);
for (let node = walk.nextNode(); node; node = walk.nextNode()) {
  const t = node.textContent, a = t.lastIndexOf('(') + 1, b = t.lastIndexOf(')') - 1;
  if (a < 1 || b <= a) continue;
  const x = i => { const r = document.createRange(); r.setStart(node, i); r.setEnd(node, i + 1);
                   return r.getBoundingClientRect().left; };
  return [t, x(a), x(b)];
}"""


def test_hostile_names_labels_and_tokens_run_no_script(browser, hostile):
    for page in ("index.html", "matches.html", f"hierarchy/{NAME}.html", f"concepts/{NAME}/0.html",
                 "concepts/plain/0.html", "concepts/plain/1.html"):  # plain #1: suite scores with markup in them
        browser.get((hostile / page).as_uri())
        assert browser.execute_script(INJECTED) == [0, True, 0, False], page
    browser.get((hostile / "index.html").as_uri())
    rows = browser.find_elements(By.CSS_SELECTOR, "#concepts a.concept")
    assert len(rows) == 12 and "\u27e8U+202E\u27e9evil" in browser.find_element(By.ID, "concepts").text
    link = next(a for a in rows if NAME in a.find_element(By.XPATH, "../..").text)
    link.click()  # the name percent-encoded in the link opens its page
    assert browser.title.startswith(NAME + " #")
    # a label holding U+202E does not reverse the score beside it: "(0.412)", first digit leftmost
    browser.get((hostile / "concepts" / "plain" / "0.html").as_uri())
    text, first, last = browser.execute_script(ORDER)
    assert "\u27e8U+202E\u27e9evil (" in text and first < last


TEXTS = [f"Le café n°{i} — naïve résumé, 日本 {'ü' * (i % 3 + 1)} ok" for i in range(24)]
EVERY_FIGURE_HAS_A_LEGEND = """return Array.from(document.querySelectorAll('svg, table')).filter(e => {
  const f = e.closest('figure'), c = f && f.querySelector(':scope > figcaption.legend');
  return !(c && c.textContent.trim().length > 20); }).length;"""


@pytest.fixture(scope="module")
def described(tmp_path_factory) -> Path:
    """A run described on a tiny Llama with a byte-level BPE tokenizer: k-means and a random control."""
    import torch
    import transformers as tf

    import conceptlens
    from conceptlens import ConceptSet
    from conceptlens.concepts.kmeans import StreamingKMeans
    from tests.tiny_folder import save_tiny_llama

    root = tmp_path_factory.mktemp("described")
    folder = save_tiny_llama(root / "tiny")
    lens = conceptlens.attach(tf.AutoModelForCausalLM.from_pretrained(folder), tf.AutoTokenizer.from_pretrained(folder))
    site, run = "blocks.1.resid_out", root / "run"
    km = lens.fit({site: StreamingKMeans(6, seed=0)}, TEXTS, max_length=64, progress=False).concepts[site]
    g = torch.Generator().manual_seed(1)
    sets = {"kmeans": km, "random": ConceptSet(torch.randn(6, 32, generator=g), site, method="random", mean=km.mean)}
    for name, cs in sets.items():
        cs.save(run / "concepts" / name)
    lens.describe(sets, TEXTS, max_length=64, progress=False, top_n=4, out=str(run / "describe"))
    return write_report(run).path.parent


def test_every_figure_has_a_legend_and_chips_decode_whole_characters(browser, described):
    browser.get((described / "index.html").as_uri())
    assert _errors(browser) == [] and browser.execute_script(EVERY_FIGURE_HAS_A_LEGEND) == 0
    assert browser.find_elements(By.CSS_SELECTOR, "#map circle") and browser.find_elements(By.ID, "map-classes")
    _shot(browser, "report_described_index.png")
    non_ascii = 0
    for i in range(6):
        browser.get((described / "concepts" / "kmeans" / f"{i}.html").as_uri())
        assert _errors(browser) == [] and browser.execute_script(EVERY_FIGURE_HAS_A_LEGEND) == 0
        chips = [e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, ".ctx i, .tok")]
        assert chips and not [c for c in chips if "\ufffd" in c]
        non_ascii += sum(any(ord(ch) > 127 for ch in c) for c in chips)  # whole characters, not bytes
    _shot(browser, "report_described_concept.png")
    assert non_ascii > 0


def test_controls_are_rows_of_the_quality_table_not_concepts(browser, described):
    browser.get((described / "index.html").as_uri())
    names = {o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#extractor option, #map-extractor option")}
    assert names == {"", "kmeans"}
    shown = {td.text for td in browser.find_elements(By.CSS_SELECTOR, "#concepts tbody tr td:first-child")}
    assert shown == {"kmeans"} and not (described / "concepts" / "random").exists()
    quality = [tr.text for tr in browser.find_elements(By.CSS_SELECTOR, "table.quality tbody tr")]
    assert any(row.startswith("control: random, best of 6 (for kmeans)") for row in quality)


def test_the_map_draws_a_set_of_more_concepts_than_a_call_takes_arguments(browser, report):
    """Math.min(...xs) over the map's points overflowed the call stack past ~1e5 concepts."""
    browser.get((report / "index.html").as_uri())
    drawn = browser.execute_script("""
      const D = window.ATLAS_DATA, ex = D.columns.indexOf("ex");
      const rows = D.rows.filter(r => D.extractors[r[ex]].name === "kmeans");
      for (let i = 0; i < 150000; i++) { const r = rows[i % rows.length].slice(); r[D.columns.indexOf("x")] = i;
                                         D.rows.push(r); }
      document.getElementById("map-extractor").dispatchEvent(new Event("change"));
      return document.querySelectorAll("#map a circle").length;""")
    assert drawn == 150_008 and _errors(browser) == []


MAP_FILLS = """
  const D = window.ATLAS_DATA, col = c => D.columns.indexOf(c), ex = col("ex");
  const rows = D.rows.filter(r => D.extractors[r[ex]].name === "kmeans");
  rows[0][col("gain")] = -0.1; rows[1][col("gain")] = 0; rows[2][col("gain")] = 0.2;  // its best class kept
  document.getElementById("map-extractor").dispatchEvent(new Event("change"));
  const fill = i => [...document.querySelectorAll("#map circle")]
    .find(c => c.querySelector("title").textContent.startsWith("kmeans #" + rows[i][col("concept")] + ":"))
    .getAttribute("fill");
  return [fill(0), fill(1), fill(2), rows.slice(0, 3).map(r => r[col("best_class")])];"""


def test_the_map_greys_a_concept_whose_best_probe_does_not_beat_its_base_rate(browser, report):
    browser.get((report / "index.html").as_uri())
    below, level, above, classes = browser.execute_script(MAP_FILLS)
    assert all(classes)  # each row names a best class; only its gain decides the colour
    assert below == level == "#999999" and above != "#999999"


def test_the_filter_names_one_concept_by_its_number(browser, report):
    browser.get((report / "index.html").as_uri())
    box = browser.find_element(By.ID, "filter")
    box.send_keys("#1")
    shown = sorted(a.text for a in browser.find_elements(By.CSS_SELECTOR, "#concepts a.concept"))
    assert shown == ["#1", "#1"]  # topk #1 and kmeans #1, not topk #10 or #11
    box.send_keys(" topk")
    assert [a.get_attribute("href").split("/concepts/")[1]
            for a in browser.find_elements(By.CSS_SELECTOR, "#concepts a.concept")] == ["topk/1.html"]

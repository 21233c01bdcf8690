"""The book's offline site: built from the committed reports, opened in a real headless browser (Chromium)
with no network: every page loads, its plots and formulas show, search finds pages, and no request leaves
the machine."""

import json
import shutil
import time
from pathlib import Path

import pytest

from lab.book import site

REPORTS = sorted(p for p in site.REPORTS.glob("[0-9][0-9]_*.ipynb"))


def test_front_page_lists_each_reports_questions():
    text = site.reader_index(REPORTS)
    for report in REPORTS:
        executed = json.loads(report.read_text())
        assert f"]({report.stem}.ipynb)" in text
        questions = site.report_questions(executed)
        assert questions, f"{report.name} has no answers box to index"
        assert all(f"- {q}" in text for q in questions)
    assert text.count("\n- ") >= len(REPORTS)
    toc = text[text.index("```{toctree}"):]
    assert [line for line in toc.splitlines() if line[:2].isdigit()] == [r.stem for r in REPORTS]


def test_jupyter_heading_links_become_the_sites():
    assert site.site_anchors("see ([→](#Speedups-and-TFLOP/s)) and [x](#Correct-first)") == \
        "see ([→](#speedups-and-tflops)) and [x](#correct-first)"
    assert site.site_anchors("[a page](other.html#Keep)") == "[a page](other.html#Keep)"  # not a local heading


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("needs Chromium and chromedriver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--allow-file-access-from-files"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(service=Service(driver), options=options)


def _requests(browser) -> list[str]:
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def _wait(browser, script: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = browser.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    return browser.execute_script(script)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_nb")
    return site.build_site(site.REPORTS, tmp_path_factory.mktemp("site") / "site")


@pytest.fixture(scope="module")
def browser():
    b = _browser()
    yield b
    b.quit()


# Sphinx loads MathJax only on pages with formulas; there, wait until it has typeset them.
MATH_DONE = """
if (!document.querySelectorAll('.math.notranslate').length) return [0, 0, 0];
if (!window.MathJax || !MathJax.Hub) return null;
if (MathJax.Hub.queue.pending || MathJax.Hub.queue.running) return null;
return [document.querySelectorAll('.math.notranslate').length,   // Sphinx's formulas
        document.querySelectorAll('span.MathJax, div.MathJax_Display').length,   // MathJax's typeset ones
        document.querySelectorAll('.MathJax_Error, .merror').length];
"""


@pytest.mark.slow
def test_every_page_loads_offline_with_its_plots_and_math(built, browser):
    pages = [built.parent / "index.html", *[built.parent / f"{r.stem}.html" for r in REPORTS]]
    requests, typeset = [], 0
    for page in pages:
        browser.get_log("performance")  # drop what an earlier page logged
        browser.get(page.as_uri())
        assert _wait(browser, "return document.readyState === 'complete'")
        assert browser.title, page.name
        images = browser.execute_script(
            "return Array.from(document.images).map(i => [i.src, i.complete && i.naturalWidth > 0]);")
        assert all(ok for _, ok in images), f"{page.name}: plots that did not load {[s for s, ok in images if not ok]}"
        if page.stem != "index":
            assert images, f"{page.name} shows no plot"
        spans, rendered, errors = _wait(browser, MATH_DONE) or (None, None, None)
        assert spans is not None, f"{page.name}: MathJax did not load (offline copy missing?)"
        assert errors == 0 and (spans == 0 or rendered >= spans), (page.name, spans, rendered, errors)
        typeset += rendered
        requests += _requests(browser)
        # MathJax probes for installed fonts with an about:blank font (a file:// page may not fetch it), and
        # asks for its own TeX fonts for a few AMS glyphs before drawing them in the STIX fonts the site ships
        failed = [e["message"] for e in browser.get_log("browser")
                  if e.get("source") == "network" and not e["message"].startswith("about:blank")
                  and "/_static/mathjax/fonts/HTML-CSS/TeX/" not in e["message"]]
        assert not failed, f"{page.name}: files that did not load {failed}"
    assert typeset > 50  # the formulas of 06-09 were typeset, not left as TeX
    outside = sorted({u for u in requests if not u.startswith(("file://", "data:", "about:", "blob:"))})
    assert requests and not outside, f"requests that leave the machine: {outside}"


@pytest.mark.slow
def test_search_finds_the_reports(built, browser):
    browser.get((built.parent / "search.html").as_uri() + "?q=FlashAttention")
    hits = _wait(browser, "var l = document.querySelectorAll('ul.search li a'); "
                          "return l.length ? Array.from(l).map(a => a.getAttribute('href')) : null;")
    assert hits and any(Path(h.split("?")[0].split("#")[0]).stem == "05_flash" for h in hits), hits
    browser.get((built.parent / "index.html").as_uri())
    toc = browser.execute_script("return Array.from(document.querySelectorAll('.toctree-wrapper a'))"
                                 ".map(a => a.getAttribute('href'));")
    assert [Path(h).stem for h in toc] == [r.stem for r in REPORTS]

"""The documentation site (mkdocs.yml, ``make docs``) builds in strict mode, documents every public name, and its home
page and the ``patch`` reference render in a real browser: Debian's Chromium, headless, driven by Playwright (as the
demo report's test does; skipped, with the install command, where Chromium is not installed).
"""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from browser import CHROMIUM_FLAGS, chromium

import hf_knorm
from hf_knorm import normalizations

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built as ``make docs`` builds it (strict: any warning fails), into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _first_sentence(docstring: str) -> str:
    """A docstring's first line as the site shows it (``code`` spans as their text)."""
    return docstring.strip().splitlines()[0].replace("``", "")


def test_every_public_name_has_its_entry_in_the_api_reference(site):
    """Each name of ``hf_knorm.__all__`` is rendered under its own id on an API page: the top-level name
    (``hf_knorm.patch``), or the member of the ``hf_knorm.normalizations`` page that it re-exports; each helper that
    moved from the top level to a subpackage (``hf_knorm._MOVED``, deprecated top-level names) under its new home."""
    ids = set()
    for page in (site / "api").rglob("*.html"):
        ids |= set(re.findall(r'id="(hf_knorm\.[\w.]+)"', page.read_text()))
    assert "hf_knorm.normalizations" in ids
    assert {f"hf_knorm.normalizations.{name}" for name in normalizations.__all__} <= ids
    missing = [name for name in hf_knorm.__all__
               if f"hf_knorm.{name}" not in ids and f"hf_knorm.normalizations.{name}" not in ids]
    assert missing == [], "names of hf_knorm.__all__ without an entry in docs/api/*.md"
    helpers = {f"hf_knorm.{module}.{name}" for name, module in getattr(hf_knorm, "_MOVED", {}).items()}
    assert sorted(helpers - ids) == [], "helpers without an entry at their home in docs/api/*.md"


def test_the_results_index_is_benchmarks_md_and_its_pages_show_their_figures(site):
    html = (site / "results" / "index.html").read_text()
    first_heading = re.search(r"^# (.+)$", (ROOT / "BENCHMARKS.md").read_text(), re.M).group(1)
    assert f">{first_heading}<" in html
    pages = sorted(path.stem for path in (ROOT / "docs" / "results").glob("*.md"))
    notes = sorted(path.stem for path in (ROOT / "docs" / "research").glob("*.md"))
    body = html.split('<article', 1)[1]  # the page's own text, not the navigation
    linked = {name for name in pages if f'href="{name}/#' in body}
    assert linked == set(pages), (linked, pages)  # the index links into every results page
    linked = {name for name in notes if f'href="../research/{name}/#' in body}
    assert linked == set(notes), (linked, notes)  # ... and into every dated page of earlier runs
    for page in ("results/attention", "results/training", "research/2026-12-conversion"):
        folder = site / page
        figures = re.findall(r'<img[^>]+src="([^"]+)"', (folder / "index.html").read_text())
        assert figures and all((folder / src).resolve().is_file() for src in figures), (page, figures)


def test_each_results_page_links_its_earlier_runs(site):
    """A results page whose superseded runs moved to a dated page under docs/research/ links that page."""
    for note in (ROOT / "docs" / "research").glob("*.md"):
        capability = note.stem.split("-", 2)[2]  # 2026-12-conversion -> conversion
        html = (site / "results" / capability / "index.html").read_text()
        assert f'href="../../research/{note.stem}/' in html, capability


def test_home_and_patch_reference_render_in_chromium(site):
    from playwright.sync_api import sync_playwright

    executable = chromium()
    errors, seen = [], {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("requestfailed", lambda request: errors.append(f"request failed: {request.url}"))

            page.goto((site / "index.html").as_uri(), wait_until="load")
            seen["home title"] = page.title()
            seen["home heading"] = page.locator("article h1").first.inner_text()
            navigation = page.locator("nav.md-nav--primary").first
            seen["home nav"] = navigation.inner_text() if navigation.is_visible() else "(the navigation is not shown)"
            seen["home stylesheet"] = page.eval_on_selector("header.md-header", "h => getComputedStyle(h).position")

            page.goto((site / "api" / "patching" / "index.html").as_uri(), wait_until="load")
            seen["patch title"] = page.title()
            entry = page.locator('[id="hf_knorm.patch"]')
            seen["patch heading"] = entry.inner_text()
            seen["patch signature"] = page.locator(".doc-signature").first.inner_text()
            seen["patch text"] = page.locator("article").inner_text()
        finally:
            browser.close()

    assert errors == []
    assert seen["home title"] == "hf_knorm"
    assert seen["home heading"].strip().startswith("hf_knorm")
    for section in ("Home", "Guides", "API reference", "Results"):
        assert section in seen["home nav"], seen["home nav"]
    assert seen["home stylesheet"] in ("sticky", "fixed")  # Material's stylesheet loaded, not a bare HTML page

    assert seen["patch title"].startswith("Patching")
    assert "hf_knorm.patch" in seen["patch heading"]
    signature = " ".join(seen["patch signature"].split())
    assert signature.startswith("patch(")
    for name, parameter in inspect.signature(hf_knorm.patch).parameters.items():
        assert name in signature, (name, signature)
    assert "normalization: str | Normalization" in signature
    sentence = _first_sentence(hf_knorm.patch.__doc__)
    assert len(sentence) > 20 and sentence in " ".join(seen["patch text"].split())
    assert "Raises:" in seen["patch text"] and "ValueError" in seen["patch text"]

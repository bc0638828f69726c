"""The demo's report in a real browser: Debian's Chromium, headless, driven by Playwright.

Skipped, with the install command, where Chromium is not installed; under ``.ci/run``, which installs it, a missing
Chromium fails (``tests/browser.py``).
The screenshot of the page is kept in ``outputs/test-artifacts/demo_report.png`` beside the test output.
"""

from pathlib import Path

import pytest
from browser import CHROMIUM_FLAGS, chromium

pytestmark = pytest.mark.slow

ARTIFACTS = Path(__file__).resolve().parents[3] / "outputs" / "test-artifacts"


def test_report_renders_in_chromium_with_every_image_and_no_console_error(fast_demo):
    from playwright.sync_api import sync_playwright

    executable = chromium()
    report = fast_demo / "report.html"
    errors = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("requestfailed", lambda request: errors.append(f"request failed: {request.url}"))
            page.goto(report.as_uri(), wait_until="load")
            headings = page.locator("h2").all_inner_texts()
            images = page.eval_on_selector_all("img", "imgs => imgs.map(i => [i.alt, i.complete && i.naturalWidth > 0])")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "demo_report.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert len(headings) == 5
    assert len(images) >= 5
    assert all(loaded for _, loaded in images), [alt for alt, loaded in images if not loaded]
    assert (ARTIFACTS / "demo_report.png").stat().st_size > 10_000

"""The page in a real browser: Debian's chromium and chromium-driver, driven by Selenium,
load the page from a real ``aiayn serve`` on loopback; a person's steps (type a sentence,
translate, open the attention view, pick a layer and a head, point at a cell) and what they
would see. A screenshot is saved (its path is printed; ``AIAYN_SCREENSHOT_DIR`` chooses the
folder). Without the browser, its driver or Selenium the test is skipped, saying which is
missing (``-rs`` in the pytest options prints the reason)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving.conftest import ServerProcess

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def server(reverse_checkpoint: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(reverse_checkpoint)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = _browser()
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        missing = " and ".join(
            name
            for name, found in (("chromium", binary), ("chromedriver", driver_path))
            if found is None
        )
        pytest.skip(
            f"browser test skipped: {missing} not found on PATH "
            "(as root: apt-get install chromium chromium-driver; scripts/setup_env.sh does it)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",  # as root, and in containers
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1100",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def test_a_person_translates_and_reads_the_attention(browser, server, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as visible
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    wait = WebDriverWait(driver, 30)
    driver.get(server.url + "/")
    info = driver.find_element(By.ID, "model-info")
    wait.until(lambda _: "preset tiny" in info.text)
    assert "13" in info.text  # the vocabulary

    sentence = "alpha bravo charlie delta"
    status, expected = server.post("/v1/translate", {"text": [sentence], "nbest": 2})
    assert status == 200
    best = expected["translations"][0]

    source = driver.find_element(By.ID, "source")
    source.send_keys(sentence)
    nbest = driver.find_element(By.ID, "nbest")
    nbest.clear()
    nbest.send_keys("2")
    driver.find_element(By.ID, "translate").click()
    shown = wait.until(visible.visibility_of_element_located((By.CSS_SELECTOR, ".translation")))
    assert shown.text == best["text"] != ""
    items = driver.find_elements(By.CSS_SELECTOR, "ol.nbest li")
    assert len(items) == len(best["hypotheses"]) == 2
    first_score = f"score {best['hypotheses'][0]['score']:.3f}"
    assert items[0].text.startswith(best["hypotheses"][0]["text"]) and first_score in items[0].text
    assert "1 translation(s)" in driver.find_element(By.ID, "status").text
    assert driver.find_element(By.ID, "error").text == ""

    driver.find_element(By.CSS_SELECTOR, ".show-attention").click()
    panel = wait.until(visible.visibility_of_element_located((By.ID, "attention")))
    status, attention = server.post("/v1/attention", {"text": sentence})
    assert status == 200
    rows, cols = len(attention["target_tokens"]), len(attention["source_tokens"])
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "rect.cell")) == rows * cols)
    assert f"{sentence} → {attention['translation']}" in panel.text
    layer, head = (
        Select(driver.find_element(By.ID, "layer")),
        Select(driver.find_element(By.ID, "head")),
    )
    assert [o.text for o in layer.options] == [str(i + 1) for i in range(attention["layers"])]
    assert len(head.options) == attention["heads"] + 1  # and the mean of the heads
    labels = [t.text for t in driver.find_elements(By.CSS_SELECTOR, "#heatmap text.col")]
    assert labels == attention["source_tokens"]

    layer.select_by_visible_text("1")
    head.select_by_visible_text("2")
    i, j = rows - 1, 1  # the step that produced </s>, the second source token
    cell = driver.find_element(By.CSS_SELECTOR, f'rect.cell[data-i="{i}"][data-j="{j}"]')
    ActionChains(driver).move_to_element(cell).perform()
    weight = attention["weights"][0][1][i][j]
    expected_text = (
        f"source “{attention['source_tokens'][j]}” · target “{attention['target_tokens'][i]}” · "
        f"weight {weight:.4f} (layer 1, head 2)"
    )
    cell_info = driver.find_element(By.ID, "cell-info")
    wait.until(lambda _: cell_info.text == expected_text)
    tooltip = driver.find_element(By.ID, "tooltip")
    assert tooltip.is_displayed() and tooltip.text == expected_text
    highlighted = driver.find_elements(By.CSS_SELECTOR, "#heatmap text.on")
    assert sorted(t.text for t in highlighted) == sorted(
        [attention["source_tokens"][j], attention["target_tokens"][i]]
    )

    # Everything the page loaded came from the server itself.
    loaded = driver.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
    )
    assert loaded and all(url.startswith(server.url + "/") for url in loaded), loaded
    problems = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert problems == []

    folder = Path(os.environ.get("AIAYN_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    picture = folder / "serve-page.png"
    assert driver.save_screenshot(str(picture))
    assert picture.read_bytes()[:4] == b"\x89PNG"
    print(f"screenshot: {picture}")


def test_the_page_shows_a_refusal(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(server.url + "/")
    driver.find_element(By.ID, "source").send_keys("alpha bravo")
    beam = driver.find_element(By.ID, "beam")
    beam.clear()
    beam.send_keys("99")
    driver.find_element(By.ID, "translate").click()
    error = driver.find_element(By.ID, "error")
    WebDriverWait(driver, 30).until(lambda _: error.text != "")
    assert error.text == "beam: 99 is more than the limit of 16"


def test_the_page_meets_terminology(browser, server):
    """Phrases typed into the terminology field are in every translation, as the API gives
    them for the same constraints."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(server.url + "/")
    lines = ["alpha bravo charlie", "delta echo"]
    driver.find_element(By.ID, "source").send_keys("\n".join(lines))
    driver.find_element(By.ID, "terminology").send_keys("golf; hotel india")
    driver.find_element(By.ID, "translate").click()
    wait = WebDriverWait(driver, 30)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".translation")) == 2)
    shown = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".translation")]
    phrases = ["golf", "hotel india"]
    status, expected = server.post("/v1/translate", {"text": lines, "constraints": [phrases] * 2})
    assert status == 200
    assert shown == [t["text"] for t in expected["translations"]]
    assert all("golf" in text.split() and "hotel india" in text for text in shown)
    assert driver.find_element(By.ID, "error").text == ""


@pytest.fixture(scope="module")
def ct2_server(reverse_checkpoint: Path) -> Iterator[ServerProcess]:
    pytest.importorskip(
        "ctranslate2", reason="CTranslate2 is not installed (pip install 'aiayn[interop]')"
    )
    process = ServerProcess(reverse_checkpoint, "--engine", "ctranslate2")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.mark.slow
def test_the_page_without_attention_maps(browser, ct2_server):
    """With ``--engine ctranslate2`` the page says so, translates, and offers no attention
    view and no terminology field (the server has neither)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as visible
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get_log("browser")  # what earlier tests left there
    wait = WebDriverWait(driver, 30)
    driver.get(ct2_server.url + "/")
    info = driver.find_element(By.ID, "model-info")
    wait.until(lambda _: "CTranslate2 (float32)" in info.text)
    assert "no attention maps with this engine" in info.text
    assert not driver.find_element(By.ID, "terminology").is_enabled()  # no constrained search
    sentence = "alpha bravo charlie"
    status, expected = ct2_server.post("/v1/translate", {"text": [sentence]})
    assert status == 200
    driver.find_element(By.ID, "source").send_keys(sentence)
    driver.find_element(By.ID, "translate").click()
    shown = wait.until(visible.visibility_of_element_located((By.CSS_SELECTOR, ".translation")))
    assert shown.text == expected["translations"][0]["text"] != ""
    buttons = driver.find_elements(By.CSS_SELECTOR, ".show-attention")
    assert buttons and not any(b.is_displayed() for b in buttons)
    assert not driver.find_element(By.ID, "attention").is_displayed()
    assert driver.find_element(By.ID, "error").text == ""
    problems = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert problems == []

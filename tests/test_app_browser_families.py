"""Browser tier, issue 58 item 6: a pair of another model family typed as local folders in the Pair tab, each tab run
on it, and an unsupported family's refusal as the person sees it, in headless Chromium.

The app starts in a local run (local folders are refused in hosted mode: tests/test_app_families.py) on a tiny
Qwen2.5 pair of folders (SCDVIZ_PRODUCER / SCDVIZ_CONSUMER), so no built-in model loads; the folders are tiny random
models of ``tests/families.py``. Screenshots (JPEG) go to tmp, as tests/test_app_browser.py's uncommitted ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from apprunner import running_app
from conftest import user_text
from families import MODEL_TYPES, family_folder
from test_app_browser import CHROMIUM, FLAGS, LONG_FLOAT, run_result

from scdviz.models.family import SUPPORTED

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TEXT = user_text()
CONTEXT = TEXT[:700]  # ~340 tokens of the folders' tokenizer (the tabs' defaults are the built-in pair's windows)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """family -> (producer folder, consumer folder); an unsupported family's folder as both."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in ("qwen2.5", "gemma3", "phi4-mini"):
        out[name] = tuple(str(family_folder(root / name / role, name, TEXT, seed=seed))
                          for role, seed in (("producer", 0), ("consumer", 1)))
    for name in MODEL_TYPES:
        out[name] = (str(family_folder(root / name / "model", name, TEXT)),) * 2
    return out


@pytest.fixture(scope="module")
def page(tmp_path_factory, made):
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing: apt-get install chromium (.ci/run does this)")
    from playwright.sync_api import sync_playwright

    folder = tmp_path_factory.mktemp("app")
    producer, consumer = made["qwen2.5"]
    with running_app(folder / "app.log", SCDVIZ_WORK=str(folder), SCDVIZ_PRODUCER=producer,
                     SCDVIZ_CONSUMER=consumer) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1800})
        pg.goto(url)
        pg.locator("#pair-summary").get_by_text(f"{producer} → {consumer}").wait_for(timeout=240_000)
        yield pg
        browser.close()


def _shot(page, name: str, tmp_path_factory) -> Path:
    """A full-page JPEG screenshot, as tests/test_app_browser.py takes its uncommitted ones."""
    path = tmp_path_factory.mktemp("shots") / f"{name}.jpg"
    page.wait_for_timeout(1000)  # plots finish their transitions
    page.screenshot(path=str(path), full_page=True, type="jpeg", quality=60)
    return path


def _type_source(page, which: str, source: str) -> None:
    """Type a model source into the Pair tab's producer or consumer box (a dropdown taking custom values)."""
    box = page.locator(f"#{which} input")
    box.fill(source)
    box.press("Enter")


def _load(page, producer: str, consumer: str) -> None:
    page.get_by_role("tab", name="Pair").click()
    _type_source(page, "producer", producer)
    _type_source(page, "consumer", consumer)
    page.locator("#load-pair").click()


def _plots_drawn(page, prefix: str, names) -> None:
    for name in names:
        page.locator(f"#{prefix}-{name} .js-plotly-plot").first.wait_for(timeout=60_000)


def _clean(page) -> None:
    content = page.content()
    assert "Traceback" not in content and "internal error" not in content


def test_a_family_pair_typed_as_folders_loads_and_each_tab_runs_on_it(page, made, tmp_path_factory):
    from scdviz.app.ui import evict_tab, scd_tab

    for name, arch in (("phi4-mini", "Phi3ForCausalLM"), ("gemma3", "Gemma3ForCausalLM")):  # gemma3 stays loaded
        producer, consumer = made[name]
        _load(page, producer, consumer)
        page.locator("#pair-summary").get_by_text(f"{producer} → {consumer}").wait_for(timeout=120_000)
        facts = page.locator("#pair-facts").inner_text()
        assert facts.count(arch) == 2 and producer in facts and consumer in facts, facts
    assert "sliding_attention" in facts  # Gemma-3's layer types, a fact both models share
    header = page.locator("#pair-facts").get_by_text("consumer", exact=True).first  # in view beside the producer
    assert header.bounding_box()["x"] + header.bounding_box()["width"] <= 1400, header.bounding_box()
    _shot(page, "family-pair", tmp_path_factory)

    page.get_by_role("tab", name="Calibrate / train").click()  # no shipped calibration for this pair: make one
    page.locator("#cal-run").click()
    page.locator("#cal-info").get_by_text("Calibrated in").wait_for(timeout=300_000)

    page.get_by_role("tab", name="SCD transfer").click()
    page.locator("#scd-text textarea").fill(CONTEXT)
    page.locator("#scd-run").click()
    assert "your calibration" in run_result(page, "#scd-info", "prompt tokens")
    table = page.locator("#scd-table").inner_text()
    for method in ("oracle", "raw KV", "4-bit KV", "SCD reuse-only", "SCD full"):
        assert method in table
    assert not LONG_FLOAT.search(table), table
    for title, names in reversed(scd_tab.GROUPS.items()):
        page.get_by_role("tab", name=title).click()
        _plots_drawn(page, "scd", names)
    _shot(page, "family-scd", tmp_path_factory)

    page.get_by_role("tab", name="Eviction").click()
    page.locator("#ev-context textarea").fill(CONTEXT)
    page.locator("#ev-run").click()
    info = run_result(page, "#ev-info", "context tokens per")
    table = page.locator("#ev-table").inner_text()
    assert "ObservedAttention" in table and "StreamingLLM" in table, table
    shown = page.locator("#ev-show input").input_value()  # the method inspected: one that ran here
    assert shown in table, (shown, table)
    if "could not run on this model" in info:  # the shipped scorer, fitted to the built-in producer's widths
        assert f"inspecting {shown} instead" in info, info
    assert len(page.locator("#ev-kept").inner_text().split()) > 50
    _plots_drawn(page, "ev", evict_tab.FIGURES)
    _shot(page, "family-evict", tmp_path_factory)
    _clean(page)


@pytest.mark.parametrize("name", list(MODEL_TYPES))
def test_an_unsupported_family_folder_shows_the_refusal_not_a_trace(page, made, name, tmp_path_factory):
    refused = made[name][0]
    page.get_by_role("tab", name="Pair").click()
    loaded = page.locator("#pair-summary").inner_text().split(": ", 1)[1].split(" share ")[0]  # "producer → consumer"
    arch = page.locator("#pair-facts").inner_text().split("architecture")[1].split()[0]  # the loaded pair's
    _load(page, refused, made["gemma3"][1])
    message = f"model type '{MODEL_TYPES[name]}' is not supported"
    toast = page.get_by_text(message)
    toast.first.wait_for(timeout=120_000)
    text = toast.first.inner_text()
    assert refused in text and all(family in text for family in SUPPORTED.values()), text
    _shot(page, f"family-refused-{name}", tmp_path_factory)
    _clean(page)
    page.wait_for_timeout(11_000)  # past gradio's default 10 s: the refusal stays until it is closed
    assert toast.first.is_visible()
    # the pair loaded before stays loaded and said so, its facts in view
    assert loaded in page.locator("#pair-summary").inner_text()
    assert page.locator("#pair-facts").get_by_text(arch).first.is_visible(), arch

"""Browser tier: start the app, drive it in headless Chromium as a person would.

Needs Debian's chromium (.ci/run installs it) and the built-in pair. Screenshots (JPEG) of
every tab go to SCDVIZ_SCREENSHOTS when set (assets/screenshots/ holds the committed ones,
``COMMITTED``), the others, and all of them when it is unset, to tmp.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from apprunner import running_app

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


app_url_work: dict = {}  # app URL -> its SCDVIZ_WORK folder


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("app")
    with running_app(folder / "app.log", SCDVIZ_WORK=str(folder)) as url:
        app_url_work[url] = folder
        yield url


@pytest.fixture(scope="module")
def browser(app_url):
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing: apt-get install chromium (.ci/run does this)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser, app_url):
    pg = browser.new_page(viewport={"width": 1400, "height": 1800})
    pg.goto(app_url)
    pg.locator("#pair-summary").get_by_text("Compatible").wait_for(timeout=240_000)  # the default pair, on open
    yield pg
    pg.close()


COMMITTED = ("pair", "scd", "scd-budget", "evict", "train", "results")  # assets/screenshots/<name>.jpg
LONG_FLOAT = re.compile(r"\d\.\d{7,}")  # a number printed with 7+ decimals: unrounded


FIRST_LOOK = "Example shown when the page opened"  # how the SCD tab's first look begins (webapp._first_look)


def run_result(page, selector: str, fragment: str, timeout: int = 300_000) -> str:
    """Wait until the element shows a run's result containing ``fragment`` (not the example the page opened with);
    returns its text."""
    page.wait_for_function(
        "([sel, frag, first]) => { const el = document.querySelector(sel);"
        " return el && el.innerText.includes(frag) && !el.innerText.includes(first); }",
        arg=[selector, fragment, FIRST_LOOK], timeout=timeout)
    return page.locator(selector).inner_text()


def _shot(page, name: str, tmp_path_factory) -> Path:
    wanted = os.environ.get("SCDVIZ_SCREENSHOTS")
    folder = Path(wanted) if wanted and name in COMMITTED else tmp_path_factory.mktemp("shots")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jpg"
    page.wait_for_timeout(1000)  # plots finish their transitions
    page.screenshot(path=str(path), full_page=True, type="jpeg", quality=60)
    return path


def _choose(page, dropdown: str, option: str) -> None:
    """Pick ``option`` in a multi-select dropdown (it stays open for the next pick)."""
    page.locator(f"{dropdown} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def _legend_groups(page, elem: str) -> set[str]:
    """The legend groups of the traces drawn in a plot (read from plotly's own data in the page)."""
    groups = page.evaluate(f"() => document.querySelector('#{elem} .js-plotly-plot').data.map(t => t.legendgroup)")
    return {g for g in groups if g}


MAGIC = {"png": b"\x89PNG", "svg": b"<svg", "html": b"<html"}


def _downloads_work(page, prefix: str, tab: str, names, static: bool = False) -> None:
    """The tab's download button offers one HTML page holding every figure (plotly.js once, under 10 MB);
    with the box ticked also one zip of PNG and one of SVG, an image per figure, each of its type."""
    import io
    import zipfile

    if static:
        page.locator(f"#{prefix}-figs-static input").check()
    page.locator(f"#{prefix}-figs-btn").click()
    expected = {f"scdviz-{tab}.html"} | ({f"scdviz-{tab}-png.zip", f"scdviz-{tab}-svg.zip"} if static else set())
    links = page.locator(f"#{prefix}-figs a[download]")
    links.nth(len(expected) - 1).wait_for(state="attached", timeout=240_000)
    offered = {a.get_attribute("download"): a.get_attribute("href") for a in links.all()}
    assert set(offered) == expected
    body = page.request.get(offered[f"scdviz-{tab}.html"]).body()
    assert body.startswith(b"<!DOCTYPE html><html") and len(body) < 10 * 2**20
    assert all(f"<h2>{tab}_{name}</h2>".encode() in body for name in names)
    for fmt in ("png", "svg") if static else ():
        with zipfile.ZipFile(io.BytesIO(page.request.get(offered[f"scdviz-{tab}-{fmt}.zip"]).body())) as z:
            assert sorted(z.namelist()) == sorted(f"{tab}_{name}.{fmt}" for name in names)
            assert all(MAGIC[fmt] in z.read(n)[:300] for n in z.namelist())
    links.first.scroll_into_view_if_needed()
    with page.expect_download() as download:  # a person's click saves the file
        links.first.click()
    assert download.value.suggested_filename in expected
    assert Path(download.value.path()).stat().st_size > 1000


@pytest.fixture(scope="module")
def default_pair():
    """The pair the page opens with (the settings' defaults), as the app loads it."""
    from scdviz import settings
    from scdviz.app import pairs

    return pairs.get_pair(settings.default_producer(), settings.default_consumer())


def test_pair_tab_loads_pair_and_generates(page, default_pair, tmp_path_factory):
    summary = page.locator("#pair-summary")
    summary.get_by_text("Compatible").wait_for(timeout=240_000)
    facts = page.locator("#pair-facts")
    assert "LlamaForCausalLM" in facts.inner_text()
    assert "30" in facts.inner_text()
    page.locator("#pair-generate").click()
    info = page.locator("#pair-gen-info")
    info.get_by_text("generated positions").wait_for(timeout=240_000)
    from scdviz.app import pairs
    from scdviz.app.requests import GenerateRequest

    gen = pairs.generate_both(default_pair,
                              GenerateRequest(page.locator("#pair-prompt textarea").input_value(), 32))  # page default
    squash = lambda text: "".join(text.split())  # noqa: E731 - tokens are shown as separate chips
    assert squash(gen.producer_text) in squash(page.locator("#producer-text").inner_text())
    assert squash(gen.consumer_text) in squash(page.locator("#consumer-text").inner_text())
    _shot(page, "pair", tmp_path_factory)


FITS = """el => { const p = el.querySelector('.js-plotly-plot');
                 return p._fullLayout.width <= el.getBoundingClientRect().width + 1; }"""


def _plots_drawn(page, prefix: str, names: tuple[str, ...]) -> None:
    """Each plot is drawn and fits its box (a plot updated in a hidden tab is redrawn when the tab opens)."""
    for name in names:
        plot = page.locator(f"#{prefix}-{name} .js-plotly-plot")
        plot.first.wait_for(timeout=60_000)
        assert plot.count() >= 1, name
        for _ in range(30):
            if page.locator(f"#{prefix}-{name}").evaluate(FITS):
                break
            page.wait_for_timeout(100)
        else:
            pytest.fail(f"{prefix}-{name} is wider than its box")


def test_scd_tab_transfers_and_draws_every_plot(page, tmp_path_factory):
    from scdviz.app.ui.scd_tab import FIGURES, GROUPS

    page.get_by_role("tab", name="SCD transfer").click()
    page.locator("#scd-run").click()
    run_result(page, "#scd-info", "prompt tokens")
    table = page.locator("#scd-table").inner_text()
    for method in ("oracle", "raw KV", "4-bit KV", "DroidSpeak recompute", "SCD reuse-only", "SCD full"):
        assert method in table
    assert not LONG_FLOAT.search(table), table
    texts = page.locator("#scd-texts").inner_text()
    assert "oracle:" in texts and "SCD full:" in texts
    # the default consumer, austen-before, is asked its own question: every method answers it, with its F1
    answers = page.locator("#scd-answers").inner_text()
    assert "Asked (the words before a quote, nearest first)" in answers and "reference:" in answers, answers
    assert all(f"{m} (F1 " in answers for m in ("oracle", "raw KV", "SCD full")), answers
    assert "QA F1" in table
    assert sorted(n for names in GROUPS.values() for n in names) == sorted(FIGURES)
    for title, names in reversed(GROUPS.items()):  # every sub-tab's plots; the first one stays open
        page.get_by_role("tab", name=title).click()
        _plots_drawn(page, "scd", names)
        if title == "Drift and error":
            assert page.locator("#scd-drift_k").get_by_text("patched / recomputed").count() == 1  # one legend entry
    _shot(page, "scd", tmp_path_factory)
    _downloads_work(page, "scd", "scd", FIGURES)
    page.locator("#scd-budget input").fill("2304")  # the default budget coder: transform coding
    page.locator("#scd-run").click()
    page.locator("#scd-info").get_by_text("transform-coded plan for 2304 B/token").wait_for(timeout=300_000)
    page.get_by_role("tab", name="Compression").click()
    _plots_drawn(page, "scd", ("plan",))
    assert "rank K" in page.locator("#scd-plan").inner_text() and "as sent" in page.locator("#scd-plan").inner_text()
    _shot(page, "scd-budget", tmp_path_factory)
    page.get_by_label("rate-distortion plan: ranks, bits and patches").check()
    page.locator("#scd-run").click()
    page.locator("#scd-info").get_by_text("rate-distortion plan for 2304 B/token").wait_for(timeout=300_000)
    _plots_drawn(page, "scd", ("plan",))
    assert "as sent" not in page.locator("#scd-plan").inner_text()
    page.get_by_role("tab", name="Drift and error").click()
    _shot(page, "scd-drift", tmp_path_factory)
    page.locator("#scd-budget input").fill("0")  # the controls' plan again, with the prompt's last 32 recomputed
    page.locator("#scd-tail input[type=number]").fill("32")
    page.locator("#scd-run").click()
    page.locator("#scd-table span.text", has_text="SCD reuse-only + last 32 recomputed").first.wait_for(timeout=300_000)
    assert "raw KV + last 32 recomputed" in page.locator("#scd-table").inner_text()
    page.get_by_role("tab", name="Quality").click()
    _plots_drawn(page, "scd", ("compute",))
    assert "SCD reuse-only + last 32 recomputed" in page.locator("#scd-compute").inner_text()
    _shot(page, "scd-tail", tmp_path_factory)


def test_evict_tab_shows_retained_tokens_and_every_plot(page, tmp_path_factory):
    from scdviz.app.requests import HEADLINE_SCORER
    from scdviz.app.ui.evict_tab import FIGURES
    from scdviz.evict import bench

    page.get_by_role("tab", name="Eviction").click()
    page.locator("#ev-run").click()
    run_result(page, "#ev-info", "keeps")
    table = page.locator("#ev-table").inner_text()
    for method in bench.focus_methods():  # the focused set by default, and nothing else
        assert method in table
    assert "TOVA" not in table and "DistillCache" not in table
    assert len(page.locator("#ev-kept").inner_text().split()) > 50  # the context, token by token
    assert len(page.locator("#ev-versus").inner_text().split()) > 50  # and where it differs from H2O's choice
    assert "overlap with ObservedAttention's kept slots (Jaccard)" in table  # in words
    assert "jaccard_vs_h2o" not in table
    texts = page.locator("#ev-texts").inner_text()
    assert HEADLINE_SCORER in texts and "lookahead-policy" in texts  # each focused method's generated text
    assert not LONG_FLOAT.search(table), table
    _plots_drawn(page, "ev", FIGURES)
    shown = page.locator("#ev-show input")  # the inspected method, the long student name uncut
    assert shown.input_value() == HEADLINE_SCORER
    assert shown.evaluate("e => e.scrollWidth <= e.clientWidth"), "the inspected method's name is cut off"
    _shot(page, "evict", tmp_path_factory)
    _downloads_work(page, "ev", "evict", FIGURES)


def test_results_tab_compares_records_from_every_source(page, tmp_path_factory, app_url):
    """Two shipped SCD records in one plot, two uploaded eviction records and a run from the runs
    folder in another; the settings that differ, every row rounded, the CSV and the figures offered."""
    from scdviz import records, settings

    page.get_by_role("tab", name="Results").click()
    for name in ("assets/scd/jargon/bench.json", "assets/scd/austen-before/bench.json"):
        _choose(page, "#res-shipped", name)
    page.keyboard.press("Escape")
    page.locator("#res-info").get_by_text("2 records (scd)").wait_for(timeout=60_000)
    _plots_drawn(page, "res", ("payload_vs_kl",))
    assert _legend_groups(page, "res-payload_vs_kl") == {"scd/jargon/bench", "scd/austen-before/bench"}
    legend = page.locator("#res-payload_vs_kl .legend").text_content()
    assert "scd/jargon/bench" in legend and "scd/austen-before/bench" in legend
    modes = page.evaluate("() => document.querySelector('#res-payload_vs_kl .js-plotly-plot').data.map(t => t.mode)")
    assert modes and not any("text" in m for m in modes)  # no labels on the clustered points
    assert not page.locator("#res-kl_vs_budget").is_visible()  # no eviction record yet: no eviction plot
    rows = page.locator("#res-table").inner_text()  # the rows in view (the table scrolls)
    assert "scd/jargon/bench" in rows and "SCD full" in rows
    assert "0.08944" in rows and not LONG_FLOAT.search(rows)  # 0.089438647031784, rounded for display
    differ = page.locator("#res-settings").inner_text()  # the settings that differ, a column per record
    assert "consumers" in differ and "scd/jargon/bench" in differ and "scd/austen-before/bench" in differ
    assert "KB" in page.locator("#res-export").inner_text()  # the exported CSV is offered
    _downloads_work(page, "res", "res", ("payload_vs_kl",))

    folder = tmp_path_factory.mktemp("uploads")
    uploads = []
    for name in ("decode_dev", "test"):
        uploads.append(folder / f"{name}.json")
        shutil.copy(settings.ASSETS_DIR / "policy" / "bench" / f"{name}.json", uploads[-1])
    page.locator("#res-upload input[type=file]").set_input_files([str(p) for p in uploads])
    page.locator("#res-info").get_by_text("4 records (evict, scd)").wait_for(timeout=60_000)
    assert page.locator("#res-figs a[download]").count() == 0  # the files of the earlier figures are withdrawn
    _plots_drawn(page, "res", ("payload_vs_kl", "kl_vs_budget"))
    assert _legend_groups(page, "res-kl_vs_budget") == {"decode_dev", "test"}
    assert "plotted separately" in page.locator("#res-info").inner_text()

    run = Path(app_url_work[app_url]) / "runs" / "bench" / "my-sweep"  # a bench run of this machine
    run.mkdir(parents=True)
    mine = records.read(settings.ASSETS_DIR / "policy" / "bench" / "student_window_test.json")
    records.write(mine, run / "record.json")
    page.locator("#res-runs-refresh").click()
    page.wait_for_timeout(1000)
    _choose(page, "#res-runs", "my-sweep")
    page.keyboard.press("Escape")
    page.locator("#res-info").get_by_text("5 records").wait_for(timeout=60_000)
    assert _legend_groups(page, "res-kl_vs_budget") == {"decode_dev", "test", "my-sweep"}
    assert "my-sweep" in page.locator("#res-settings").inner_text()
    _shot(page, "results", tmp_path_factory)


def test_train_tab_trains_a_policy_with_a_live_plot(page, tmp_path_factory):
    page.get_by_role("tab", name="Calibrate / train").click()
    # the headline method is fitted here too (its job: tests/test_explore_slow.py), above DistillCache's REINFORCE
    fit, train = page.locator("#fit-run"), page.locator("#train-run")
    assert fit.is_visible() and fit.bounding_box()["y"] < train.bounding_box()["y"]
    page.locator("#train-run").click()
    page.locator("#train-info").get_by_text("REINFORCE steps").wait_for(timeout=300_000)  # live updates
    page.locator("#train-info").get_by_text("Done:").wait_for(timeout=600_000)
    _plots_drawn(page, "train", ("plot",))
    _shot(page, "train", tmp_path_factory)
    _downloads_work(page, "train", "train", ("policy_training",), static=True)
    # the trained policy is this visitor's own eviction method from now on
    assert "yours:my-policy" in page.locator("#train-info").inner_text()
    page.get_by_role("tab", name="Eviction").click()
    context = page.locator("#ev-context textarea")
    context.fill(" ".join(context.input_value().split()[:90]))
    page.locator("#ev-run").click()
    page.locator("#ev-table").get_by_text("yours:my-policy").wait_for(timeout=300_000)


def test_calibrate_tab_trains_the_correction_stage_and_the_scd_tab_shows_it_beside_the_closed_form(
        browser, app_url, tmp_path_factory):
    # austen-before (the default pair, chosen again here as a visitor would): 12 training windows lower its
    # validation KL (jargon's closed form is near what they can reach: 0.0192 -> 0.0199 -> 0.0212, nothing kept)
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    page.goto(app_url)
    page.locator("#pair-summary").get_by_text("Compatible").wait_for(timeout=240_000)
    _choose(page, "#consumer", "builtin:austen-before")
    page.locator("#load-pair").click()
    page.locator("#pair-summary").get_by_text("builtin:smollm2-135m → builtin:austen-before").wait_for(timeout=240_000)
    page.get_by_role("tab", name="Calibrate / train").click()
    page.get_by_label("Also at 1/6 and 1/10 of fp16").uncheck()  # the operating point only: a shorter run
    page.locator("#distil-run").click()
    page.locator("#distil-info").get_by_text("Training the correction stage").wait_for(timeout=120_000)  # progress
    page.locator("#distil-info").get_by_text("Trained in").wait_for(timeout=600_000)
    _plots_drawn(page, "distil", ("plot",))
    info = page.locator("#distil-info").inner_text()
    assert "closed form" in info and "MB" in info and not LONG_FLOAT.search(info), info
    # austen-before: 0.0445 -> 0.0428 -> 0.0425 offline (train.distil_for with these defaults, 64 s on one thread)
    assert "validation 1 of 2 kept" in info or "validation 2 of 2 kept" in info, info
    _shot(page, "distil", tmp_path_factory)
    page.get_by_role("tab", name="SCD transfer").click()
    page.locator("#scd-run").click()
    page.locator("#scd-table").get_by_text("SCD full (closed form)").wait_for(timeout=300_000)
    table = page.locator("#scd-table").inner_text()
    assert "SCD reuse-only (closed form)" in table and "raw KV (closed form)" not in table
    _shot(page, "scd-distilled", tmp_path_factory)
    page.close()


def test_bad_input_shows_a_message_not_a_traceback(page):
    page.get_by_role("tab", name="Pair").click()
    page.locator("#pair-prompt textarea").fill("   ")
    page.locator("#pair-generate").click()
    page.get_by_text("the prompt is empty").first.wait_for(timeout=60_000)
    page.get_by_role("tab", name="Eviction").click()
    page.locator("#ev-budget input").fill("250")
    page.locator("#ev-run").click()
    page.get_by_text("must be between 0 and 100").first.wait_for(timeout=60_000)
    page.get_by_role("tab", name="SCD transfer").click()
    page.locator("#scd-text textarea").fill("too short")
    page.locator("#scd-run").click()
    page.get_by_text("SCD needs at least").first.wait_for(timeout=60_000)
    assert "Traceback" not in page.content()


def test_two_visitors_at_once_each_get_their_own_results(browser, app_url, default_pair, tmp_path_factory):
    """One page runs SCD while another generates and then evicts; both show their own, correct results."""
    from scdviz import data
    from scdviz.app import evict, pairs, scd
    from scdviz.app.requests import EvictRequest, GenerateRequest, ScdRequest
    from scdviz.plots import round_sig  # the tables show 4 significant digits

    tok = default_pair.tokenizer
    context = tok.decode(next(iter(data.token_windows(tok, data.load_split("bible", "eval"), 100, 1))))
    prompt = "The hacker's favourite editor is"
    pages = []
    for _ in range(2):  # two browser contexts: two visitors with their own sessions
        ctx = browser.new_context(viewport={"width": 1400, "height": 1800})
        pg = ctx.new_page()
        pg.goto(app_url)
        pg.locator("#pair-summary").get_by_text("Compatible").wait_for(timeout=240_000)
        pages.append(pg)
    one, two = pages
    one.get_by_role("tab", name="SCD transfer").click()
    window = one.locator("#scd-text textarea").input_value()
    one.locator("#scd-run").click()  # runs on the server while the other visitor works
    two.locator("#pair-prompt textarea").fill(prompt)
    two.locator("#pair-generate").click()
    two.locator("#pair-gen-info").get_by_text("generated positions").wait_for(timeout=300_000)
    two.get_by_role("tab", name="Eviction").click()
    two.locator("#ev-context textarea").fill(context)
    two.locator("#ev-run").click()
    run_result(one, "#scd-info", "prompt tokens", 600_000)
    run_result(two, "#ev-info", "keeps", 600_000)

    gen = pairs.generate_both(default_pair, GenerateRequest(prompt, 32))  # the page's default: 32 new tokens
    assert f"Prompt: {gen.prompt_tokens} tokens" in two.locator("#pair-gen-info").inner_text()
    assert gen.consumer_text.split()[0] in two.locator("#consumer-text").inner_text()
    alone = scd.scd_run(default_pair, ScdRequest(window))  # page defaults
    assert alone["info"].split(" SCD full")[0] in one.locator("#scd-info").inner_text()
    scd_shown = one.locator("#scd-table").inner_text()
    for row in alone["table"].itertuples():
        assert row.method in scd_shown and f"{round_sig(float(row.kl)):g}" in scd_shown, row.method
    ev = evict.evict_run(default_pair, EvictRequest(context))  # the page's defaults: the focused set
    shown = two.locator("#ev-table").inner_text()
    for row in ev["table"].itertuples():
        assert row.method in shown and f"{round_sig(float(row.kl)):g}" in shown, row.method
    _shot(one, "two-visitors-scd", tmp_path_factory)
    _shot(two, "two-visitors-evict", tmp_path_factory)
    for pg in pages:
        assert "internal error" not in pg.content() and "Traceback" not in pg.content()
        pg.context.close()


def test_closing_a_page_removes_its_session_folder(browser, app_url, tmp_path_factory):
    """What a visitor wrote (here the Results tab's CSV export) goes when their page closes."""
    import time

    work = Path(app_url_work[app_url]) / "sessions"
    before = set(work.iterdir()) if work.is_dir() else set()
    ctx = browser.new_context(viewport={"width": 1400, "height": 1800})
    pg = ctx.new_page()
    pg.goto(app_url)
    pg.get_by_role("tab", name="Results").click()
    _choose(pg, "#res-shipped", "assets/scd/jargon/bench.json")
    pg.locator("#res-info").get_by_text("1 record (scd)").wait_for(timeout=60_000)
    (mine,) = {p for p in set(work.iterdir()) - before if re.fullmatch("[0-9a-f]{16}", p.name)}  # not temp files
    assert (mine / "scratch" / "results.csv").is_file()
    ctx.close()
    deadline = time.time() + 60
    while mine.exists() and time.time() < deadline:
        time.sleep(1)
    assert not mine.exists()


def test_hosted_two_visitors_one_cancels_training_while_the_other_trains(browser, tmp_path_factory):
    """Hosted mode, two visitors (two client addresses behind a trusted proxy): the first starts a long
    training and presses Stop while the second trains; the first's run is gone, the second's finishes,
    and no more heavy jobs ran at once than the server allows."""
    import time

    folder = tmp_path_factory.mktemp("hosted-jobs")
    log = folder / "app.log"
    with running_app(log, SCDVIZ_WORK=str(folder), SCDVIZ_HOSTED="1", SCDVIZ_TRUST_PROXY="1",
                     SCDVIZ_MAX_JOBS="2") as url:
        pages = []
        for address in ("10.0.0.1", "10.0.0.2"):
            ctx = browser.new_context(viewport={"width": 1400, "height": 1800},
                                      extra_http_headers={"X-Forwarded-For": address})
            pg = ctx.new_page()
            pg.goto(url)
            pg.locator("#pair-summary").get_by_text("Compatible").wait_for(timeout=240_000)
            pg.get_by_role("tab", name="Calibrate / train").click()
            pages.append(pg)
        one, two = pages
        # hosted mode's cap on REINFORCE steps: the longest training it takes
        one.locator("input[aria-label='number input for REINFORCE steps']").fill("10")
        one.get_by_label("Save as").nth(1).fill("long-run")
        one.locator("#train-run").click()
        one.locator("#train-info").get_by_text("press Stop").wait_for(timeout=300_000)
        two.get_by_label("Save as").nth(1).fill("short-run")
        two.locator("input[aria-label='number input for REINFORCE steps']").fill("5")
        two.locator("#train-run").click()
        two.locator("#train-info").get_by_text("press Stop").wait_for(timeout=300_000)
        one.locator("#train-stop").click()
        runs = folder / "sessions"
        deadline = time.time() + 120
        while list(runs.glob("*/runs/policies/long-run")) and time.time() < deadline:
            time.sleep(1)
        assert not list(runs.glob("*/runs/policies/long-run"))  # the cancelled run's files are gone
        two.locator("#train-info").get_by_text("Done:").wait_for(timeout=600_000)
        assert len(list(runs.glob("*/runs/policies/short-run/best.safetensors"))) == 1
        time.sleep(3)
        assert not list(runs.glob("*/runs/policies/long-run"))  # and nothing recreated them
        text = log.read_text()
        assert "heavy job ended: train (cancelled)" in text
        peaks = [int(p) for p in re.findall(r"heavy job started: \w+ \(running \d+, peak (\d+)\)", text)]
        assert peaks and max(peaks) <= 2
        for pg in pages:
            assert "internal error" not in pg.content() and "Traceback" not in pg.content()
            pg.context.close()

"""The app on every supported model family (issue 58, item 6), driven through its own endpoints without a browser.

A producer and a consumer of one family are saved as local folders (``tests/families.py``: the same tiny random
architecture with seeds 0 and 1, one tokenizer), typed as the Pair tab's sources and loaded by the app's
``load_pair`` endpoint; each tab's endpoint then runs on the pair: Generate, Calibrate (the SCD tab needs a
calibration for a pair without a shipped one), SCD transfer and Eviction. A folder of an unsupported family gets
the library's refusal (``PairError``: the model type and the supported families) as the message a person reads,
never an internal error. Local folders are a local run's sources: hosted mode still refuses them.
"""

from __future__ import annotations

import gradio as gr
import pytest
from conftest import user_text
from families import FAMILIES, MODEL_TYPES, UNSUPPORTED, family_folder

from scdviz.app import pairs, session
from scdviz.app.inputs import UserError
from scdviz.app.requests import EvictRequest, ScdRequest
from scdviz.models.family import SUPPORTED

TEXT = user_text()
CONTEXT = TEXT[:700]  # ~340 tokens of the folders' tokenizer: longer than the windowed families' 16-token window
# a window with sliding and full layers (Gemma-3), fused projections without a window (Phi-4-mini), NoPE layers
# (SmolLM3), biased projections (Qwen2.5)
EVERY_TAB = ("gemma3", "phi4-mini", "smollm3", "qwen2.5")
NO_PROGRESS = {"progress": lambda *a, **k: None}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family name -> (producer folder, consumer folder), saved once per module."""
    made: dict[str, tuple[str, str]] = {}

    def get(name: str) -> tuple[str, str]:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            made[name] = tuple(str(family_folder(root / role, name, TEXT, seed=seed))
                               for role, seed in (("producer", 0), ("consumer", 1)))
        return made[name]

    return get


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The whole app (not launched); runs it makes go to a folder of this module."""
    from scdviz.app import webapp

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SCDVIZ_WORK", str(tmp_path_factory.mktemp("work")))
        yield webapp.build_demo()


def endpoint(demo: gr.Blocks, name: str):
    """The function behind the app's endpoint ``name`` (the UI's handler, errors translated by its guard)."""
    (dep,) = [d for d in demo.fns.values() if d.api_name == name]
    return dep.fn


def load(demo, producer: str, consumer: str):
    """What the Pair tab's Load button returns: (summary markdown, facts rows, pair key)."""
    return endpoint(demo, "load_pair")(producer, consumer, **NO_PROGRESS)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_pair_of_each_supported_family_loads_from_local_folders_and_generates(demo, folders, name):
    producer, consumer = folders(name)
    md, rows, key = load(demo, producer, consumer)
    assert md.startswith("**Compatible**") and f"{producer} → {consumer}" in md
    facts = {row[0]: row[1:] for row in rows}
    assert facts["source"] == [producer, consumer]
    arch = FAMILIES[name](0).config.architectures[0]
    assert facts["architecture"] == [arch, arch] and facts["layers"] == ["4", "4"]
    assert key == f"{producer}\n{consumer}"
    info, prod, cons = endpoint(demo, "generate")(key, prompt="the river ship harbour north wind", new_tokens=6,
                                                 chat=False, **NO_PROGRESS)
    assert "generated positions" in info and prod and cons


@pytest.mark.parametrize("name", EVERY_TAB)
def test_each_tab_works_on_a_family_pair(demo, folders, name):
    """Calibrate, then the SCD tab and the eviction tab draw every figure on the pair."""
    from scdviz import data
    from scdviz.app.ui import evict_tab, scd_tab

    _, _, key = load(demo, *folders(name))
    sess = session.Session()
    calibrate = endpoint(demo, "calibrate")
    *_, last = calibrate(key, sess, {}, None, domains=data.corpora()[:2], fit_windows=4, patch_layers=1, bits=4,
                         name=f"family-{name}", **NO_PROGRESS)
    md, fig, sess, figures, *_ = last
    assert md.startswith("Calibrated in") and hasattr(fig, "to_dict"), md
    assert (key.split("\n")[0], key.split("\n")[1]) in sess.calibrations  # the SCD tab now uses it

    scd_values = {n: getattr(ScdRequest(CONTEXT), n) for n in ScdRequest.controls()}
    scd_values |= {"continuation_tokens": 8, "generated_tokens": 4}
    info, table, texts, answers, *plots = endpoint(demo, "scd_transfer")(key, sess, **scd_values, **NO_PROGRESS)
    assert "prompt tokens" in info and "your calibration" in info, info
    shown = list(table["method"])
    for method in ("oracle", "raw KV", "4-bit KV", "SCD reuse-only", "SCD full"):
        assert method in shown, (method, shown)
    labels = {text for text, tag in texts if tag is None and text.startswith("\n")}  # each method's text
    assert {"\noracle: ", "\nSCD full: "} <= labels, labels
    # the question is asked by default: each method's answer with its F1, the table's QA F1 column the same numbers
    asked = [text for text, tag in answers if tag is None and text.startswith("\n") and "(F1 " in text]
    assert len(asked) == len(shown) and asked[0].startswith("\noracle (F1 "), asked
    f1 = {t.split(" (F1 ")[0].strip(): float(t.split(" (F1 ")[1].split(")")[0]) for t in asked}
    assert all(abs(f1[m] - q) < 0.006 for m, q in zip(table["method"], table["QA F1"], strict=True)), (f1, table)
    figs = [p for p in plots if hasattr(p, "to_dict")]
    assert len(figs) == len(scd_tab.FIGURES) and all(f.data for f in figs), name

    ev_values = {n: getattr(EvictRequest(CONTEXT), n) for n in EvictRequest.controls()}
    ev_values |= {"continuation_tokens": 8, "generated_tokens": 4}
    info, kept, versus, table, texts, method, *plots = endpoint(demo, "evict")(key, sess, **ev_values, **NO_PROGRESS)
    assert "context tokens per" in info, info
    assert len(kept) > 100 and len(versus) == len(kept)  # the context, token by token
    compared = set(table["method"])
    assert {"ObservedAttention", "SnapKV", "StreamingLLM"} <= compared, compared
    inspected = method["value"]
    assert inspected in method["choices"] and inspected in compared
    if inspected != ev_values["method"]:  # the shipped scorer could not run on this model: said, another shown
        assert f"{ev_values['method']} could not run on this model" in info and "Could not run here" in info, info
    figs = [p for p in plots if hasattr(p, "to_dict")]
    assert len(figs) == len(evict_tab.FIGURES) and all(f.data for f in figs), name


@pytest.mark.parametrize("name", list(UNSUPPORTED))
@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_an_unsupported_family_gets_the_pair_error_text_not_an_internal_error(demo, folders, tmp_path, name, role):
    refused = str(family_folder(tmp_path / name, name, TEXT))
    fine = folders("llama3")[0 if role == "consumer" else 1]
    sources = (refused, fine) if role == "producer" else (fine, refused)
    with pytest.raises(gr.Error) as caught:
        load(demo, *sources)
    message = caught.value.message
    assert f"{refused}: model type {MODEL_TYPES[name]!r} is not supported" in message, message
    assert all(family in message for family in SUPPORTED.values()), message  # what it can load instead
    assert "internal error" not in message and "Traceback" not in message
    assert caught.value.duration is None  # on screen until the person closes it: a list to read


def test_hosted_mode_still_refuses_a_family_folder(folders, monkeypatch):
    producer, consumer = folders("gemma3")
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    with pytest.raises(UserError, match="producer: this hosted demo loads only built-in models .*local folders are "
                                        "not available here"):
        pairs.get_pair(producer, consumer)


def test_all_built_in_specialists_is_refused_on_a_pair_of_another_producer(demo, folders):
    """The fan-out runs the built-in specialists, LoRAs of the built-in producer: on a family pair it says so at
    once (before it would load the built-in producer only to find it incompatible)."""
    _, _, key = load(demo, *folders("qwen2.5"))
    values = {n: getattr(ScdRequest(CONTEXT), n) for n in ScdRequest.controls()} | {"fan_out": True}
    with pytest.raises(gr.Error, match="All built-in specialists runs the built-in specialists from their own "
                                       "producer .* untick it"):
        endpoint(demo, "scd_transfer")(key, session.Session(), **values, **NO_PROGRESS)

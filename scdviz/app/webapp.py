"""scdviz web app: builds the Gradio Blocks from the library and launches it.

    python app.py            # from a checkout (a Space runs this file)
    python -m scdviz app     # from an installed package
    # both serve on http://127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT to change)

Settings come from environment variables (see scdviz/settings.py and the README). Models
load once and are shared by all users (scdviz.models.hf serialises the model work that
installs hooks); each visitor's artefacts live in a ``Session`` in gr.State; hosted mode's
rules are in scdviz.app.hosting; the tabs' work is in scdviz.app.pairs / scd / evict / train /
results. Nothing heavy happens at import time.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from scdviz import data, drift, settings
from scdviz.app import evict, pairs, results, scd, session
from scdviz.app import train as training
from scdviz.app.ui import evict_tab, pair_tab, results_tab, scd_tab, train_tab
from scdviz.app.ui.common import redraw_on_select

# Seconds of GPU each handler may hold on a ZeroGPU Space (its default is 60; its maximum
# is about 300). Calibration and training are capped by their controls to fit.
GPU_SECONDS = {"load": 120, "generate": 60, "scd": 120, "scd_fan_out": 240, "evict": 120, "calibrate": 300,
               "train": 300}

try:  # ZeroGPU Spaces: run model work under a GPU allocation; a no-op elsewhere
    import spaces  # type: ignore

    def gpu(kind: str):
        return spaces.GPU(duration=GPU_SECONDS[kind])
except ImportError:  # pragma: no cover - the package exists only on Spaces

    def gpu(kind: str):
        return lambda fn: fn


def _examples(n: int = 3, chars: int = 600) -> list[str]:
    """Opening text of a few shipped evaluation passages."""
    out = []
    for corpus in data.corpora():
        for passage in data.load_split(corpus, "eval")[1 : 1 + (n + 1) // 2]:
            out.append(passage[:chars].rsplit(" ", 1)[0])
    return out[:n]


def _key(producer: str, consumer: str) -> str:
    return f"{producer}\n{consumer}"


def _pair(key: str):
    return pairs.get_pair(*key.split("\n"))


def _session(sess, key: str | None = None) -> session.Session:
    """The visitor's Session; ``key`` (gradio's session hash) names its folder, removed when the page closes."""
    return (sess if isinstance(sess, session.Session) else session.Session()).bind(key)


@gpu("load")
def load(producer, consumer, progress):
    pair = pairs.get_pair(producer, consumer, progress=progress)
    return pairs.pair_summary(pair), drift.facts_rows(pair), _key(pair.producer_source, pair.consumer_source)


@gpu("generate")
def generate(key, request):
    pair = _pair(key)
    gen = pairs.generate_both(pair, request)
    tok = pair.tokenizer
    pieces = [[tok.decode([i]) for i in ids] for ids in (gen.producer_ids, gen.consumer_ids)]
    same = sum(a == b for a, b in zip(gen.producer_ids, gen.consumer_ids))
    md = (f"Prompt: {gen.prompt_tokens} tokens. Consumer agrees with producer on {same}/{len(gen.consumer_ids)} "
          f"generated positions. Both generations took {gen.seconds:.1f} s.")
    return pieces[0], pieces[1], md


def scd_run(key, sess, request):
    """One text through every method; with fan_out, also for every other built-in specialist (one table)."""
    request = request.checked()  # fan_out decides the GPU duration: checked before either starts
    run = _scd_fan_out if request.fan_out else _scd_one
    return run(key, _session(sess), request)


@gpu("scd")
def _scd_one(key, sess, request):
    return scd.scd_run(_pair(key), request, session=sess)


@gpu("scd_fan_out")
def _scd_fan_out(key, sess, request):
    import pandas as pd

    pair = _pair(key)
    out = scd.scd_run(pair, request, session=sess)
    tables = [out["table"].assign(specialist=pair.consumer_source)]
    for consumer in pairs.builtin_choices()[1]:
        if consumer != pair.consumer_source:
            other = scd.scd_run(pairs.get_pair(pair.producer_source, consumer), request, session=sess)
            tables.append(other["table"].assign(specialist=consumer))
    out["table"] = pd.concat(tables, ignore_index=True)
    out["info"] += (f" Fan-out: {len(tables)} specialists on the same text from the same producer, each with "
                    "its own calibration; texts and plots show the loaded pair.")
    return out


@gpu("evict")
def evict_run(key, sess, request):
    return evict.evict_run(_pair(key), request, session=_session(sess))


@gpu("calibrate")
def calibrate(key, sess, request, page=None):
    from scdviz import plots

    sess = _session(sess, page)
    calib, folder = training.calibrate_for(_pair(key), sess, request)
    md = (f"Calibrated in {calib.stats.get('seconds_total', '?')} s and saved to `{_shown(folder)}`; the SCD tab "
          f"now uses it for you (other visitors keep theirs). {scd.calibration_summary(calib)}")
    return md, plots.selection_curve(calib.selection_kl, calib.patch_order), sess


def load_calibration(key, sess, folder):
    from scdviz import plots

    sess = _session(sess)
    calib = training.load_calibration_for(_pair(key), sess, folder)
    return (f"Loaded; the SCD tab now uses it for you. Patch order: {calib.patch_order}.",
            plots.selection_curve(calib.selection_kl, calib.patch_order), sess)


@gpu("train")
def train(key, sess, request, page=None):
    from scdviz import plots

    pair, sess = _pair(key), _session(sess, page)
    for item in training.train_policy_live(pair, sess, request):
        if isinstance(item, tuple):  # (folder, final log)
            folder, log = item
            yield (f"Done: {len(log['steps'])} steps; best policy saved in `{_shown(folder)}` and added to your "
                   f"eviction methods as `yours:{folder.name}`.", plots.training_curve(log), sess)
        else:
            done = len((item or {}).get("steps", []))
            yield (f"Training on {pair.producer_source}: {done} REINFORCE steps so far.", plots.training_curve(item),
                   sess)


def _shown(folder: Path) -> str:
    """A run folder as shown to a visitor: relative to the cache folder in hosted mode."""
    if settings.hosted():
        return f"(this session's folder)/{folder.name} - deleted when you close the page"
    return str(folder)


def compare_results(shipped, uploads, local, sess, upload_roots=(), page=None) -> dict:
    """The Results tab's view of the chosen records (``results.compare_results``) for this visitor."""
    return results.compare_results(shipped, uploads, local, _session(sess, page), upload_roots)


def export_figures(figs, sess, tab: str, page=None) -> list[str]:
    """A tab's current figures as files in this visitor's scratch folder (``results.export_figures``)."""
    return results.export_figures(figs, _session(sess, page), tab)


def _windows(n: int = 3, tokens: int = 288) -> list[str]:
    """Decoded evaluation windows of ``tokens`` tokens (the benchmark's own windows)."""
    from transformers import AutoTokenizer

    from scdviz.models import builtin

    tok = AutoTokenizer.from_pretrained(builtin.producer_dir())
    out = []
    for corpus in data.corpora():
        for w in data.token_windows(tok, data.load_split(corpus, "eval"), tokens, (n + 1) // 2):
            out.append(tok.decode(w))
    return out[:n]


def build_demo() -> gr.Blocks:
    """The whole app as a Blocks object (tests build it without launching)."""
    from gradio.utils import get_upload_folder

    producer, consumers = pairs.builtin_choices()
    # gradio's own cache of served/uploaded files is swept hourly (files older than an hour)
    with gr.Blocks(title="scdviz", delete_cache=(3600, 3600)) as demo:
        gr.Markdown(
            "# scdviz\nMove a KV cache from a producer model to a fine-tuned consumer (SCD) and prune it "
            "with a learned eviction policy (DistillCache), and see what happens inside both models."
            + ("\n\n*Hosted demo*: built-in models only; what you calibrate or train lives in this page's session "
               "and is deleted when you close it." if settings.hosted() else "")
        )
        pair_state = gr.State("")
        # one Session per open page: this visitor's calibrations, policies and folder (deleted with the page)
        sess = gr.State(session.open_session, time_to_live=settings.session_ttl(),
                        delete_callback=session.Session.close)
        with gr.Tab("Pair") as tab:
            redraw_on_select(tab)
            pair_tab.build(
                pair_tab.PairTabFns(
                    producer_choices=[producer],
                    consumer_choices=consumers,
                    default_producer=settings.default_producer(),
                    default_consumer=settings.default_consumer(),
                    load=load,
                    generate=generate,
                    examples=_examples(),
                ),
                pair_state,
                demo,
            )
        windows = _windows()
        with gr.Tab("SCD transfer") as tab:
            redraw_on_select(tab)
            scd_tab.build(scd_run, windows, pair_state, sess, export=export_figures)
        with gr.Tab("DistillCache eviction") as tab:
            redraw_on_select(tab)
            evict_tab.build(evict_run, _examples(3, 2000), pair_state, sess, export=export_figures)
        with gr.Tab("Calibrate / train") as tab:
            redraw_on_select(tab)
            train_tab.build(calibrate, load_calibration, train, pair_state, sess, export=export_figures)
        with gr.Tab("Results") as tab:
            redraw_on_select(tab)
            uploads = (Path(get_upload_folder()),)  # where gradio puts uploaded files

            def open_records(shipped, files, local, s, page=None):
                return compare_results(shipped, files, local, s, uploads, page)

            results_tab.build(open_records, list(results.shipped_records()), sess, export_figures,
                              local_runs=None if settings.hosted() else lambda: list(results.local_records()),
                              runs_folder=results.runs_root_shown())
        demo.unload(_on_page_closed)
    for dep in demo.fns.values():  # gr.State's per-page initial value: an event gradio names after the function
        if dep.fn is session.open_session:
            dep.api_visibility = "private"  # internal, as the page-close handler: not an API endpoint
    demo.queue(default_concurrency_limit=1, max_size=64)
    return demo


def _on_page_closed(request: gr.Request):  # registered by demo.unload, which keeps it private
    """A page closed: its session folder (scratch files, hosted runs) goes at once; gradio drops
    the in-memory state an hour later (and calls Session.close then)."""
    if request is not None and request.session_hash:
        session.remove_folder_of(request.session_hash)


def launch_kwargs() -> dict:
    """launch() settings: GRADIO_SERVER_NAME / GRADIO_SERVER_PORT are honoured (gradio reads them)."""
    # the visitors' session folders (scratch: CSV and figure exports) may be served as downloads
    return {"max_file_size": f"{settings.max_upload_mb()}mb", "show_error": True,
            "allowed_paths": [str(session.sessions_root())]}


def main() -> None:
    """Start the app (hosted mode first removes session folders left by an earlier process)."""
    import logging

    logging.basicConfig(level=logging.INFO)
    if settings.hosted():
        removed = session.clean_stale()  # session folders of an earlier process: their pages are gone
        logging.getLogger("scdviz").info("hosted mode: removed %d stale session folders", removed)
    build_demo().launch(**launch_kwargs())


if __name__ == "__main__":
    main()

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

import dataclasses
import functools
import hashlib
import json
import logging
import threading
import time
from pathlib import Path

import gradio as gr
from gradio.route_utils import FnIndexInferError

from scdviz import data, drift, settings
from scdviz.app import evict, gpu, hosting, pairs, results, scd, session
from scdviz.app import train as train_work
from scdviz.app.inputs import UserError
from scdviz.app.jobs import Jobs, visitor_of
from scdviz.app.requests import EvictRequest, ScdRequest
from scdviz.app.ui import evict_tab, pair_tab, results_tab, scd_tab, train_tab
from scdviz.app.ui.common import redraw_on_select
from scdviz.progress import Done, Failed, Step

STUDENT_FILE = POLICY_FILE = "best.safetensors"  # what a fit or a training saves in its run folder

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


def load(producer, consumer, progress):
    """Load (or find loaded) a pair in this process, which keeps the models (no GPU call: on a Space the built-in
    pairs were loaded at import, ``gpu.preload``)."""
    pair = pairs.get_pair(producer, consumer, progress=progress)
    return pairs.pair_summary(pair), drift.facts_rows(pair), _key(pair.producer_source, pair.consumer_source)


def _through(work, report=None):
    """Follow a GPU call (``scdviz.app.gpu``) to its result: each Step told to ``report(desc, done, total)``, a
    Failed as UserError."""
    for item in work:
        if isinstance(item, Done):
            return item.value
        if isinstance(item, Failed):
            raise UserError(item.message)
        if report is not None:
            report(item.desc, item.done, item.total)
    raise RuntimeError("the GPU call ended without a result")


def generate(key, request, progress=None):
    gen = _through(gpu.generate(key, request.checked()), progress)
    tok = pairs.get_pair(*key.split("\n")).tokenizer  # decoding needs no GPU
    pieces = [[tok.decode([i]) for i in ids] for ids in (gen.producer_ids, gen.consumer_ids)]
    same = sum(a == b for a, b in zip(gen.producer_ids, gen.consumer_ids))
    md = (f"Prompt: {gen.prompt_tokens} tokens. Consumer agrees with producer on {same}/{len(gen.consumer_ids)} "
          f"generated positions. Both generations took {gen.seconds:.1f} s."
          + (" Stopped at the end of the chat turn." if gen.stopped_at_turn_end else ""))
    return pieces[0], pieces[1], md


def scd_run(key, sess, request, progress=None):
    """One text through every method with this visitor's calibration (else the shipped one); with fan_out, also
    for every other built-in specialist (one table). Figures are built here, from the GPU call's arrays."""
    request = request.checked()  # fan_out decides the GPU duration: checked before either starts
    producer = str(key).split("\n")[0]
    if request.fan_out and producer != pairs.builtin_choices()[0]:  # the specialists are LoRAs of that one model
        raise UserError(f"All built-in specialists runs the built-in specialists from their own producer "
                        f"({pairs.builtin_choices()[0]}); the loaded pair's producer is {producer[:80]}, so untick it "
                        f"(or load the built-in pair)")
    sess = _session(sess)
    fan_out = len(pairs.builtin_choices()[1]) if request.fan_out else 1
    out = _through(gpu.scd(key, request, _calibration_of(sess, key), fan_out=fan_out), progress)
    return {**out, "figures": scd.scd_figures(out["figures"])}


def evict_run(key, sess, request, progress=None):
    """The eviction tab's methods on one context, this visitor's own policies included; figures built here."""
    sess, request = _session(sess), request.checked()
    evict.hosted_cost(_pair(key).tokenizer, request)  # before any GPU time
    out = _through(gpu.evict(key, request, {k: str(v) for k, v in sess.policies.items()}), progress)
    return {**out, "figures": evict.evict_figures(out["figures"])}


def _calibration_of(sess: session.Session, key: str) -> str | None:
    """The folder of this visitor's calibration for the pair ``key`` (None: the shipped one)."""
    folder = sess.calibrations.get(tuple(str(key).split("\n", 1)))
    return None if folder is None else str(folder)


def _page(http) -> str | None:
    """The page's session key (gradio's session hash) of a gr.Request, if any."""
    return getattr(http, "session_hash", None) or None


def _progress_of(progress, step: Step) -> None:
    if progress is not None:
        progress((step.done, step.total or None), desc=step.desc)


class Pace:
    """A job's time left, from how fast its current step has gone so far (one per followed job)."""

    def __init__(self) -> None:
        self.desc, self.since, self.first = None, 0.0, 0

    def eta(self, step: Step) -> str:
        """``, about N s left`` for ``step`` once it has moved past where it was first seen; else ``""``."""
        now = time.monotonic()
        if step.desc != self.desc:
            self.desc, self.since, self.first = step.desc, now, step.done
            return ""
        if step.done <= self.first or not step.total:
            return ""
        left = (now - self.since) / (step.done - self.first) * (step.total - step.done)
        return f", about {left / 60:.0f} min left" if left >= 120 else f", about {left:.0f} s left"


def _run_job(jobs: Jobs, what: str, sess: session.Session, http, name, kind: str, call, progress):
    """Start a heavy job making a run folder ``runs/<kind>/<name>`` of the visitor's session and follow the GPU call
    ``call(folder)`` (``scdviz.app.gpu``): yields each ``Step`` (shown on ``progress``), then the folder and the
    call's result."""
    job = jobs.start(visitor_of(http), sess.id, what, makes_run=True)
    try:
        folder = sess.new_run(name, kind)
    except BaseException:
        jobs.finish(job, made_run=False)  # a refused name makes no run
        raise
    job.folder = folder
    for item in jobs.follow(job, call(str(folder)), discard=lambda: sess.discard_run(folder)):
        if isinstance(item, Step):
            _progress_of(progress, item)
            yield item
        else:
            yield folder, item


def calibrate(jobs, key, sess, request, http=None, progress=None):
    """Calibrate the pair for this visitor (a heavy job): yields (markdown, figure or gr.skip(), session)."""
    from scdviz import plots

    sess, req = _session(sess, _page(http)), request.checked()
    for item in _run_job(jobs, "calibrate", sess, http, req.name, "calibrations",
                         lambda folder: gpu.calibrate(key, req, folder), progress):
        if isinstance(item, Step):
            yield f"Calibrating: {item.desc} ({item.done}/{item.total}); press Stop to cancel.", gr.skip(), sess
        else:
            folder, shown = item
            sess.calibrations[tuple(key.split("\n", 1))] = folder
            md = (f"Calibrated in {shown['seconds']} s and saved to `{_shown(folder)}`; the SCD tab now uses it for "
                  f"you (other visitors keep theirs). {shown['summary']}")
            yield md, plots.selection_curve(shown["selection_kl"], shown["patch_order"]), sess


def distil(jobs, key, sess, request, http=None, progress=None):
    """Train the correction stage of this visitor's calibration through the consumer (a heavy job): yields
    (markdown, figure or gr.skip(), session)."""
    from scdviz import plots

    sess, req = _session(sess, _page(http)), request.checked()
    base = _calibration_of(sess, key)
    work, pace = work_folder(sess, "distil", key, base, req), Pace()
    for item in _run_job(jobs, "distil", sess, http, req.name, "calibrations",
                         lambda folder: gpu.distil(key, req, folder, base, str(work)), progress):
        if isinstance(item, Step):
            yield (f"Training the correction stage: {item.desc} ({item.done}/{item.total}{pace.eta(item)}); press "
                   "Stop to cancel (the same settings asked for again resume where it stopped).", gr.skip(), sess)
        else:
            folder, log = item
            sess.calibrations[tuple(key.split("\n", 1))] = folder
            yield _distil_summary(log, folder), plots.distil_curve(log), sess


def work_folder(sess: session.Session, kind: str, key: str, base, req) -> Path:
    """The folder of a ``kind`` fit's ("distil": the correction stage's prepared windows and checkpoint; "fit": the
    distilled scorer's checkpointed sums and listwise spool) in the visitor's session: one per pair, base artefact
    and settings (the name it is saved under aside), so the same ask after a Stop resumes where it stopped."""
    recipe = json.dumps([key, str(base), {k: v for k, v in dataclasses.asdict(req).items() if k != "name"}],
                        sort_keys=True)
    return sess.folder / f"{kind}-work" / hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _distil_summary(log: dict, folder: Path) -> str:
    """What a visitor reads after the correction stage trained: validation KL before and after per plan."""
    kl, best, f = log["val_kl"], log["best_epoch"], log["footprint"]
    rows = "\n".join(f"| {name} | {by[0]:.4f} | {by[best]:.4f} | {by[best] / by[0]:.3f}× |"
                      for name, by in log["val_kl_by_plan"].items())
    kept = (f"validation {best} of {len(kl) - 1} kept (after {log['val_steps'][best]} steps)" if best else
            "no validation beat the closed form, so the calibration is the closed form again")
    if log.get("resumed_at"):
        kept += f"; resumed after a stop at step {', '.join(map(str, log['resumed_at']))}"
    note = ("\n\nYour calibration has no rate curves (`python -m scdviz rate` makes them), so it trained at the "
            "operating point only." if log.get("asked_budgets_without_rate") else "")
    recall = log["recall_windows"]
    what = ("objective (KL; quoted tokens: NLL less the oracle's)" if any(recall)
            and log["config"].get("recall_target") == "quote" else "KL")
    return (f"Trained in {log['seconds']:.0f} s on {log['train_windows']} windows ({recall[0]} of them and "
            f"{recall[1]} of the validation ones quote their prompt); {kept}; saved to "
            f"`{_shown(folder)}`. The SCD tab now uses it for you and shows each SCD method beside its closed "
            f"form.\n\n| validation {what} ({log['val_windows']} calib windows) | closed form | trained | ratio |\n"
            f"|---|---|---|---|\n{rows}\n\nThe stage: {f['layers']} of {f['of_layers']} layers, {f['mb']:.2f} MB, "
            f"{100 * f['of_prefill']:.2f}% of the consumer's prefill FLOPs.{note}")


def load_calibration(key, sess, folder):
    """Make a saved calibration folder this visitor's for the pair (refused for another pair's; in hosted mode
    only this session's own run folders can be named)."""
    from scdviz import plots

    sess = _session(sess)
    path = hosting.user_folder(folder, "calibration folder", roots=(sess.folder,))
    shown = _through(gpu.check_calibration(key, str(path)))
    sess.calibrations[tuple(key.split("\n", 1))] = Path(path)
    return (f"Loaded; the SCD tab now uses it for you. Patch order: {shown['patch_order']}.",
            plots.selection_curve(shown["selection_kl"], shown["patch_order"]), sess)


def fit(jobs, key, sess, request, http=None, progress=None):
    """Fit the distilled scorer for this visitor (a heavy job): yields (markdown, figure or gr.skip(), session)."""
    from scdviz import plots

    sess, req = _session(sess, _page(http)), request.checked()
    producer = key.split("\n")[0]
    train_work.hosted_fit(_pair(key))  # before any GPU time
    work, pace = work_folder(sess, "fit", key, None, req), Pace()
    for item in _run_job(jobs, "fit", sess, http, req.name, "policies",
                         lambda folder: gpu.fit(key, req, folder, str(work)), progress):
        if isinstance(item, Step):
            yield (f"Fitting on {producer}: {item.desc} ({item.done}/{item.total}{pace.eta(item)}); press Stop to "
                   "cancel (the same settings asked for again resume where it stopped).", gr.skip(), sess)
        else:
            folder, log = item
            sess.policies[f"yours:{folder.name}"] = folder / STUDENT_FILE
            chosen = log["kept"]  # the candidate the fit kept
            yield (f"Fitted in {log['seconds']:.0f} s on {log['rows']:,} token rows; saved in `{_shown(folder)}` and "
                   f"added to your eviction methods as `yours:{folder.name}`. Validation KL of the kept candidate "
                   f"{chosen['val_kl']:.4f} against H2O's {log['val_heuristic']:.4f} on the same "
                   f"{len(log.get('h2o_per_context', []))} contexts and budgets.", plots.fit_candidates(log), sess)


def train(jobs, key, sess, request, http=None, progress=None):
    """Train a policy for this visitor (a heavy job): yields (markdown, figure, session) as it trains."""
    from scdviz import plots

    sess, req = _session(sess, _page(http)), request.checked()
    producer = key.split("\n")[0]
    for item in _run_job(jobs, "train", sess, http, req.name, "policies", lambda folder: gpu.train(key, req, folder),
                         progress):
        if isinstance(item, Step):
            done = len((item.log or {}).get("steps", []))
            yield (f"Training on {producer}: {item.desc} ({item.done}/{item.total}); {done} REINFORCE "
                   "steps so far; press Stop to cancel.", plots.training_curve(item.log), sess)
        else:
            folder, log = item
            sess.policies[f"yours:{folder.name}"] = folder / POLICY_FILE
            log = log or {"steps": []}
            yield (f"Done: {len(log['steps'])} steps; best policy saved in `{_shown(folder)}` and added to your "
                   f"eviction methods as `yours:{folder.name}`.", plots.training_curve(log), sess)


def stop_jobs(jobs, sess, what: str) -> str:
    """The Stop button of a heavy job: cancel this visitor's ``what`` job (its files are removed)."""
    n = jobs.cancel(sess.id, what) if isinstance(sess, session.Session) else 0
    return f"Stopping the {what} job; what it wrote is removed." if n else f"No {what} job of yours is running."


def _shown(folder: Path) -> str:
    """A run folder as shown to a visitor: relative to the cache folder in hosted mode."""
    if settings.hosted():
        return f"(this session's folder)/{folder.name} - deleted when you close the page"
    return str(folder)


def compare_results(jobs, shipped, uploads, local, sess, upload_roots=(), http=None) -> dict:
    """The Results tab's view of the chosen records (``results.compare_results``) for this visitor; its CSV
    export counts toward the visitor's quota."""
    out = results.compare_results(shipped, uploads, local, _session(sess, _page(http)), upload_roots)
    if out["csv"]:
        _charge(jobs, http, [out["csv"]])
    return out


def export_figures(jobs, figs, sess, tab: str, http=None, static: bool = False) -> list[str]:
    """A tab's current figures as files in this visitor's scratch folder (``results.export_figures``): a light
    job (one of the server's ``SCDVIZ_MAX_EXPORTS`` places, never a heavy job's: it neither waits for nor blocks
    a training); the bytes count toward the visitor's quota."""
    sess = _session(sess, _page(http))
    job = jobs.start(visitor_of(http), sess.id, "export")
    try:
        paths = results.export_figures(figs, sess, tab, static)
        _charge(jobs, http, paths)
        return paths
    finally:
        jobs.finish(job)


def _charge(jobs, http, paths: list[str]) -> None:
    """Count files served to a visitor toward its quota; over it, they are removed and the request refused."""
    try:
        jobs.charge(visitor_of(http), sum(Path(p).stat().st_size for p in paths))
    except Exception:
        for p in paths:
            Path(p).unlink(missing_ok=True)
        raise


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


def _first_look(compute):
    """``compute()`` once, on first call (the first page opened), then its result for everyone: the analysis a tab
    shows when a page opens (the default pair on the tab's first example), at the cost of one run per server;
    None when the default pair has nothing to show (a refusal, logged)."""
    lock, done = threading.Lock(), {}

    def first():
        with lock:
            if "out" not in done:
                try:
                    done["out"] = compute()
                except ValueError as err:  # the default pair has nothing to show (no calibration): nothing shown
                    logging.getLogger("scdviz").info("no first look: %s", err)
                    done["out"] = None
            return done["out"]

    return first


def _example(out: dict) -> dict:
    """A tab's result shown as the page opens, said to be the example (the tests' ``FIRST_LOOK`` matches)."""
    return {**out, "info": "*Example shown when the page opened* (the first example below, the default pair and "
                           "controls; press the button to run your own). " + out["info"]}


def build_demo() -> gr.Blocks:
    """The whole app as a Blocks object (tests build it without launching)."""
    from gradio.utils import get_upload_folder

    producer, consumers = pairs.builtin_choices()
    jobs = Jobs()  # the server's heavy jobs: limits and cancellation (no visitor's data)
    export = functools.partial(export_figures, jobs)
    # gradio's own cache of served/uploaded files is swept hourly (files older than an hour)
    with gr.Blocks(title="scdviz", delete_cache=(3600, 3600)) as demo:
        gr.Markdown(
            "# scdviz\nMove a KV cache from a producer model to a fine-tuned consumer (SCD) and prune it "
            "with learned eviction (a scorer distilled from the future's attention, and DistillCache), and see what "
            "happens inside both models."
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
            first_key = _key(settings.default_producer(), settings.default_consumer())
            first_scd = _first_look(lambda: _example(scd_run(first_key, None, ScdRequest(text=windows[0]))))
            scd_tab.build(scd_run, windows, pair_state, sess, export=export, first=first_scd, demo=demo)
        with gr.Tab("Eviction") as tab:
            redraw_on_select(tab)
            passages = _examples(3, 2000)
            first_evict = _first_look(lambda: _example(evict_run(first_key, None, EvictRequest(context=passages[0]))))
            evict_tab.build(evict_run, passages, pair_state, sess, export=export, first=first_evict, demo=demo)
        with gr.Tab("Calibrate / train") as tab:
            redraw_on_select(tab)
            train_tab.build(functools.partial(calibrate, jobs), load_calibration, functools.partial(train, jobs),
                            functools.partial(stop_jobs, jobs), pair_state, sess, export=export,
                            distil=functools.partial(distil, jobs), fit=functools.partial(fit, jobs))
        with gr.Tab("Results") as tab:
            redraw_on_select(tab)
            uploads = (Path(get_upload_folder()),)  # where gradio puts uploaded files

            def open_records(shipped, files, local, s, http=None):
                return compare_results(jobs, shipped, files, local, s, uploads, http)

            results_tab.build(open_records, list(results.shipped_records()), sess, export,
                              local_runs=None if settings.hosted() else lambda: list(results.local_records()),
                              runs_folder=results.runs_root_shown())
        def on_page_closed(request: gr.Request):  # registered by demo.unload, which keeps it private
            """A page closed: its jobs stop and its session folder (scratch files, hosted runs) goes at once;
            gradio drops the in-memory state an hour later (and calls Session.close then)."""
            if request is not None and request.session_hash:
                jobs.cancel(session.folder_id(request.session_hash))
                session.remove_folder_of(request.session_hash)

        demo.unload(on_page_closed)
    for dep in demo.fns.values():  # gr.State's per-page initial value: an event gradio names after the function
        if dep.fn is session.open_session:
            dep.api_visibility = "private"  # internal, as the page-close handler: not an API endpoint
    demo.queue(default_concurrency_limit=1, max_size=64)
    demo.scdviz_jobs = jobs  # the server's limits, which the upload guard shares (``serve``)
    return demo


def launch_kwargs(jobs: Jobs | None = None) -> dict:
    """launch() settings: GRADIO_SERVER_NAME / GRADIO_SERVER_PORT are honoured (gradio reads them). No
    ``allowed_paths``: a file a handler returns is copied into gradio's cache under a secret-seeded hash,
    so only the visitor it was handed to can name it; session folders are never served by path. In hosted
    mode uploads are charged to their visitor (``scdviz.app.uploads.UploadGuard``) against the byte quota of
    ``jobs``, the server's (``build_demo`` keeps it as ``demo.scdviz_jobs``; without it the guard's own)."""
    from starlette.middleware import Middleware

    from scdviz.app.uploads import UploadGuard

    return {"max_file_size": f"{settings.max_upload_mb()}mb", "show_error": True,
            "app_kwargs": {"exception_handlers": {KeyError: _unknown_endpoint, FnIndexInferError: _unknown_endpoint},
                           "middleware": [Middleware(UploadGuard, jobs=jobs or Jobs())]}}


def forwarded_rule() -> str | None:
    """Keep uvicorn from rewriting a request's client address from a header a client wrote. uvicorn takes
    the client address from X-Forwarded-For when the connection comes from an address in
    ``FORWARDED_ALLOW_IPS`` (by default loopback: a client on the same machine, or any client behind a local
    proxy, could then name itself). Unless ``SCDVIZ_TRUST_PROXY=1`` (the app then reads the entry the proxy
    appended itself, ``visitor_of``) or ``FORWARDED_ALLOW_IPS`` is set, it is set to trust no address. Call
    before launch (uvicorn reads it when the server starts); returns the value set, or None."""
    import os

    if settings.trust_proxy() or "FORWARDED_ALLOW_IPS" in os.environ:
        return None
    os.environ["FORWARDED_ALLOW_IPS"] = ""  # uvicorn: trusted hosts, none
    return ""


def serve(demo: gr.Blocks, **overrides):
    """Launch ``demo`` as the app runs (``main``): the forwarded-header rule, then ``launch_kwargs()`` (the
    upload guard on the demo's ``Jobs``), with ``overrides`` (tests: a port, prevent_thread_lock)."""
    forwarded_rule()
    return demo.launch(**{**launch_kwargs(getattr(demo, "scdviz_jobs", None)), **overrides})


EVENT_ROUTES = ("/queue/join", "/run/predict", "/call/")  # where a client names an event (fn_index, api_name)


async def _unknown_endpoint(request, err: Exception):
    """gradio looks an event up by number or name and answers a client's unknown one with HTTP 500: a 404
    that says so instead (a KeyError anywhere else stays a server error, logged)."""
    from fastapi.responses import JSONResponse

    if any(route in request.url.path for route in EVENT_ROUTES):
        return JSONResponse({"error": f"no such endpoint: {str(err)[:80]}; the app's endpoints are listed at "
                                      "/gradio_api/info (or gradio_client's view_api())"}, status_code=404)
    logging.getLogger("scdviz").error("server error at %s: %s %s", request.url.path, type(err).__name__,
                                      str(err)[:200])
    return JSONResponse({"error": "internal server error"}, status_code=500)


def contain_files() -> dict[str, str]:
    """Every file the app writes under ``SCDVIZ_WORK``: gradio's cache and uploads (``GRADIO_TEMP_DIR``)
    and every temporary file, Chromium's profile included (``TMPDIR``), go there. The temporary folder is
    the sessions root, so gradio may copy a visitor's scratch files into its cache (it copies only from
    the temporary folder, the working directory or ``allowed_paths``). Hosted mode always; local use
    keeps a ``GRADIO_TEMP_DIR`` already set. Call before ``build_demo``; returns what was set."""
    import os
    import tempfile

    work = settings.work_dir()
    cache = os.environ.get("GRADIO_TEMP_DIR") if not settings.hosted() else None
    wanted = {"GRADIO_TEMP_DIR": cache or str(work / "gradio"), "TMPDIR": str(session.sessions_root())}
    for key, value in wanted.items():
        Path(value).mkdir(parents=True, exist_ok=True)
        os.environ[key] = value
    tempfile.tempdir = wanted["TMPDIR"]
    return wanted


def main() -> None:
    """Start the app (hosted mode first removes session folders left by an earlier process)."""
    logging.basicConfig(level=logging.INFO)
    if settings.hosted():
        removed = session.clean_stale()  # session folders of an earlier process: their pages are gone
        logging.getLogger("scdviz").info("hosted mode: removed %d stale session folders", removed)
    logging.getLogger("scdviz").info("files under %s", contain_files())
    if gpu.zero_gpu():  # ZeroGPU: the fixed models load at start, on cuda, so every GPU worker inherits them
        logging.getLogger("scdviz").info("ZeroGPU: preloaded %s", gpu.preload())
    serve(build_demo())


if __name__ == "__main__":
    main()

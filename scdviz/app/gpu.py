"""The app's GPU calls: pure functions of picklable inputs, run where ZeroGPU wants them.

On a ZeroGPU Space (the ``spaces`` package, with ``SPACES_ZERO_GPU`` set) every function here runs in a
forked worker process that holds a GPU for at most its duration: its arguments are pickled there and what it
yields is pickled back. So each takes only picklable values (the pair's sources as one key, the tab's request
dataclass, artefact paths) and yields the work's progress (``scdviz.progress.Step``), then ``Done(value)``
with everything the page needs, on the host (tables, per-layer arrays, texts, the summary of an artefact it
wrote into a run folder), or ``Failed(message)`` for a user's mistake (an exception other than gr.Error
would lose its message on the way back). Figures are built from the value in the server's process.
Closing one of these generators stops its work at its next step and removes the run folder it was writing;
so does ``scdviz.progress.STOP_FILE`` appearing in that folder (``scdviz.app.jobs`` writes it).

Sessions, heavy-job bookkeeping (limits, run counts, Stop) and the loaded models live in the server's process
(``scdviz.app.webapp``); on a Space the built-in pairs are loaded and placed on ``cuda`` at import
(``preload``), so a worker inherits them. Without ZeroGPU (a local install, a dedicated GPU) the same
functions run in the server's process, unchanged. Each call asks for the smallest duration its request
needs (``seconds``), within ZeroGPU's limit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from scdviz import progress

try:  # ZeroGPU Spaces; ``import spaces`` must come before anything initialises CUDA
    import spaces  # type: ignore
except ImportError:  # elsewhere: no such package, the decorator is a no-op
    spaces = None

MAX_SECONDS = 300  # the longest GPU call ZeroGPU grants one visitor's request
# seconds a call asks for: a fixed part, and per unit of the request's own size (tokens, windows, steps)
BASE_SECONDS = {"generate": 20, "scd": 40, "evict": 30, "calibrate": 60, "distil": 60, "fit": 60, "train": 60,
                "check": 20}


def zero_gpu() -> bool:
    """Running on ZeroGPU (the ``spaces`` package present and ``SPACES_ZERO_GPU`` true)."""
    return spaces is not None and os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")


def seconds(kind: str, request=None, fan_out: int = 1) -> int:
    """The GPU duration a call of ``kind`` asks for, sized by its request, at most ``MAX_SECONDS``."""
    base, extra = BASE_SECONDS[kind], 0
    if kind == "generate":
        extra = request.new_tokens // 4
    elif kind == "scd":
        from scdviz import qa

        extra = (request.continuation_tokens + request.generated_tokens + (qa.ANSWER_LEN if request.ask else 0)) // 2
    elif kind == "evict":
        from scdviz.evict import bench

        extra = 4 * len(request.methods or bench.focus_methods()) + request.generated_tokens // 2
    elif kind == "calibrate":
        extra = 12 * request.fit_windows + 8 * request.select_windows + 8 * request.rate_windows
    elif kind == "distil":
        extra = 2 * request.epochs * request.train_windows
    elif kind == "fit":
        extra = 8 * (request.contexts + request.val_contexts)
    elif kind == "train":
        extra = request.steps
    return int(min(MAX_SECONDS, (base + extra) * fan_out))


def _gpu(kind: str):
    """ZeroGPU's decorator with the duration ``seconds`` gives for the call's request (its second argument); a
    no-op without the package."""
    if spaces is None:
        return lambda fn: fn
    return spaces.GPU(duration=lambda key, request, *args, **kwargs: seconds(
        kind, request, kwargs.get("fan_out", 1) if kind == "scd" else 1))


def release_memory() -> None:
    """Hand memory a finished call freed back to the system: Python's cycles collected, then glibc asked to
    return its free heap pages (``malloc_trim``; a no-op elsewhere). Without it the server's resident memory
    only grows over a mixed load (each request's peak stays allocated, spread over malloc's arenas)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def stream(work, folder: str | None = None, logs: bool = False) -> Iterator:
    """``scdviz.progress.stream`` of the work, then ``release_memory`` however it ends."""
    try:
        yield from progress.stream(work, folder, logs)
    finally:
        release_memory()


def _pair(key: str):
    from scdviz.app import pairs

    producer, consumer = str(key).split("\n", 1)
    return pairs.get_pair(producer, consumer)


def preload() -> list[str]:
    """Load every built-in pair (the producer with each shipped specialist) into the server's pair cache, on the
    device the settings name (``cuda`` on a Space): a ZeroGPU worker inherits them instead of loading its own.
    Returns the keys loaded."""
    from scdviz.app import pairs

    producer, consumers = pairs.builtin_choices()
    keys = []
    for consumer in consumers[: pairs.MAX_PAIRS]:
        pairs.get_pair(producer, consumer)
        keys.append(f"{producer}\n{consumer}")
    return keys


@_gpu("generate")
def generate(key: str, request) -> Iterator:
    """Greedy continuations of the request's prompt by both models: Done(``pairs.Generation``)."""
    from scdviz.app import pairs

    yield from stream(lambda report: pairs.generate_both(_pair(key), request, report))


@_gpu("scd")
def scd(key: str, request, calibration: str | None = None, fan_out: int = 1) -> Iterator:
    """Every SCD method on the request's text (``scd.scd_run``) with the visitor's calibration folder (None: the
    shipped one); with ``fan_out`` > 1 also for every other built-in specialist of the same producer (their
    shipped calibrations), one table: Done(dict)."""
    from scdviz.app import scd as tab

    def work(report):
        import pandas as pd

        from scdviz.app import pairs

        pair = _pair(key)
        out = tab.scd_run(pair, request, calibration, report)
        if fan_out <= 1:
            return out
        tables = [out["table"].assign(specialist=pair.consumer_source)]
        for consumer in pairs.builtin_choices()[1]:
            if consumer != pair.consumer_source:
                other = tab.scd_run(pairs.get_pair(pair.producer_source, consumer), request, None, report)
                tables.append(other["table"].assign(specialist=consumer))
        out["table"] = pd.concat(tables, ignore_index=True)
        out["info"] += (f" Fan-out: {len(tables)} specialists on the same text from the same producer, each with "
                        "its own calibration; texts and plots show the loaded pair.")
        return out

    yield from stream(work)


@_gpu("evict")
def evict(key: str, request, policies: dict[str, str] | None = None) -> Iterator:
    """The request's eviction methods on one context (``evict.evict_run``), with the visitor's own policies and
    scorers (method name -> saved file): Done(dict)."""
    from scdviz.app import evict as tab
    from scdviz.app import train

    def work(report):
        mine = {name: train.load_artefact(path) for name, path in (policies or {}).items()}
        return tab.evict_run(_pair(key), request, mine, report)

    yield from stream(work)


@_gpu("calibrate")
def calibrate(key: str, request, folder: str) -> Iterator:
    """Calibrate the pair into ``folder``: Done(``train.calibration_shown``)."""
    from scdviz.app import train

    yield from stream(lambda report: train.calibrate_for(_pair(key), request, folder, report), folder)


@_gpu("distil")
def distil(key: str, request, folder: str, base: str | None = None, work: str | None = None) -> Iterator:
    """Train the correction stage of the calibration in ``base`` (None: the shipped one) into ``folder``, its
    checkpoint in ``work`` (a stopped fit asked for again resumes from it): Done(its training log)."""
    from scdviz.app import train

    yield from stream(lambda report: train.distil_for(_pair(key), request, folder, base, report, work), folder)


@_gpu("check")
def check_calibration(key: str, request: str) -> Iterator:
    """Read the calibration folder ``request`` (already allowed by the caller) for the pair:
    Done(``train.calibration_shown``)."""
    from scdviz.app import train

    yield from stream(lambda report: train.check_calibration(_pair(key), request))


@_gpu("fit")
def fit(key: str, request, folder: str, work: str | None = None) -> Iterator:
    """Fit the distilled scorer on the pair's producer into ``folder``, its checkpoint in ``work`` (a stopped fit
    asked for again resumes from it): Done(its fit log)."""
    from scdviz.app import train

    yield from stream(lambda report: train.fit_scorer(_pair(key), request, folder, report, work), folder)


@_gpu("train")
def train(key: str, request, folder: str) -> Iterator:
    """Train a DistillCache policy on the pair's producer into ``folder``; each Step carries the log so far:
    Done(the final log)."""
    from scdviz.app import train as training

    yield from stream(lambda report, on_log: training.train_policy(_pair(key), request, folder, report, on_log),
                      folder, logs=True)

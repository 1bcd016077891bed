"""Progress of long loops, one way for the CLI and the app: a tqdm bar, nothing, or a reporter.

The library's long loops iterate through ``steps(items, desc, progress)``. ``progress`` is

- ``True``: a tqdm bar (the CLI);
- ``False``: nothing (tests, inner loops);
- a callable ``report(desc, done, total)``: called before each item and after the last. The app
  passes one that shows the step in the page and raises ``Stopped`` once the visitor cancelled,
  so a cancelled calibration or training ends at its next step instead of running on.

``stream(work)`` runs ``work(report)`` in a thread and yields its progress as values (``Step``), then
``Done(result)`` or ``Failed(message)``: what the app's GPU calls (``scdviz.app.gpu``) send back from a
ZeroGPU worker process, where neither a reporter nor an exception's message would cross.

This module imports neither torch nor gradio.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

Reporter = Callable[[str, int, int], None]


class Stopped(Exception):
    """Raised by a reporter to end the work it follows (the visitor cancelled, the page closed)."""


BEAT_S = 1.0  # how often ``stream`` yields while its work runs
STOP_FILE = ".stop"  # in a run folder: the work writing it stops at its next step (``stream``)


@dataclass(frozen=True)
class Step:
    """Work's progress as it last reported it; ``log``: a training log so far, for a live plot (or None)."""

    desc: str
    done: int
    total: int
    log: dict | None = None


@dataclass(frozen=True)
class Done:
    """The work's result."""

    value: object


@dataclass(frozen=True)
class Failed:
    """The work refused its input: a ValueError's message (a user's mistake), for the page to show."""

    message: str


def stream(work: Callable[[Reporter], object], folder: str | Path | None = None, logs: bool = False) -> Iterator:
    """Run ``work(report)`` in a thread and yield a ``Step`` about every ``BEAT_S`` seconds while it runs, then
    ``Done(result)``, or ``Failed(message)`` when it raised a ValueError or was stopped; any other error is
    raised. With ``logs``,
    ``work(report, on_log)`` also gets a callback whose latest dict each Step carries. Closing the generator
    stops the work at its next reported step (the reporter raises ``Stopped``), waits for it, and removes
    ``folder`` (the run it was writing); so does ``STOP_FILE`` appearing in ``folder`` (the work then ends in
    ``Stopped``), which a follower in another process can write."""
    stop, state = threading.Event(), {"step": Step("starting", 0, 0), "log": None}

    def report(desc: str, done: int, total: int) -> None:
        state["step"] = Step(desc, done, total)
        if stop.is_set() or (folder is not None and (Path(folder) / STOP_FILE).exists()):
            raise Stopped("stopped")

    def main() -> None:
        try:
            state["result"] = work(report, lambda log: state.update(log=log)) if logs else work(report)
        except BaseException as err:  # noqa: BLE001 - handed to the generator below
            state["error"] = err

    thread = threading.Thread(target=main, name="work", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(BEAT_S)
            if thread.is_alive():
                step = state["step"]
                yield Step(step.desc, step.done, step.total, state["log"]) if logs else step
    except GeneratorExit:
        stop.set()
        thread.join()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    err = state.get("error")
    if isinstance(err, Stopped):  # told through STOP_FILE
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        yield Failed("stopped; what it had written is removed")
    elif isinstance(err, ValueError):
        yield Failed(str(err))
    elif err is not None:
        raise err
    else:
        if logs:  # the final log, which the last beat may not have carried
            step = state["step"]
            yield Step(step.desc, step.done, step.total, state["log"])
        yield Done(state["result"])


def steps(items: Iterable, desc: str, progress: bool | Reporter = True, total: int | None = None,
          name: Callable | None = None) -> Iterator:
    """``items`` one by one, with progress shown as ``progress`` says (module docstring); ``name(item)``
    adds what each step is to a reporter's ``desc`` (``methods: SCD full``). With a bool, the tqdm bar
    itself (a caller may ``set_postfix`` on it)."""
    if not callable(progress):
        return tqdm(items, desc=desc, total=total, disable=not progress)
    return _reported(items, desc, progress, total, name)


def _reported(items: Iterable, desc: str, progress: Reporter, total: int | None, name: Callable | None) -> Iterator:
    items = list(items) if total is None else items
    n = len(items) if total is None else total
    done = 0
    for item in items:
        progress(f"{desc}: {name(item)}" if name is not None else desc, done, n)
        yield item
        done += 1
    progress(desc, done, n)



def tell(progress: bool | Reporter, desc: str, done: int, total: int) -> None:
    """Tell a reporter one phase of work that is not a loop; a bool shows nothing."""
    if callable(progress):
        progress(desc, done, total)

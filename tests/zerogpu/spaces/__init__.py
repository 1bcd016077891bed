"""A stand-in for Hugging Face's ``spaces`` package that does to a GPU call what ZeroGPU does (``spaces`` 0.51.3,
``spaces/zero/decorator.py`` and ``wrappers.py``), on a machine without ZeroGPU, for tests.

``GPU(duration=...)`` returns the function unchanged unless ``SPACES_ZERO_GPU`` is true. When it is, every call runs
in a *forked* worker process: its arguments are pickled there (a ``PicklingError`` in the caller, as ZeroGPU's queue
raises) and what it returns, or each value a generator function yields, is pickled back. A ``gr.Error`` raised in
the worker reaches the caller as itself; any other exception as ``gr.Error(<its class name>, title="ZeroGPU worker
error")``: its message is lost, as on a Space. Closing a generator call's generator sets the worker's stop event,
which the worker checks after each value it yields and then closes the function's generator; the closing caller does
not wait for that (Gradio closes a cancelled generator on its event loop, where a wait would stall every visitor).
Coroutine functions are refused. Each call forks afresh (ZeroGPU may reuse an idle worker; a fresh one is the
stricter test: nothing a call leaves in its worker reaches the next), and nothing it changes in memory reaches the
caller's process.

Each call's duration (a number, or a callable given the call's arguments) is appended with the function's name to
the JSON-lines file ``SPACES_STANDIN_LOG`` names, when set.
"""

from __future__ import annotations

import functools
import inspect
import json
import multiprocessing
import os
import pickle
import threading
import traceback

__version__ = "0.51.3+standin"

_FORK = multiprocessing.get_context("fork")


def _zero_gpu() -> bool:
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")


def GPU(task=None, *, duration=None, size=None, **kwargs):  # noqa: N802 - the package's name
    """ZeroGPU's decorator (module docstring)."""
    if not callable(task):
        return functools.partial(GPU, duration=duration, size=size)
    if not _zero_gpu():
        return task
    if inspect.iscoroutinefunction(task):
        raise NotImplementedError("ZeroGPU runs no async def function")
    if inspect.isgeneratorfunction(task):
        @functools.wraps(task)
        def generator_handler(*args, **kw):
            yield from _call(task, duration, args, kw, generator=True)
        return generator_handler

    @functools.wraps(task)
    def handler(*args, **kw):
        for value in _call(task, duration, args, kw, generator=False):
            return value
    return handler


def _log(task, duration, args, kwargs) -> None:
    seconds = duration(*args, **kwargs) if callable(duration) else duration
    path = os.environ.get("SPACES_STANDIN_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"fn": task.__name__, "duration": seconds, "pid": os.getpid()}) + "\n")


def _error(name: str, message: str | None):
    import gradio as gr

    if message is not None:  # a gr.Error: its message crosses
        return gr.Error(message)
    return gr.Error(name, title="ZeroGPU worker error")


def _call(task, duration, args, kwargs, generator: bool):
    _log(task, duration, args, kwargs)
    payload = pickle.dumps((args, kwargs))  # raises PicklingError here, in the caller, as ZeroGPU's queue does
    results, theirs = _FORK.Pipe(duplex=False)
    stop = _FORK.Event()
    worker = _FORK.Process(target=_worker, args=(task, payload, theirs, stop, generator), daemon=True)
    worker.start()
    theirs.close()
    try:
        while True:
            try:
                kind, body = results.recv()
            except EOFError:
                raise _error("GPU task aborted", None) from None
            if kind == "value":
                try:
                    yield pickle.loads(body)
                except GeneratorExit:
                    stop.set()
                    raise
            elif kind == "error":
                name, message, trace = body
                print(trace)
                raise _error(name, message)
            else:  # "end"
                return
    finally:
        results.close()
        if stop.is_set():  # closed by a Stop: the caller (Gradio's event loop) does not wait for the worker to end
            threading.Thread(target=worker.join, daemon=True).start()
        else:
            worker.join(timeout=60)


def _worker(task, payload, results, stop, generator: bool) -> None:
    try:
        args, kwargs = pickle.loads(payload)
        if generator:
            gen = task(*args, **kwargs)
            for value in gen:
                if stop.is_set():
                    gen.close()
                    break
                results.send(("value", pickle.dumps(value)))
        else:
            results.send(("value", pickle.dumps(task(*args, **kwargs))))
        results.send(("end", None))
    except BaseException as err:  # noqa: BLE001 - sent to the caller, as ZeroGPU does
        import gradio as gr

        message = err.message if isinstance(err, gr.Error) else None
        try:
            results.send(("error", (type(err).__name__, message, traceback.format_exc())))
        except Exception:  # noqa: BLE001 - the caller has gone
            pass
    finally:
        results.close()
        os._exit(0)  # no atexit handler of the server's runs in its fork

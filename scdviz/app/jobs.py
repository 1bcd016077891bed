"""Heavy jobs of the whole server (calibration, distillation, fitting, training): how many run at once,
how many one visitor may start, and how one is cancelled; and the bytes of files each visitor is handed
or uploads.

One ``Jobs`` lives for the server (``build_demo`` makes it; it holds no visitor's data). A heavy job
starts only when fewer than ``SCDVIZ_MAX_JOBS`` run on the server and its visitor runs fewer than
``SCDVIZ_MAX_VISITOR_JOBS``. In hosted mode a job that makes a run also counts toward its session's
``SCDVIZ_MAX_SESSION_RUNS`` runs per ``SCDVIZ_SESSION_TTL`` seconds (the session is the ``owner``, one
open page) and toward its address's ``SCDVIZ_MAX_ADDRESS_RUNS``: each person behind one address (a lab)
gets their own allowance, and reloading the page, which gives a new session, does not pass the address's
ceiling. A visitor is the client's address (``visitor_of``). A figure export (``LIGHT``, a fraction of a
second) is no heavy job: it takes one of ``SCDVIZ_MAX_EXPORTS`` places of its own, so it neither waits for
a training nor keeps one from starting. ``charge`` counts the bytes a visitor is handed (exports, CSV)
and uploads (``scdviz.app.uploads``) against ``SCDVIZ_VISITOR_MB`` per ``SCDVIZ_SESSION_TTL``.

``follow`` follows a job's work, a generator of progress values (``scdviz.progress.stream``, in this
process or in a ZeroGPU worker: ``scdviz.app.gpu``), and yields its progress, then its result. The work
stops at its next step once the job is cancelled: by its Stop button or the page closing (``cancel``), or
when nobody follows it any more (the handler's generator, resumed about once a second while its page
listens, held a step and was not resumed for ``LIVENESS_S``: gradio cancelled the event; a watch thread
notices; while it waits on the work it still follows it). It is
told by closing its generator and by ``STOP_FILE`` in its run folder (which a worker process sees too);
a cancelled job's run folder is removed, so nothing it wrote outlives it. This module imports neither
torch nor gradio.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from scdviz import settings
from scdviz.errors import UserError
from scdviz.progress import BEAT_S, STOP_FILE, Done, Failed, Step

log = logging.getLogger("scdviz.jobs")

LIVENESS_S = 20.0  # a job nobody resumed for this long is cancelled
LIGHT = frozenset({"export"})  # quick jobs: their own small limit (SCDVIZ_MAX_EXPORTS), never a heavy job's place


def visitor_of(request) -> str:
    """Who sent a request (a gradio Request, a Starlette request or connection, or None): behind a trusted
    proxy (``SCDVIZ_TRUST_PROXY=1``, e.g. a Space) the X-Forwarded-For entry that proxy appended, the
    ``SCDVIZ_PROXY_HOPS``-th from the right (every header line of it, joined in order), never a left-most
    one, which the client writes; else the client's address."""
    if request is None:
        return "local"
    headers = getattr(request, "headers", None) or {}
    forwarded = ""
    if settings.trust_proxy():
        getlist = getattr(headers, "getlist", None)  # Starlette's Headers: every line of the header
        lines = getlist("x-forwarded-for") if callable(getlist) else [headers.get("x-forwarded-for", "")]
        entries = [e.strip() for e in ",".join(str(x) for x in lines).split(",") if e.strip()]
        if entries:
            forwarded = entries[-min(settings.proxy_hops(), len(entries))]
    if forwarded:
        return _host(forwarded)[:64]
    client = getattr(request, "client", None)
    return str(getattr(client, "host", None) or "unknown")[:64]


def _host(entry: str) -> str:
    """An X-Forwarded-For entry without its port, if it has one ("1.2.3.4:5678", "[::1]:80"), so that a
    proxy that writes ports does not make every connection a new visitor."""
    if entry.startswith("[") and "]" in entry:
        return entry[1:entry.index("]")]
    if entry.count(":") == 1:
        return entry.split(":")[0]
    return entry


@dataclass
class Job:
    """One heavy job: who started it, for which session folder, and whether it should stop."""

    visitor: str
    owner: str  # the session folder id (``Session.id``) the job writes into
    what: str  # "calibrate", "train", "export"
    stop: threading.Event = field(default_factory=threading.Event)
    # when its follower last handed out a step and was not resumed since; None while the follower is running
    # (waiting on the work is following it: a slow first step on a loaded host is not abandonment)
    beat: float | None = field(default_factory=time.monotonic)
    step: Step = Step("starting", 0, 0)  # as last reported
    made_at: float | None = None  # when it counted as one of its visitor's runs
    folder: Path | None = None  # the run folder its work writes (and watches for ``STOP_FILE``)
    discard: Callable[[], None] | None = None  # removes what its work wrote (``follow`` sets it)

    def halt(self) -> None:
        """Tell the work to stop: here, and through ``STOP_FILE`` in its folder (the work may run in another
        process: a ZeroGPU worker)."""
        self.stop.set()
        if self.folder is not None and self.folder.is_dir():
            (self.folder / STOP_FILE).touch()

    def cancelled(self) -> bool:
        """Cancelled, or abandoned by its follower."""
        if not self.stop.is_set() and self.beat is not None and time.monotonic() - self.beat > LIVENESS_S:
            log.info("job %s of %s: nobody follows it any more; stopping", self.what, self.owner)
            self.halt()
        return self.stop.is_set()


class Jobs:
    """The server's heavy jobs (module docstring)."""

    def __init__(self, limit: int | None = None, per_visitor: int | None = None, runs: int | None = None,
                 window_s: float | None = None, per_address: int | None = None, exports: int | None = None):
        self.limit = settings.max_jobs() if limit is None else limit
        self.per_visitor = settings.max_visitor_jobs() if per_visitor is None else per_visitor
        self.runs = settings.max_session_runs() if runs is None else runs  # per session (owner)
        self.per_address = settings.max_address_runs() if per_address is None else per_address  # per visitor
        self.exports = settings.max_exports() if exports is None else exports  # light jobs at once
        self.window_s = settings.session_ttl() if window_s is None else window_s
        self._lock = threading.Lock()
        self._watching = False
        self._running: list[Job] = []  # heavy jobs
        self._light: list[Job] = []  # exports
        self._made: dict[str, collections.deque] = {}  # session (owner) -> times it made a run
        self._made_by: dict[str, collections.deque] = {}  # visitor (address) -> times any of its sessions made one
        self._bytes: dict[str, collections.deque] = collections.defaultdict(collections.deque)  # (time, bytes)
        self._swept = time.monotonic()
        self.quota = settings.visitor_mb() * 2**20
        self.peak = 0  # most heavy jobs that ever ran at once (logged with every start)

    def _recent(self, table: dict, key: str, now: float) -> collections.deque:
        """The times in ``table[key]`` within the window (an empty deque, not stored, if none); once per
        window, forgets the sessions and visitors with nothing left in it. Called under the lock."""
        if now - self._swept > self.window_s:
            for tab in (self._made, self._made_by, self._bytes):
                for key_ in [k for k, q in tab.items()
                             if not q or now - (q[-1][0] if tab is self._bytes else q[-1]) > self.window_s]:
                    del tab[key_]
            self._swept = now
        times = table.get(key)
        if times is None:
            return collections.deque()
        while times and now - times[0] > self.window_s:
            times.popleft()
        return times

    def start(self, visitor: str, owner: str, what: str, makes_run: bool = False) -> Job:
        """A running Job, or UserError saying which limit it would pass. ``what`` in ``LIGHT`` (an export):
        only the server's ``SCDVIZ_MAX_EXPORTS`` applies; ``makes_run``: the session's and the address's run
        limits too (hosted mode)."""
        with self._lock:
            if what in LIGHT and not makes_run:
                if len(self._light) >= self.exports:
                    raise UserError(f"the server is writing {len(self._light)} figure exports, the most it writes at "
                                    "once (SCDVIZ_MAX_EXPORTS); try again in a second")
                job = Job(visitor, owner, what)
                self._light.append(job)
                log.debug("export started (%d at once)", len(self._light))
                return job
            if len(self._running) >= self.limit:
                raise UserError(f"the server is running {len(self._running)} heavy job"
                                f"{'s' if len(self._running) > 1 else ''} (calibration, training), the most "
                                f"it runs at once (SCDVIZ_MAX_JOBS); try again in a minute")
            mine = [j for j in self._running if j.visitor == visitor]
            if len(mine) >= self.per_visitor:
                raise UserError(f"you already run {len(mine)} heavy job{'s' if len(mine) > 1 else ''} "
                                f"({', '.join(j.what for j in mine)}); wait for it to end or stop it "
                                f"(SCDVIZ_MAX_VISITOR_JOBS = {self.per_visitor})")
            now = time.monotonic()
            made, made_by = self._recent(self._made, owner, now), self._recent(self._made_by, visitor, now)
            hours = f"{self.window_s / 3600:g} h"
            if makes_run and settings.hosted():
                if len(made) >= self.runs:
                    raise UserError(f"this hosted demo lets one session make {self.runs} runs (calibrations, "
                                    f"policies) per {hours} (SCDVIZ_MAX_SESSION_RUNS) and this page made {len(made)}; "
                                    f"a new page starts a new session, up to {self.per_address} runs per address")
                if len(made_by) >= self.per_address:
                    raise UserError(f"this hosted demo lets the sessions of one address make {self.per_address} runs "
                                    f"(calibrations, policies) per {hours} together (SCDVIZ_MAX_ADDRESS_RUNS) and "
                                    f"yours made {len(made_by)}; reloading the page does not reset this")
            job = Job(visitor, owner, what, made_at=now if makes_run else None)
            self._running.append(job)
            if makes_run:
                self._made.setdefault(owner, made).append(now)
                self._made_by.setdefault(visitor, made_by).append(now)
            self.peak = max(self.peak, len(self._running))
            if not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="jobs-watch", daemon=True).start()
            log.info("heavy job started: %s (running %d, peak %d)", what, len(self._running), self.peak)
        return job

    def charge(self, visitor: str, nbytes: int) -> None:
        """Count ``nbytes`` of files written for ``visitor``; UserError once its files over the last
        ``window_s`` seconds would pass ``SCDVIZ_VISITOR_MB``."""
        with self._lock:
            spent, now = self._bytes[visitor], time.monotonic()
            while spent and now - spent[0][0] > self.window_s:
                spent.popleft()
            used = sum(b for _, b in spent)
            if nbytes > 0 and used + nbytes > self.quota:
                raise UserError(f"this server writes at most {self.quota / 2**20:g} MB of files per visitor every "
                                f"{self.window_s / 3600:g} h (SCDVIZ_VISITOR_MB) and yours reached "
                                f"{used / 2**20:.1f} MB; try later")
            spent.append((now, nbytes))

    def used(self, visitor: str) -> int:
        """Bytes charged to ``visitor`` over the last ``window_s`` seconds."""
        with self._lock:
            now = time.monotonic()
            return sum(b for t, b in self._bytes.get(visitor, ()) if now - t <= self.window_s)

    def finish(self, job: Job, made_run: bool = True) -> None:
        """The job's work ended: free its place (once); ``made_run=False``: it made no run after all (its name was
        refused), so it does not count as one."""
        with self._lock:
            if job in self._light:
                self._light.remove(job)
                log.debug("export ended (%d at once)", len(self._light))
                return
            if job not in self._running:  # already finished (its follower and the watch may both end it)
                return
            self._running.remove(job)
            if not made_run and job.made_at is not None:
                for times in (self._made.get(job.owner), self._made_by.get(job.visitor)):
                    if times is not None and job.made_at in times:
                        times.remove(job.made_at)
            log.info("heavy job ended: %s%s (running %d)", job.what, " (cancelled)" if job.stop.is_set() else "",
                     len(self._running))

    def cancel(self, owner: str, what: str | None = None) -> int:
        """Cancel the jobs of one session folder (all, or those doing ``what``); returns how many."""
        with self._lock:
            found = [j for j in (*self._running, *self._light) if j.owner == owner and what in (None, j.what)]
        for job in found:
            job.halt()
        return len(found)

    def _watch(self) -> None:
        """While jobs run: notice those cancelled or that nobody follows any more (``Job.cancelled``), so their
        work stops, what it wrote is removed and their place is freed even when no follower resumes to look."""
        while True:
            time.sleep(BEAT_S)
            with self._lock:
                running = list(self._running)
                if not running:
                    self._watching = False
                    return
            for job in running:
                if job.cancelled():  # its work stops at its next step (STOP_FILE); what it wrote goes now
                    if job.discard is not None:
                        job.discard()
                    self.finish(job)

    def running(self) -> int:
        """Heavy jobs running now (exports not counted)."""
        with self._lock:
            return len(self._running)

    def follow(self, job: Job, work: Iterator, discard: Callable[[], None] | None = None) -> Iterator:
        """Follow a job's work, a generator of ``Step`` values ending in ``Done`` or ``Failed``
        (``scdviz.progress.stream``; under ZeroGPU it runs in a GPU worker process, ``scdviz.app.gpu``): yield
        each Step (kept as ``job.step``), then the result; ``Failed`` ends in UserError with its message. Every
        resume of this generator tells the job it is still followed; once the job is cancelled (Stop, the page
        closed, or nobody followed it for ``LIVENESS_S``) the work is closed (it stops at its next step),
        ``discard()`` removes what it wrote, and this ends in UserError. The job's place is freed however it
        ends."""
        job.discard, job.beat = discard, None
        try:
            for item in work:
                if isinstance(item, Done):
                    yield item.value
                    return
                if isinstance(item, Failed):
                    if job.stop.is_set():  # stopped through its folder's STOP_FILE
                        break
                    raise UserError(item.message)
                job.step = item
                if job.cancelled():
                    break
                job.beat = time.monotonic()
                yield item
                job.beat = None
            else:
                raise RuntimeError(f"{job.what}: the work ended without a result")
        except GeneratorExit:  # the follower closed this generator: gradio cancelled the event
            job.stop.set()
            raise
        finally:
            if job.stop.is_set():
                close = getattr(work, "close", None)
                if close is not None:
                    close()
                if discard is not None:
                    discard()
            self.finish(job)
        raise UserError(f"{job.what} stopped; what it had written is removed")

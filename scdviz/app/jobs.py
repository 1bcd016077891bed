"""Heavy jobs of the whole server (calibration, training, figure export): how many run at once, how
many one visitor may start, and how one is cancelled.

One ``Jobs`` lives for the server (``build_demo`` makes it; it holds no visitor's data). A job
starts only when fewer than ``SCDVIZ_MAX_JOBS`` run on the server and its visitor runs fewer than
``SCDVIZ_MAX_VISITOR_JOBS``; a job that makes a run also counts toward the visitor's
``SCDVIZ_MAX_SESSION_RUNS`` runs per ``SCDVIZ_SESSION_TTL`` seconds. A visitor is the client's
address (``visitor_of``), so reloading the page, which gives a new session, resets neither.

``follow`` runs a job's work in a thread and yields its progress. The work gets a reporter
(``scdviz.progress``) that raises ``Stopped`` at its next step once the job is cancelled: by its
Stop button or the page closing (``cancel``), or when nobody follows it any more (the handler's
generator, resumed about once a second while its page listens, was not resumed for
``LIVENESS_S``: gradio cancelled the event). A cancelled job's run folder is removed after its
thread ended, so nothing it wrote outlives it. This module imports neither torch nor gradio.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from scdviz import settings
from scdviz.errors import UserError
from scdviz.progress import Stopped

log = logging.getLogger("scdviz.jobs")

Step = collections.namedtuple("Step", "desc done total")  # a job's progress as its work last reported it
LIVENESS_S = 20.0  # a job nobody resumed for this long is cancelled
BEAT_S = 1.0  # how often ``follow`` yields while its job runs


def visitor_of(request) -> str:
    """Who sent a request (a gradio Request, or None): the first X-Forwarded-For address behind a
    trusted proxy (``SCDVIZ_TRUST_PROXY=1``, e.g. a Space), else the client's address."""
    if request is None:
        return "local"
    headers = getattr(request, "headers", None) or {}
    forwarded = headers.get("x-forwarded-for", "") if settings.trust_proxy() else ""
    if forwarded.strip():
        return forwarded.split(",")[0].strip()[:64]
    client = getattr(request, "client", None)
    return str(getattr(client, "host", None) or "unknown")[:64]


@dataclass
class Job:
    """One heavy job: who started it, for which session folder, and whether it should stop."""

    visitor: str
    owner: str  # the session folder id (``Session.id``) the job writes into
    what: str  # "calibrate", "train", "export"
    stop: threading.Event = field(default_factory=threading.Event)
    beat: float = field(default_factory=time.monotonic)  # when its follower last resumed
    step: Step = Step("starting", 0, 0)  # as last reported
    made_at: float | None = None  # when it counted as one of its visitor's runs

    def cancelled(self) -> bool:
        """Cancelled, or abandoned by its follower."""
        if not self.stop.is_set() and time.monotonic() - self.beat > LIVENESS_S:
            log.info("job %s of %s: nobody follows it any more; stopping", self.what, self.owner)
            self.stop.set()
        return self.stop.is_set()

    def report(self, desc: str, done: int, total: int) -> None:
        """The work's reporter (``scdviz.progress``): records the step; raises Stopped once cancelled."""
        self.step = Step(desc, done, total)
        if self.cancelled():
            raise Stopped(f"{self.what} cancelled")


class Jobs:
    """The server's heavy jobs (module docstring)."""

    def __init__(self, limit: int | None = None, per_visitor: int | None = None, runs: int | None = None,
                 window_s: float | None = None):
        self.limit = settings.max_jobs() if limit is None else limit
        self.per_visitor = settings.max_visitor_jobs() if per_visitor is None else per_visitor
        self.runs = settings.max_session_runs() if runs is None else runs
        self.window_s = settings.session_ttl() if window_s is None else window_s
        self._lock = threading.Lock()
        self._running: list[Job] = []
        self._made: dict[str, collections.deque] = collections.defaultdict(collections.deque)  # visitor -> times
        self._bytes: dict[str, collections.deque] = collections.defaultdict(collections.deque)  # (time, bytes)
        self.quota = settings.visitor_mb() * 2**20
        self.peak = 0  # most jobs that ever ran at once (logged with every start)

    def start(self, visitor: str, owner: str, what: str, makes_run: bool = False) -> Job:
        """A running Job, or UserError saying which limit it would pass."""
        with self._lock:
            if len(self._running) >= self.limit:
                raise UserError(f"the server is running {len(self._running)} heavy job"
                                f"{'s' if len(self._running) > 1 else ''} (calibration, training, export), the most "
                                f"it runs at once (SCDVIZ_MAX_JOBS); try again in a minute")
            mine = [j for j in self._running if j.visitor == visitor]
            if len(mine) >= self.per_visitor:
                raise UserError(f"you already run {len(mine)} heavy job{'s' if len(mine) > 1 else ''} "
                                f"({', '.join(j.what for j in mine)}); wait for it to end or stop it "
                                f"(SCDVIZ_MAX_VISITOR_JOBS = {self.per_visitor})")
            made = self._made[visitor]
            now = time.monotonic()
            while made and now - made[0] > self.window_s:
                made.popleft()
            if makes_run and settings.hosted() and len(made) >= self.runs:
                raise UserError(f"this hosted demo lets one visitor make {self.runs} runs (calibrations, policies) "
                                f"per {self.window_s / 3600:g} h and you made {len(made)}; reloading the page does "
                                "not reset this")
            job = Job(visitor, owner, what, made_at=now if makes_run else None)
            self._running.append(job)
            if makes_run:
                made.append(now)
            self.peak = max(self.peak, len(self._running))
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
            if used + nbytes > self.quota:
                raise UserError(f"this server writes at most {self.quota / 2**20:g} MB of files per visitor every "
                                f"{self.window_s / 3600:g} h (SCDVIZ_VISITOR_MB) and yours reached "
                                f"{used / 2**20:.1f} MB; try later")
            spent.append((now, nbytes))

    def finish(self, job: Job, made_run: bool = True) -> None:
        """The job's thread ended: free its place; ``made_run=False``: it made no run after all (its name was
        refused), so it does not count as one."""
        with self._lock:
            if job in self._running:
                self._running.remove(job)
            if not made_run and job.made_at is not None and job.made_at in self._made[job.visitor]:
                self._made[job.visitor].remove(job.made_at)
            log.info("heavy job ended: %s%s (running %d)", job.what, " (cancelled)" if job.stop.is_set() else "",
                     len(self._running))

    def cancel(self, owner: str, what: str | None = None) -> int:
        """Cancel the jobs of one session folder (all, or those doing ``what``); returns how many."""
        with self._lock:
            found = [j for j in self._running if j.owner == owner and what in (None, j.what)]
        for job in found:
            job.stop.set()
        return len(found)

    def running(self) -> int:
        """Jobs running now."""
        with self._lock:
            return len(self._running)

    def follow(self, job: Job, work: Callable[[Callable], object], discard: Callable[[], None] | None = None
               ) -> Iterator:
        """Run ``work(job.report)`` in a thread and yield ``job.step`` (a ``Step``) about every second while it runs,
        then its result; a cancelled job ends in UserError after ``discard()`` removed what it wrote.
        Every resume of this generator tells the job it is still followed."""
        state: dict = {}

        def thread_main():
            try:
                state["result"] = work(job.report)
            except BaseException as err:  # noqa: BLE001 - handed to the follower below
                state["error"] = err
            finally:
                if job.stop.is_set() and discard is not None:
                    discard()
                self.finish(job)

        thread = threading.Thread(target=thread_main, name=f"job-{job.what}", daemon=True)
        try:
            thread.start()
        except BaseException:
            self.finish(job)
            raise
        try:
            while thread.is_alive():
                job.beat = time.monotonic()
                thread.join(BEAT_S)
                if thread.is_alive():
                    yield job.step
        except GeneratorExit:  # the follower closed this generator: gradio cancelled the event
            job.stop.set()
            raise
        if isinstance(state.get("error"), Stopped) or (job.stop.is_set() and "error" in state):
            raise UserError(f"{job.what} stopped; what it had written is removed")
        if "error" in state:
            raise state["error"]
        yield state["result"]

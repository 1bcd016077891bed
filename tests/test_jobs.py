"""The server's heavy jobs: limits a reload does not reset, and cancellation that stops the work and
removes what it wrote (scdviz.app.jobs)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from scdviz import progress
from scdviz.app import jobs as J
from scdviz.app.session import Session
from scdviz.errors import UserError
from scdviz.progress import STOP_FILE, Done, Failed, Stopped, steps, stream


def _work(started: threading.Event, n: int = 10_000, pause: float = 0.01):
    """Work of ``n`` reported steps; sets ``started`` at its first."""
    def work(report):
        for _ in steps(range(n), "counting", report):
            started.set()
            time.sleep(pause)
        return "finished"
    return work


def test_server_and_visitor_limits_refuse_by_name():
    jobs = J.Jobs(limit=2, per_visitor=1, runs=10, window_s=60)
    a = jobs.start("1.1.1.1", "s1", "train")
    with pytest.raises(UserError, match="you already run 1 heavy job .train."):
        jobs.start("1.1.1.1", "s2", "calibrate")  # a reload: another session, the same visitor
    b = jobs.start("2.2.2.2", "s3", "calibrate")
    with pytest.raises(UserError, match="the server is running 2 heavy jobs"):
        jobs.start("3.3.3.3", "s4", "fit")
    jobs.finish(jobs.start("3.3.3.3", "s4", "export"))  # an export is no heavy job: it has its own places
    jobs.finish(a)
    assert jobs.running() == 1 and jobs.peak == 2
    jobs.finish(b)
    assert jobs.running() == 0


def test_runs_per_visitor_survive_a_reload(monkeypatch):
    """Runs count per session (page) and, all sessions of an address together, up to SCDVIZ_MAX_ADDRESS_RUNS:
    a reload gives a new session but not a new address."""
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    jobs = J.Jobs(limit=4, per_visitor=1, runs=2, window_s=3600, per_address=2)
    for session_id in ("first-page", "reloaded-page"):
        jobs.finish(jobs.start("9.9.9.9", session_id, "train", makes_run=True))
    with pytest.raises(UserError, match="reloading the page does not reset this"):
        jobs.start("9.9.9.9", "third-page", "calibrate", makes_run=True)
    jobs.finish(jobs.start("9.9.9.9", "third-page", "export"))  # no run: not counted
    jobs.finish(jobs.start("8.8.8.8", "other", "train", makes_run=True))  # another visitor is unaffected


def test_visitor_is_the_client_unless_a_proxy_is_trusted(monkeypatch):
    req = SimpleNamespace(headers={"x-forwarded-for": "5.6.7.8, 10.0.0.2"}, client=SimpleNamespace(host="10.0.0.1"))
    monkeypatch.delenv("SCDVIZ_TRUST_PROXY", raising=False)
    assert J.visitor_of(req) == "10.0.0.1"  # a client cannot name itself
    monkeypatch.setenv("SCDVIZ_TRUST_PROXY", "1")
    assert J.visitor_of(req) == "10.0.0.2"  # the entry the proxy appended; the left-most is the client's to write
    assert J.visitor_of(None) == "local"


def test_follow_yields_steps_then_the_result():
    jobs = J.Jobs(limit=1, per_visitor=1, runs=1, window_s=1)
    job = jobs.start("v", "s", "calibrate")
    out = list(jobs.follow(job, stream(_work(threading.Event(), n=150, pause=0.01))))
    assert out[-1] == "finished"
    assert all(isinstance(x, J.Step) and x.desc == "counting" and 0 <= x.done <= 150 for x in out[:-1])
    assert len(out) >= 2 and jobs.running() == 0


def test_cancel_stops_the_work_and_removes_its_run(monkeypatch, tmp_path):
    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path))
    sess = Session()
    folder = sess.new_run("doomed", "policies")
    jobs = J.Jobs(limit=1, per_visitor=1, runs=5, window_s=60)
    job = jobs.start("v", sess.id, "train", makes_run=True)
    started, written = threading.Event(), []

    def work(report):
        for i in steps(range(100_000), "writing", report):
            started.set()
            (folder / f"step{i}.txt").write_text("x")
            written.append(i)
            time.sleep(0.005)

    job.folder = folder
    gen = jobs.follow(job, stream(work, folder), discard=lambda: sess.discard_run(folder))
    assert isinstance(next(gen), J.Step)
    assert started.wait(5)
    assert jobs.cancel(sess.id, "train") == 1
    with pytest.raises(UserError, match="train stopped; what it had written is removed"):
        list(gen)
    n = len(written)
    time.sleep(0.1)
    assert len(written) == n < 100_000  # the work ended
    assert not folder.exists() and folder not in sess.runs and jobs.running() == 0


def test_an_abandoned_job_stops_by_itself(monkeypatch, tmp_path):
    """gradio cancelled the event: nobody resumes the follower, so the work stops within the liveness time, told
    through the stop file in its folder (as a ZeroGPU worker would be), and its place and files go."""
    monkeypatch.setattr(J, "LIVENESS_S", 0.3)
    monkeypatch.setattr(J, "BEAT_S", 0.05)
    monkeypatch.setattr(progress, "BEAT_S", 0.05)
    jobs = J.Jobs(limit=1, per_visitor=1, runs=1, window_s=1)
    job = jobs.start("v", "s", "train")
    job.folder = tmp_path / "run"
    job.folder.mkdir()
    started, discarded = threading.Event(), threading.Event()
    work = stream(_work(started, pause=0.01), job.folder)
    gen = jobs.follow(job, work, discard=discarded.set)
    next(gen)  # followed once, then never again
    assert discarded.wait(5) and job.stop.is_set() and (job.folder / STOP_FILE).exists()
    deadline = time.time() + 5
    while jobs.running() and time.time() < deadline:
        time.sleep(0.02)
    assert jobs.running() == 0
    leftover = list(work)  # the work, told by the file alone, ended at its next step and removed its folder
    assert leftover[-1] == Failed("stopped; what it had written is removed") and not job.folder.exists()


def test_a_follower_waiting_on_a_slow_step_is_not_abandoned(monkeypatch):
    """Liveness counts only while the follower holds a step and is not resumed: a follower waiting inside the
    work (a slow first step on a loaded host) still follows it, however long that wait."""
    monkeypatch.setattr(J, "LIVENESS_S", 0.1)
    monkeypatch.setattr(J, "BEAT_S", 0.02)
    monkeypatch.setattr(progress, "BEAT_S", 0.6)  # the work's first step comes after six liveness times
    jobs = J.Jobs(limit=1, per_visitor=1, runs=1, window_s=1)
    job = jobs.start("v", "s", "calibrate")
    out = list(jobs.follow(job, stream(_work(threading.Event(), n=40, pause=0.02))))
    assert out[-1] == "finished" and not job.stop.is_set() and jobs.running() == 0


def test_stream_yields_steps_then_the_result_or_the_refusal_and_stops_when_closed(tmp_path):
    got = list(stream(_work(threading.Event(), n=120, pause=0.01)))
    assert got[-1] == Done("finished") and all(isinstance(x, J.Step) for x in got[:-1]) and len(got) >= 2

    def refuses(report):
        raise ValueError("a specific message")
    assert list(stream(refuses)) == [Failed("a specific message")]  # a user's mistake crosses as a value

    def breaks(report):
        raise KeyError("bug")
    with pytest.raises(KeyError):
        list(stream(breaks))
    folder = tmp_path / "run"
    folder.mkdir()
    started = threading.Event()
    gen = stream(_work(started), folder)
    next(gen)
    assert started.wait(5)
    gen.close()  # the follower went: the work stops at its next step, and its folder goes
    assert not folder.exists()


def test_closing_the_follower_stops_the_work():
    jobs = J.Jobs(limit=1, per_visitor=1, runs=1, window_s=1)
    job = jobs.start("v", "s", "calibrate")
    discarded = threading.Event()
    gen = jobs.follow(job, stream(_work(threading.Event())), discard=discarded.set)
    next(gen)
    gen.close()  # what gradio does to a cancelled generator
    assert discarded.wait(5) and job.stop.is_set()


def test_a_reporter_that_raises_stops_a_plain_loop():
    def report(desc, done, total):
        if done == 3:
            raise Stopped("enough")
    seen = []
    with pytest.raises(Stopped):
        for i in steps(range(10), "x", report):
            seen.append(i)
    assert seen == [0, 1, 2]


def test_a_refused_run_name_does_not_count_as_a_run(monkeypatch):
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    jobs = J.Jobs(limit=4, per_visitor=1, runs=1, window_s=3600)
    for _ in range(3):  # three bad names in a row
        jobs.finish(jobs.start("7.7.7.7", "s", "train", makes_run=True), made_run=False)
    jobs.finish(jobs.start("7.7.7.7", "s", "train", makes_run=True))  # the one real run
    with pytest.raises(UserError, match="make 1 runs"):
        jobs.start("7.7.7.7", "s", "train", makes_run=True)

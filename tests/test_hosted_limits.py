"""Hosted limits that are fair and cannot be forged (issue 59, item 4): uploads are charged to their visitor
and capped, a client-written X-Forwarded-For names nobody, runs are counted per session under a per-address
ceiling, and a figure export is not a heavy job (scdviz.app.uploads, scdviz.app.jobs, docs/hosting.md).

The upload tests run the real app (``webapp.build_demo`` served by ``webapp.serve``, as ``main`` does) on a
loopback port, in hosted mode."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from scdviz import settings
from scdviz.app import jobs as J
from scdviz.app.session import Session
from scdviz.errors import UserError

MB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The hosted app on a loopback port, launched as ``main`` launches it; yields its URL, its Jobs and its
    upload folder."""
    from scdviz.app import webapp

    work = tmp_path_factory.mktemp("hosted-limits")
    mp = pytest.MonkeyPatch()
    for name, value in {"SCDVIZ_HOSTED": "1", "SCDVIZ_WORK": str(work), "GRADIO_TEMP_DIR": str(work / "gradio"),
                        "GRADIO_ANALYTICS_ENABLED": "False", "SCDVIZ_VISITOR_MB": "100"}.items():
        mp.setenv(name, value)
    for name in ("SCDVIZ_TRUST_PROXY", "SCDVIZ_VISITOR_UPLOADS", "SCDVIZ_PROXY_HOPS", "SCDVIZ_SESSION_TTL"):
        mp.delenv(name, raising=False)
    mp.setenv("FORWARDED_ALLOW_IPS", "unset")  # recorded as absent, so undo() removes what serve() sets
    mp.delenv("FORWARDED_ALLOW_IPS")
    demo = webapp.build_demo()
    jobs = demo.scdviz_jobs
    port = _free_port()
    try:
        webapp.serve(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}/", port=port, jobs=jobs, uploads=work / "gradio")
    finally:
        demo.close()
        mp.undo()


def _upload(url: str, data: bytes, name: str = "record.json", headers=None):
    import httpx

    return httpx.post(f"{url}gradio_api/upload", files={"files": (name, data, "application/json")},
                      headers=headers or {}, timeout=60)


def _answers(url: str) -> bool:
    import httpx

    return httpx.get(f"{url}config", timeout=30).status_code == 200


def _error(response) -> str:
    """The guard's refusal: one line of JSON with an error."""
    assert response.headers["content-type"] == "application/json"
    assert "\n" not in response.text
    return json.loads(response.text)["error"]


def test_25_uploads_of_7_mb_from_one_client_stop_at_the_quota_and_a_forged_header_does_not_help(server):
    """Without a trusted proxy a client's X-Forwarded-For names nobody, not even through uvicorn (which by
    default believes it from loopback): 25 uploads of 7 MB, each naming a new address, are one visitor's, and
    those past SCDVIZ_VISITOR_MB (100 MB: 14 of them) are refused before their bodies are stored."""
    before = _files(server.uploads)
    codes, errors = [], []
    for i in range(25):
        r = _upload(server.url, bytes([i]) * (7 * MB), f"r{i}.json", {"X-Forwarded-For": f"203.0.113.{i}"})
        codes.append(r.status_code)
        if r.status_code != 200:
            errors.append(_error(r))
    assert codes == [200] * 14 + [429] * 11, codes
    assert all("SCDVIZ_VISITOR_MB" in e and "upload refused" in e for e in errors), errors[:2]
    stored = {p: n for p, n in _files(server.uploads).items() if p not in before}
    assert len([n for n in stored.values() if n == 7 * MB]) == 14
    assert sum(stored.values()) <= 100 * MB
    assert server.jobs.used("127.0.0.1") <= 100 * MB  # the server's own ledger, shared with exports
    assert _answers(server.url)


def test_the_right_most_forwarded_entry_names_the_visitor_and_the_left_most_is_ignored(server, monkeypatch):
    """Behind a trusted proxy the visitor is the entry the proxy appended (right-most, across header lines):
    a client that writes a new left-most address every time gets no fresh allowance; another proxied visitor
    does."""
    import httpx

    monkeypatch.setenv("SCDVIZ_TRUST_PROXY", "1")
    monkeypatch.setenv("SCDVIZ_VISITOR_UPLOADS", "3")
    small = b'{"rows": []}'
    codes = [_upload(server.url, small, headers={"X-Forwarded-For": f"198.51.100.{i}, 10.20.0.1"}).status_code
             for i in range(3)]
    assert codes == [200, 200, 200]
    forged = _upload(server.url, small, headers={"X-Forwarded-For": "198.51.100.99, 10.20.0.1"})
    assert forged.status_code == 429 and "SCDVIZ_VISITOR_UPLOADS" in _error(forged)
    assert int(forged.headers["retry-after"]) > 0
    # the client's own header line first, the proxy's appended as a second line: still the proxy's entry
    two_lines = httpx.post(f"{server.url}gradio_api/upload", files={"files": ("r.json", small)}, timeout=60,
                           headers=[("X-Forwarded-For", "198.51.100.7"), ("X-Forwarded-For", "10.20.0.1")])
    assert two_lines.status_code == 429
    assert _upload(server.url, small, headers={"X-Forwarded-For": "10.20.0.1, 10.20.0.2"}).status_code == 200
    assert _upload(server.url, small, headers={"X-Forwarded-For": "10.20.0.2"}).status_code == 200


def test_a_streamed_body_is_cut_at_the_quota_it_shares_with_exports_and_leaves_no_file(server, monkeypatch):
    """A body without Content-Length is counted as it streams: it ends at the chunk that passes the visitor's
    quota, already mostly spent on files the app handed it (``Jobs.charge``), and its partial file is deleted."""
    import httpx

    monkeypatch.setenv("SCDVIZ_TRUST_PROXY", "1")
    visitor = "10.30.0.1"
    server.jobs.charge(visitor, 95 * MB)  # e.g. figure exports and CSV files
    before = _files(server.uploads)
    boundary = "scdvizboundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="streamed.json"\r\n'
            "Content-Type: application/json\r\n\r\n").encode()

    def body():  # 6 MB in 64 KB chunks: a generator body goes chunked, with no Content-Length
        yield head
        for _ in range(96):
            yield b"s" * (64 * 2**10)
        yield f"\r\n--{boundary}--\r\n".encode()

    r = httpx.post(f"{server.url}gradio_api/upload", content=body(), timeout=60,
                   headers={"Content-Type": f"multipart/form-data; boundary={boundary}", "X-Forwarded-For": visitor})
    assert r.status_code == 429 and "SCDVIZ_VISITOR_MB" in _error(r)
    deadline = time.monotonic() + 10  # the server removes the partial file as the cut request unwinds
    while _files(server.uploads) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _files(server.uploads) == before  # neither the upload nor a partial temporary file stayed
    assert server.jobs.used(visitor) <= 100 * MB
    # the same body from a visitor with room is stored whole: the cut above was the quota's
    fresh = httpx.post(f"{server.url}gradio_api/upload", content=body(), timeout=60,
                       headers={"Content-Type": f"multipart/form-data; boundary={boundary}",
                                "X-Forwarded-For": "10.30.0.2"})
    assert fresh.status_code == 200 and Path(fresh.json()[0]).stat().st_size == 96 * 64 * 2**10
    assert _answers(server.url)


def test_a_body_declared_larger_than_the_quota_is_refused_before_it_is_sent(server, monkeypatch):
    monkeypatch.setenv("SCDVIZ_TRUST_PROXY", "1")
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(b"POST /gradio_api/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Forwarded-For: 10.30.0.9\r\n"
                  b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 209715200\r\n\r\n")
        reply = b""
        while b"}" not in reply:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert "200.0 MB is more than the 100 MB" in json.loads(body)["error"]
    assert _answers(server.url)


def test_two_sessions_from_one_address_each_get_their_runs_up_to_the_address_ceiling(monkeypatch):
    monkeypatch.setenv("SCDVIZ_HOSTED", "1")
    jobs = J.Jobs(limit=4, per_visitor=1, runs=2, per_address=3, window_s=3600)
    lab = "10.50.0.1"
    for _ in range(2):
        jobs.finish(jobs.start(lab, "alice-page", "train", makes_run=True))
    with pytest.raises(UserError, match="one session make 2 runs .*SCDVIZ_MAX_SESSION_RUNS"):
        jobs.start(lab, "alice-page", "calibrate", makes_run=True)
    jobs.finish(jobs.start(lab, "bob-page", "calibrate", makes_run=True))  # bob, same address: his own runs
    with pytest.raises(UserError, match="SCDVIZ_MAX_ADDRESS_RUNS.*reloading the page does not reset this"):
        jobs.start(lab, "bob-page", "train", makes_run=True)  # the address's ceiling (3), not bob's (2)
    with pytest.raises(UserError, match="SCDVIZ_MAX_ADDRESS_RUNS"):
        jobs.start(lab, "reloaded-page", "train", makes_run=True)  # a reload does not pass the ceiling
    jobs.finish(jobs.start(lab, "reloaded-page", "export"))  # makes no run: not counted
    jobs.finish(jobs.start("10.50.0.2", "carol-page", "train", makes_run=True))  # another address is unaffected
    job = jobs.start("10.50.0.3", "dave-page", "train", makes_run=True)
    jobs.finish(job, made_run=False)  # a refused run name gives its place back to the session and the address
    for _ in range(2):
        jobs.finish(jobs.start("10.50.0.3", "dave-page", "train", makes_run=True))
    defaults = J.Jobs()
    assert defaults.per_address == settings.max_address_runs() > defaults.runs == settings.max_session_runs()


def test_an_export_succeeds_while_the_heavy_job_slots_are_full_and_blocks_none(monkeypatch, tmp_path):
    import plotly.graph_objects as go

    from scdviz.app import webapp

    monkeypatch.setenv("SCDVIZ_WORK", str(tmp_path))
    jobs = J.Jobs(limit=2, per_visitor=1, runs=10, window_s=3600, exports=1)
    training = [jobs.start("10.60.0.1", "s1", "train"), jobs.start("10.60.0.2", "s2", "calibrate")]
    with pytest.raises(UserError, match="SCDVIZ_MAX_JOBS"):
        jobs.start("10.60.0.3", "s3", "fit")  # the heavy slots are full
    http = SimpleNamespace(headers={}, client=SimpleNamespace(host="10.60.0.3"), session_hash=None)
    figs = {"curve": go.Figure(go.Scatter(x=[0, 1, 2], y=[1, 3, 2]))}
    paths = webapp.export_figures(jobs, figs, Session(), "scd", http)
    assert paths and all(Path(p).is_file() for p in paths)
    assert jobs.used("10.60.0.3") == sum(Path(p).stat().st_size for p in paths) > 0  # still charged
    assert jobs.running() == 2
    # an export in progress keeps no training from starting, and exports have their own small limit
    export = jobs.start("10.60.0.4", "s4", "export")
    jobs.finish(training.pop())
    training.append(jobs.start("10.60.0.5", "s5", "distil"))
    with pytest.raises(UserError, match="SCDVIZ_MAX_EXPORTS"):
        webapp.export_figures(jobs, figs, Session(), "scd", http)
    jobs.finish(export)
    assert webapp.export_figures(jobs, figs, Session(), "evict", http)
    for job in training:
        jobs.finish(job)
    assert jobs.running() == 0


def test_visitor_of_takes_the_proxys_entry_without_its_port(monkeypatch):
    from starlette.datastructures import Headers

    req = SimpleNamespace(headers={"x-forwarded-for": "5.6.7.8, 10.0.0.1"}, client=SimpleNamespace(host="10.0.0.9"))
    monkeypatch.delenv("SCDVIZ_TRUST_PROXY", raising=False)
    assert J.visitor_of(req) == "10.0.0.9"
    monkeypatch.setenv("SCDVIZ_TRUST_PROXY", "1")
    monkeypatch.delenv("SCDVIZ_PROXY_HOPS", raising=False)
    assert J.visitor_of(req) == "10.0.0.1"
    lines = Headers(raw=[(b"x-forwarded-for", b"6.6.6.6"), (b"x-forwarded-for", b"10.0.0.2:41000")])
    assert J.visitor_of(SimpleNamespace(headers=lines, client=None)) == "10.0.0.2"
    monkeypatch.setenv("SCDVIZ_PROXY_HOPS", "2")  # a CDN, then the Space's proxy: the CDN's entry
    chain = {"x-forwarded-for": "6.6.6.6, [2001:db8::1]:443, 10.0.0.3"}
    assert J.visitor_of(SimpleNamespace(headers=chain, client=None)) == "2001:db8::1"

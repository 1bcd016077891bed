"""Hosted mode's guard on gradio's upload route (``POST /gradio_api/upload``), an ASGI middleware.

gradio takes uploads from anyone, with no session, and keeps them in its cache until its hourly sweep.
In hosted mode (``SCDVIZ_HOSTED=1``) ``UploadGuard`` charges every upload request to its visitor
(``scdviz.app.jobs.visitor_of``: the client's address, or the entry a trusted proxy appended):

* at most ``SCDVIZ_VISITOR_UPLOADS`` upload requests per ``SCDVIZ_SESSION_TTL`` seconds (HTTP 429 past it);
* their bytes count toward the same ``SCDVIZ_VISITOR_MB`` per ``SCDVIZ_SESSION_TTL`` as the files the app
  hands the visitor (``Jobs.charge``): a body declared larger than the whole quota is refused with HTTP
  413, one past what is left of it with HTTP 429. The declared ``Content-Length`` is charged before a
  byte is read; a body without one (chunked) is charged as it streams, and the request ends at the chunk
  that passes the quota, before the parser stores it: gradio's parser is handed an error it treats as its
  own size limit's, so it deletes the partial files.

Every refusal is one line of JSON, ``{"error": "..."}``. A refused body of up to ``DRAIN_BYTES`` is read
and dropped before the answer (a client that sends its whole body before reading sees the answer rather
than a reset connection); a client that asked ``Expect: 100-continue`` is answered without sending it.
Every upload request counts, accepted or not. Outside hosted mode the guard passes everything through.
``webapp.launch_kwargs`` installs it. This module imports neither torch nor gradio.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time

from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException
from starlette.requests import HTTPConnection

from scdviz import settings
from scdviz.app.jobs import Jobs, visitor_of
from scdviz.errors import UserError

log = logging.getLogger("scdviz.uploads")

UPLOAD_PATH = "/gradio_api/upload"
DRAIN_BYTES = 32 * 2**20  # a refused body up to this size is read and dropped before the answer
CHARGE_STEP = 256 * 2**10  # a streamed body is charged every this many bytes (and at its end)


class OverQuota(MultiPartException):
    """Raised from ``receive`` when a streamed body passes the visitor's quota. gradio's multipart parser
    deletes the files it was writing on any ``MultiPartException`` (and answers 413 for a message naming
    the "maximum allowed size"); the guard replaces that answer with its own."""

    def __init__(self, status: int, text: str):
        super().__init__(f"{text} (the visitor's maximum allowed size)")
        self.status, self.text = status, text


class UploadGuard:
    """ASGI middleware: charges ``POST /gradio_api/upload`` to its visitor in hosted mode (module docstring).
    ``jobs``: the server's ``Jobs``, whose byte quota uploads share (``build_demo``'s, ``demo.scdviz_jobs``; without
    it a ``Jobs`` of the guard's own)."""

    def __init__(self, app, jobs: Jobs | None = None):
        self.app = app
        self.jobs = jobs or Jobs()
        self._lock = threading.Lock()
        self._sent: dict[str, collections.deque] = {}  # visitor -> times of its upload requests

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope.get("method") != "POST" or not settings.hosted()
                or not str(scope.get("path", "")).endswith(UPLOAD_PATH)):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        visitor = visitor_of(HTTPConnection(scope))
        length = _length(headers)
        refused = self._admit(visitor, length)
        if refused is not None:
            if "100-continue" not in headers.get("expect", "").lower():
                await _drain(receive, length)
            await _answer(send, *refused)
            return
        state = {"charged": length or 0, "received": 0, "refused": None, "started": False}

        async def guarded_receive():
            message = await receive()
            if message["type"] == "http.request" and state["refused"] is None:
                state["received"] += len(message.get("body", b""))
                extra = state["received"] - state["charged"]
                if extra > 0 and (extra >= CHARGE_STEP or not message.get("more_body", False)):
                    refused = self._charge(visitor, extra, state["received"])
                    if refused is not None:
                        state["refused"] = refused
                        raise OverQuota(refused[0], refused[1])
                    state["charged"] = state["received"]
            return message

        async def guarded_send(message):
            if state["refused"] is not None and not state["started"]:
                return  # the app's own answer to the cut-off body: ours replaces it
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if state["refused"] is None or state["started"]:
                raise
        if state["refused"] is not None and not state["started"]:
            await _drain(receive, None, already=state["received"])
            await _answer(send, *state["refused"])

    def _admit(self, visitor: str, length: int | None) -> tuple | None:
        """Count one upload request of ``visitor`` and charge its declared ``length``; the refusal
        (status, message, retry-after seconds or None) instead, counting and charging nothing."""
        now, most, window = time.monotonic(), settings.visitor_uploads(), self.jobs.window_s
        with self._lock:
            for key in [k for k, q in self._sent.items() if not q or now - q[-1] > window]:
                del self._sent[key]  # visitors with nothing left in the window
            sent = self._sent.setdefault(visitor, collections.deque())
            while sent and now - sent[0] > window:
                sent.popleft()
            if len(sent) >= most:
                wait = int(window - (now - sent[0])) + 1
                log.info("upload refused: %d uploads in the window (SCDVIZ_VISITOR_UPLOADS)", len(sent))
                return (429, f"upload refused: this hosted demo takes {most} uploads per visitor every "
                             f"{window / 3600:g} h (SCDVIZ_VISITOR_UPLOADS) and you sent {len(sent)}; try again in "
                             f"{max(1, round(wait / 60))} min", wait)
            sent.append(now)
        refused = self._charge(visitor, length, length) if length else None
        if refused is not None:
            with self._lock:
                if now in sent:
                    sent.remove(now)
        return refused

    def _charge(self, visitor: str, nbytes: int, body: int) -> tuple | None:
        """Charge ``nbytes`` more of an upload whose body is ``body`` bytes (so far) to ``visitor``; the refusal
        (status, message, None) if that passes its quota."""
        try:
            self.jobs.charge(visitor, nbytes)
            return None
        except UserError as err:
            quota = self.jobs.quota
            log.info("upload of %.1f MB refused: past the visitor's SCDVIZ_VISITOR_MB", body / 2**20)
            if body > quota:
                return (413, f"upload refused: {body / 2**20:.1f} MB is more than the {quota / 2**20:g} MB of files "
                             f"this hosted demo takes from one visitor every {self.jobs.window_s / 3600:g} h "
                             "(SCDVIZ_VISITOR_MB)", None)
            return 429, f"upload refused: {err}", None


def _length(headers: Headers) -> int | None:
    """The declared body size (Content-Length), or None (chunked, or not a number)."""
    try:
        value = int(headers.get("content-length", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


async def _drain(receive, length: int | None, already: int = 0) -> None:
    """Read and drop the rest of a refused body, up to ``DRAIN_BYTES`` in all (nothing if it declared more)."""
    if length is not None and length > DRAIN_BYTES:
        return
    read = already
    while read <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _answer(send, status: int, text: str, retry_after: int | None) -> None:
    """A one-line JSON refusal."""
    body = json.dumps({"error": text}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

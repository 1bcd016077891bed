"""The hosted app's memory and latency over a mixed load (issue 59): does the server's memory return to a
bounded baseline after work, and does any request hold a worker for long?

    python -m research.hosted_load [--requests 200] [--seed 0]
    python -m research.hosted_load --heavy

Starts the real app (``python app.py``, ``SCDVIZ_HOSTED=1``, the built-in pair on the CPU, a fresh work folder),
loads builtin:smollm2-135m -> builtin:jargon from one gradio_client visitor, then sends ``--requests`` requests
drawn at random from the tabs' kinds (generate, SCD transfer, eviction with the focused methods, figure export),
each with a random shipped evaluation window (the per-visitor file quota lifted: the exports alone would pass
it). The server's resident memory (VmRSS of its process, read from /proc) is taken after the first request of
each kind (the baseline: every path has run once) and after every request; each request is timed by the client.
Prints the table of both, and the ratio of the final and the largest memory to the baseline. Writes nothing but
the app's temporary work folder (deleted).

``--heavy`` instead sends each heavy job of the Calibrate / train tab once, at hosted mode's caps (the ``hosted=``
of its controls, ``scdviz.app.inputs.Control``), with SCD through the calibration just made, and prints how long
each took and the first line of its answer (or its refusal).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

P, J = "builtin:smollm2-135m", "builtin:jargon"


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _server_pid(port: int) -> int:
    """The app's process: the python app.py listening on ``port`` (our child)."""
    import subprocess

    out = subprocess.run(["pgrep", "-f", "python app.py"], capture_output=True, text=True).stdout.split()
    pids = [int(p) for p in out]
    for pid in pids:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        if f"GRADIO_SERVER_PORT={port}".encode() in env:
            return pid
    raise RuntimeError(f"no app process on port {port}")


def _texts(n: int) -> list[str]:
    from transformers import AutoTokenizer

    from scdviz import data
    from scdviz.models import builtin

    tok = AutoTokenizer.from_pretrained(builtin.producer_dir())
    out = []
    for corpus in data.corpora():
        out += [tok.decode(w) for w in data.token_windows(tok, data.load_split(corpus, "eval"), 200, n, spread=True)]
    return out


def run_load(requests: int, seed: int = 0) -> dict:
    """Start the hosted app, load the pair, send ``requests`` mixed requests (module docstring); returns the server's
    RSS after loading (``loaded``), after the first request of each kind (``baseline``) and after each request
    (``rss``), and each kind's request seconds (``seconds``)."""
    from apprunner import running_app
    from gradio_client import Client

    texts = _texts(4)
    rng = random.Random(seed)
    kinds = {
        "generate": lambda c, t: c.predict(t[:300], 8, False, api_name="/generate"),
        "scd": lambda c, t: c.predict(t, 16, 4, "4", 0, 0, 2, "selected", "", 10, 0.5, False, 0, "transform", 0,
                                      api_name="/scd_transfer"),
        "evict": lambda c, t: c.predict(t, "", False, "% kept", 25, "producer", "distilled-scorer", None, 8, 4,
                                        api_name="/evict"),
        "export": lambda c, t: c.predict(False, api_name="/scd_figures"),
    }
    # the per-visitor file quota off: each SCD figure export is ~5 MB (plotly.js inside), and this measures memory
    with tempfile.TemporaryDirectory() as work, running_app(Path(work) / "app.log", SCDVIZ_HOSTED="1",
                                                            SCDVIZ_WORK=str(Path(work) / "w"),
                                                            SCDVIZ_VISITOR_MB="100000") as url:
        pid = _server_pid(int(url.rstrip("/").rsplit(":", 1)[1]))
        client = Client(url, verbose=False)
        client.predict(P, J, api_name="/load_pair")
        out = {"loaded": _rss(pid), "rss": [], "seconds": {k: [] for k in kinds}, "kinds": len(kinds)}
        order = list(kinds) + [rng.choice(list(kinds)) for _ in range(requests - len(kinds))]
        for i, kind in enumerate(order):
            t0 = time.perf_counter()
            kinds[kind](client, rng.choice(texts))
            out["seconds"][kind].append(time.perf_counter() - t0)
            out["rss"].append(_rss(pid))
            if i == len(kinds) - 1:
                out["baseline"] = out["rss"][-1]
    return out


def heavy_caps() -> dict:
    """Each heavy job's request at hosted mode's caps (``hosted=`` on its controls; defaults above a cap lowered
    to it), as the API takes it: {endpoint: positional arguments}."""
    from dataclasses import fields

    from scdviz.app import requests as R

    out = {}
    for api, cls, given in (("/calibrate", R.CalibrateRequest, {"domains": ["jargon"], "name": "heavy-calibration"}),
                            ("/distil", R.DistilRequest, {"name": "heavy-distilled"}),
                            ("/fit", R.FitRequest, {"name": "heavy-scorer"}),
                            ("/train", R.TrainRequest, {"name": "heavy-policy"})):
        args = []
        for f in fields(cls):
            c, value = f.metadata["control"], given.get(f.name, f.default)
            if c.hosted is not None and c.kind in ("int", "number"):
                value = min(value, c.hosted)
            args.append(str(value) if c.kind == "choice" and c.options() and isinstance(c.options()[0], str)
                        and not isinstance(value, str) else value)
        out[api] = tuple(args)
    return out


def run_heavy() -> dict:
    """Start the hosted app, load the pair, run each heavy job once at hosted mode's caps (calibrate, then SCD with
    that calibration, its correction stage trained, the distilled scorer fitted, a DistillCache policy trained);
    returns {what: (seconds, the first line of its answer, or its refusal)}."""
    from apprunner import running_app
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    text = _texts(1)[0]
    out = {}
    with tempfile.TemporaryDirectory() as work, running_app(Path(work) / "app.log", SCDVIZ_HOSTED="1",
                                                            SCDVIZ_WORK=str(Path(work) / "w")) as url:
        client = Client(url, verbose=False)
        client.predict(P, J, api_name="/load_pair")
        jobs = list(heavy_caps().items())
        jobs.insert(1, ("/scd_transfer", (text, 16, 4, "4", 0, 0, 2, "selected", "", 10, 0.5, False, 0, "transform",
                                          0)))
        for api, args in jobs:
            t0 = time.perf_counter()
            try:
                answer = client.predict(*args, api_name=api)
                first = str(answer[0] if isinstance(answer, (list, tuple)) else answer).strip().splitlines()[0]
            except AppError as err:  # a refusal (hosted mode's rules) is an answer too
                first = f"refused: {err}"
            out[api] = (time.perf_counter() - t0, first[:90])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heavy", action="store_true", help="instead: each heavy job once at hosted mode's caps, timed")
    args = ap.parse_args()
    if args.heavy:
        out = run_heavy()
        print(f"\nhosted app, heavy jobs at hosted mode's caps ({os.cpu_count()} cores, load "
              f"{os.getloadavg()[0]:.1f})")
        print("| request | seconds | answer |")
        print("|---|---|---|")
        for api, (seconds, first) in out.items():
            print(f"| {api} | {seconds:.1f} | {first.replace('|', '/')} |")
        return
    out = run_load(args.requests, args.seed)
    rss, baseline, mb, n = out["rss"], out["baseline"], 2**20, len(out["rss"])
    print(f"\nhosted app, {n} requests ({os.cpu_count()} cores); server RSS after loading the pair "
          f"{out['loaded'] / mb:,.0f} MB, after the first request of each kind {baseline / mb:,.0f} MB")
    print("| requests done | server RSS, MB | over the baseline |")
    print("|---|---|---|")
    for k in sorted({out["kinds"], 25, 50, 100, 150, n} & set(range(1, n + 1))):
        print(f"| {k} | {rss[k - 1] / mb:,.0f} | {rss[k - 1] / baseline:.2f}× |")
    print(f"largest {max(rss) / mb:,.0f} MB ({max(rss) / baseline:.2f}× the baseline), final {rss[-1] / baseline:.2f}×")
    print("\n| kind | requests | median s | slowest s |")
    print("|---|---|---|---|")
    for kind, times in out["seconds"].items():
        times = sorted(times)
        print(f"| {kind} | {len(times)} | {times[len(times) // 2]:.2f} | {times[-1]:.2f} |")


if __name__ == "__main__":
    main()

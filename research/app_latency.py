"""How long a visitor waits in the app, on the pair it opens with: eviction on a 512-token context with the default
set, an SCD transfer, a figure export (the table of docs/hosting.md#how-long-a-visitor-waits).

    python -m research.app_latency [--repeats 3]        # SCDVIZ_THREADS fixes the thread count

Each request is what the tab's button sends with its defaults, its figures drawn (the eviction tab's
focused set, the SCD tab's plan with the consumer's question asked, and once more without it), run
through the same functions the handlers call, in-process on the app's default pair (SCDVIZ_PRODUCER,
SCDVIZ_CONSUMER; the SCD window is from the dev slice of the corpus the consumer was fine-tuned on, else
jargon): one warm-up, then ``--repeats`` timed runs, the median and the range printed. The eviction
phases are timed from its own progress reports. Run it on an otherwise idle machine; it prints a table, writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from scdviz import data, settings
from scdviz.app import evict, results, scd
from scdviz.app.requests import EvictRequest, ScdRequest
from scdviz.app.session import Session
from scdviz.models.pair import choose_threads, load_pair, training_log


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    threads = choose_threads()
    pair = load_pair(settings.default_producer(), settings.default_consumer())
    consumer = pair.consumer_source
    corpus = training_log(consumer).get("config", {}).get("corpus") or "jargon"
    tok = pair.tokenizer
    context = tok.decode(data.eval_windows(tok, "austen", "dev", 512, 1)[0].ids)
    window = tok.decode(data.eval_windows(tok, corpus, "dev", 288, 1)[0].ids)
    phases: dict[str, float] = {}
    last = {"t": 0.0, "desc": None}

    def report(desc, done, total):  # the time between reports, by phase
        now = time.perf_counter()
        if last["desc"] is not None:
            phases[last["desc"]] = phases.get(last["desc"], 0.0) + now - last["t"]
        last.update(t=now, desc=desc.split(":")[0])

    out = {}

    def evicted():  # what the handler does: the methods, then the figures drawn from their arrays
        got = evict.evict_run(pair, EvictRequest(context), progress=report)
        out["ev"] = {**got, "figures": evict.evict_figures(got["figures"])}

    def transferred(ask: bool = True):
        got = scd.scd_run(pair, ScdRequest(window, ask=ask))
        out["scd"] = {**got, "figures": scd.scd_figures(got["figures"])}

    times = {
        "eviction, 512-token context, default methods": _timed(evicted, args.repeats),
        f"SCD transfer, 288-token {corpus} window, default plan": _timed(transferred, args.repeats),
        "  the same, its question not asked": _timed(lambda: transferred(ask=False), args.repeats),
    }
    session = Session()
    times["figure export of the SCD tab (one HTML page)"] = _timed(
        lambda: results.export_figures(out["scd"]["figures"], session, "scd"), args.repeats)
    print(f"{pair.producer_source} -> {consumer} on {pair.device}, {threads} threads; {args.repeats} timed runs "
          "after one warm-up")
    print(f"{'request':52s} {'median s':>9s} {'min':>6s} {'max':>6s}")
    for name, ts in times.items():
        print(f"{name:52s} {statistics.median(ts):9.1f} {min(ts):6.1f} {max(ts):6.1f}")
    runs = args.repeats + 1
    print("eviction phases (mean s per request):")
    for desc, seconds in phases.items():
        print(f"  {desc:60s} {seconds / runs:6.1f}")
    session.close()


if __name__ == "__main__":
    main()

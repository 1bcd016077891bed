"""Slow tier: Generate, SCD and eviction requests on the built-in pair, from threads at once,
return exactly what each returns when run alone (issue: users broke each other's runs).

Also over HTTP against a hosted app: three visitors at once (Generate, SCD, eviction), then
16 at once (8 cheap requests + 8 real runs, queued), each answer matching its own input.
"""

from __future__ import annotations

import threading
import time

import pytest
from apprunner import running_app

from scdviz import data
from scdviz.app import evict, pairs, scd
from scdviz.app.requests import EvictRequest, GenerateRequest, ScdRequest

pytestmark = pytest.mark.slow

P, J = "builtin:smollm2-135m", "builtin:jargon"


@pytest.fixture(scope="module")
def texts(builtin_pair):
    tok = builtin_pair.tokenizer
    windows = [tok.decode(w) for w in data.token_windows(tok, data.load_split("jargon", "eval"), 112, 4)]
    contexts = [tok.decode(w) for w in data.token_windows(tok, data.load_split("bible", "eval"), 96, 4)]
    prompts = [f"Question {i}: what is the {w} of a hacker?" for i, w in
               enumerate(("favourite tool", "first rule", "oldest joke", "best editor", "strangest word", "kludge",
                          "daemon", "hack"))]
    return {"windows": windows, "contexts": contexts, "prompts": prompts}


def _gen(pair, prompt):
    g = pairs.generate_both(pair, GenerateRequest(prompt, 12))
    return ("gen", g.prompt_tokens, tuple(g.producer_ids), tuple(g.consumer_ids))


def _scd(pair, text):
    out = scd.scd_run(pair, ScdRequest(text, 16, 8, 4, 0, 0, 2, "selected", "", 10, 0.5))
    t = out["table"]
    return ("scd", out["info"].split(" prompt tokens")[0], tuple(t["method"]), tuple(round(x, 4) for x in t["kl"]),
            tuple(tuple(tok) for _, tok in out["texts"]))


def _evict(pair, context):
    out = evict.evict_run(pair, EvictRequest(context, "", False, "% kept", 25, "producer", "DistillCache-per-head",
                                             FEW))
    return ("evict", tuple(tok for tok, _ in out["kept"]), tuple(round(x, 3) for _, x in out["kept"]),
            tuple(round(x, 4) for x in out["table"]["kl"]), tuple(tuple(r) for r in out["texts"]))


def test_concurrent_service_requests_equal_solo_runs(builtin_pair, texts):
    jobs = [(_gen, p) for p in texts["prompts"][:3]] + [(_scd, w) for w in texts["windows"][:2]] + \
           [(_evict, c) for c in texts["contexts"][:2]]
    solo = [fn(builtin_pair, arg) for fn, arg in jobs]
    got: list = [None] * len(jobs)
    errors: list[str] = []
    barrier = threading.Barrier(len(jobs))

    def work(i, fn, arg):
        barrier.wait()
        try:
            got[i] = fn(builtin_pair, arg)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(f"{fn.__name__}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=work, args=(i, fn, arg)) for i, (fn, arg) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    for i, (fn, _) in enumerate(jobs):
        assert got[i] == solo[i], f"{fn.__name__} #{i} differs when run beside other requests"
    # the shared models were left as they were: no eager switch, no hooks, no extra attributes
    for model in (builtin_pair.producer, builtin_pair.consumer):
        assert model.config._attn_implementation != "eager"
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ----------------------------------------------------------------------------- over HTTP, hosted


def _client(url):
    from gradio_client import Client

    client = Client(url, verbose=False)
    client.predict(P, J, api_name="/load_pair")
    return client


def _http(url, kind, arg):
    """One visitor's request; returns (what the answer says about its input, seconds)."""
    client = _client(url)
    t0 = time.perf_counter()
    if kind == "gen":
        info, prod, cons = client.predict(arg, 12, False, api_name="/generate")
        what = (info.split(" tokens.")[0], "".join(d["token"] for d in cons))
    elif kind == "scd":
        out = client.predict(arg, 16, 8, "4", 0, 0, 2, "selected", "", 10, 0.5, False, api_name="/scd_transfer")
        col = out[1]["headers"].index("method")  # the table as shown: columns in words
        what = (out[0].split(" prompt tokens")[0], tuple(row[col] for row in out[1]["data"]))
    else:
        out = client.predict(arg, "", False, "% kept", 25, "producer", "DistillCache-per-head", FEW, api_name="/evict")
        what = "".join(d["token"] for d in out[1])
    return what, time.perf_counter() - t0


_EXPECTED: dict = {}
FEW = ["DistillCache-per-head", "SnapKV"]  # the eviction methods these visitors compare (H2O runs as well)


def _expected(pair, kind, arg):
    """What a request returns run alone, in-process (each computed once per module)."""
    if (kind, arg) not in _EXPECTED:
        _EXPECTED[(kind, arg)] = _alone(pair, kind, arg)
    return _EXPECTED[(kind, arg)]


def _alone(pair, kind, arg):
    if kind == "gen":
        g = pairs.generate_both(pair, GenerateRequest(arg, 12))
        return (f"Prompt: {g.prompt_tokens}", "".join(pair.tokenizer.decode([i]) for i in g.consumer_ids))
    if kind == "scd":
        out = scd.scd_run(pair, ScdRequest(arg, 16, 8, 4, 0, 0, 2, "selected", "", 10, 0.5))
        return (out["info"].split(" prompt tokens")[0], tuple(out["table"]["method"]))
    out = evict.evict_run(pair, EvictRequest(arg, "", False, "% kept", 25, "producer", "DistillCache-per-head", FEW))
    return "".join(tok for tok, _ in out["kept"])


def _crowd(url, jobs):
    results: list = [None] * len(jobs)

    def work(i, kind, arg):
        try:
            results[i] = _http(url, kind, arg)
        except Exception as err:  # noqa: BLE001 - counted as an error below
            results[i] = (f"ERROR {type(err).__name__}: {err}", 0.0)

    threads = [threading.Thread(target=work, args=(i, k, a)) for i, (k, a) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return results


@pytest.fixture(scope="module")
def hosted_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hosted")
    with running_app(folder / "app.log", SCDVIZ_HOSTED="1", SCDVIZ_WORK=str(folder)) as url:
        yield url


def test_three_visitors_at_once_get_their_own_results(hosted_url, builtin_pair, texts):
    jobs = [("gen", texts["prompts"][0]), ("scd", texts["windows"][0]), ("evict", texts["contexts"][0])]
    results = _crowd(hosted_url, jobs)
    for (kind, arg), (what, _) in zip(jobs, results):
        assert what == _expected(builtin_pair, kind, arg), kind


def test_sixteen_visitors_queued_all_answered_correctly(hosted_url, builtin_pair, texts):
    cheap = [("gen", p) for p in texts["prompts"]]
    real = [("scd", w) for w in texts["windows"]] + [("evict", c) for c in texts["contexts"]]
    jobs = [job for pair_ in zip(cheap, real) for job in pair_]  # interleaved, all started at once
    t0 = time.perf_counter()
    results = _crowd(hosted_url, jobs)
    wall = time.perf_counter() - t0
    errors = [what for what, _ in results if isinstance(what, str) and what.startswith("ERROR")]
    assert not errors, errors
    for (kind, arg), (what, _) in zip(jobs, results):
        assert what == _expected(builtin_pair, kind, arg), kind
    waits = sorted(s for _, s in results)
    print(f"\n16 visitors: 0 errors, wall {wall:.0f} s, answer times median {waits[8]:.0f} s, max {waits[-1]:.0f} s")

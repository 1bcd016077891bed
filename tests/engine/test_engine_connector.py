"""ScdConnector end to end in vLLM engine processes (needs the engine venv: python -m scdviz.serving.setup_engine).

A producer engine (the built-in producer's weights) prefills 8 held-out jargon prompts once each and its connector
writes four payloads per prompt into a shared folder (raw KV; SCD reuse-only codes of the shipped jargon calibration,
int4 at its operating point and transform coded at 3,840 B/token; SCD reuse-only codes of the shipped austen-before
calibration: one prefill, a payload per target specialist); a fresh specialist engine (builtin:jargon merged) runs
each prompt four times, teacher-forced over 32 continuation tokens: its own prefill, and over the prefix its
connector loads from each of its payloads. The engine's KL(own || loaded) and top-1 agreement must be those scdviz
measures outside any engine (scdviz.scd.transfer, as ``bench scd`` does) on the same prompts and plans: KL within
10 %, top-1 within 0.02. Fan-out: a second specialist engine (builtin:austen-before merged) then runs the same prompts
over its own prefill, the same raw payload and its own SCD payload from the same prefills, held to the same bounds.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from scdviz import data, metrics
from scdviz.scd import payload, transfer
from scdviz.scd.calibration import Calibration
from scdviz.scd.codec import Codec
from scdviz.serving import kv, models, setup_engine
from scdviz.settings import ASSETS_DIR, REPO_DIR

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not setup_engine.ready(), reason=setup_engine.why_not_ready())]

PREFIX, CONT, N = 256, 32, 8  # the prefix is two whole 128-token blocks: what an engine can take from outside
CALIB = ASSETS_DIR / "scd" / "jargon"
CHANNELS = {"raw": {"kind": "raw"}, "scd-reuse": {"kind": "scd", "calibration": str(CALIB), "patch_k": 0},
            "scd-tc3840": {"kind": "scd", "calibration": str(CALIB), "budget": 3840}}
# the second specialist of the fan-out: the same raw payload and its own calibration's SCD payload
FAN = "austen-before"
FAN_CHANNELS = {"raw": CHANNELS["raw"],
                f"scd-{FAN}-reuse": {"kind": "scd", "calibration": str(ASSETS_DIR / "scd" / FAN), "patch_k": 0}}
PRODUCED = {**CHANNELS, **FAN_CHANNELS}  # what the producer writes per prompt, from one prefill


def engine(role: str, model, store, job: dict, folder, name: str | None = None) -> dict:
    """Run one engine process of the venv on ``job``; its results (scdviz.serving.engine)."""
    name = name or role
    (folder / f"{name}.json").write_text(json.dumps(job))
    out, log = folder / f"{name}.pt", folder / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([str(setup_engine.python()), "-m", "scdviz.serving.engine", role, "--model", str(model),
                               "--store", str(store), "--job", str(folder / f"{name}.json"), "--out", str(out)],
                              cwd=REPO_DIR, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    assert done.returncode == 0, f"{name} engine failed:\n" + "\n".join(log.read_text().splitlines()[-40:])
    result = torch.load(out)
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def outside_numbers(pair, windows: list[list[int]], plans: dict) -> tuple[dict, list, list]:
    """scdviz's own transfer on ``windows``: per plan KL, top-1 per token and bytes; the oracle's log-probs; the
    raw payload of each window."""
    outside = {name: {"kl": [], "top1": [], "bytes": []} for name in plans}
    oracle, blobs = [], []
    for w in windows:
        case = transfer.prepare_case(pair.producer, pair.consumer, w, CONT)
        oracle.append(torch.log_softmax(case.oracle_logits.float(), -1))
        blobs.append(transfer.build_payload(case.state, plans["raw"][0]))
        for name, (plan, cal) in plans.items():
            got = transfer.run_plan(pair.consumer, case, plan, cal)
            outside[name]["kl"].append(float(metrics.kl_per_token(case.oracle_logits, got.logits).mean()))
            outside[name]["top1"] += metrics.top1_agreement(case.oracle_logits, got.logits).tolist()
            outside[name]["bytes"].append(got.payload_bytes)
    return outside, oracle, blobs


@pytest.fixture(scope="module")
def run(builtin_pair, tmp_path_factory):
    """Outside the engine (scdviz's own transfer) and inside it, on the same windows: one producer engine, then the
    two specialists' engines, one after the other."""
    from scdviz.models.pair import load_pair

    pair = builtin_pair
    folder = tmp_path_factory.mktemp("engine")
    windows = [w.ids for w in data.eval_windows(pair.tokenizer, "jargon", "dev", PREFIX + 1 + CONT, N)]
    calib = Calibration.load(CALIB, pair)
    raw_plan = Codec.raw(len(pair.producer.model.layers)).plan
    plans = {"raw": (raw_plan, None),
             "scd-reuse": (Codec.of(calib, patch_k=0).plan, calib),
             "scd-tc3840": (Codec.of(calib, budget=3840).plan, calib)}
    t0 = time.perf_counter()
    outside, oracle, blobs = outside_numbers(pair, windows, plans)
    fan_pair = load_pair("builtin:smollm2-135m", f"builtin:{FAN}")
    fan_calib = Calibration.load(ASSETS_DIR / "scd" / FAN, fan_pair)
    fan_outside, fan_oracle, _ = outside_numbers(fan_pair, windows, {
        "raw": (raw_plan, None), f"scd-{FAN}-reuse": (Codec.of(fan_calib, patch_k=0).plan, fan_calib)})
    del fan_pair
    outside_seconds = time.perf_counter() - t0
    store = folder / "store"
    producer = engine("producer", models.producer_folder(), store,
                      {"prompts": [w[: PREFIX + 1] for w in windows], "channels": PRODUCED}, folder)
    consumer = engine("consumer", models.specialist_folder("jargon"), store,
                      {"prompts": windows, "channels": CHANNELS, "score": CONT, "runs": ["own", *CHANNELS]}, folder)
    fan = engine("consumer", models.specialist_folder(FAN), store,
                 {"prompts": windows, "channels": FAN_CHANNELS, "score": CONT, "runs": ["own", *FAN_CHANNELS]},
                 folder, name=f"consumer-{FAN}")
    return {"windows": windows, "outside": outside, "oracle": oracle, "raw_blobs": blobs, "store": store,
            "producer": producer, "consumer": consumer, "outside_seconds": outside_seconds,
            "fan": {"outside": fan_outside, "oracle": fan_oracle, "consumer": fan}}


def test_the_specialist_engine_takes_the_whole_blocks_from_each_payload(run):
    loaded = run["consumer"]["loaded"]
    assert loaded["own"] == [0] * N
    for name in CHANNELS:
        assert loaded[name] == [PREFIX] * N, name
    saves = [r for r in run["producer"]["stats"] if r["event"] == "save"]
    assert sorted((r["channel"], r["tokens"]) for r in saves) == sorted((c, PREFIX) for c in PRODUCED for _ in range(N))
    for name in CHANNELS:  # the engine's payloads are scdviz's own for the same prefix and plan
        inside, outside = [r["bytes"] for r in saves if r["channel"] == name], run["outside"][name]["bytes"]
        if "budget" in CHANNELS[name]:  # rate control fits each prompt's own numbers: a few bytes either way
            assert all(abs(a - b) <= 0.01 * b for a, b in zip(inside, outside, strict=True)), (name, inside, outside)
        else:
            assert inside == outside, name


def test_the_producer_engines_paged_kv_is_the_producers_own(run):
    """The raw payload the engine gathered from its paged blocks holds what transformers computes (fp16)."""
    for i in (0, N - 1):
        ids = run["windows"][i][:PREFIX]
        inside = payload.decode(kv.Store(run["store"]).get(kv.prefix_key("raw", ids)))
        outside = payload.decode(run["raw_blobs"][i])
        assert inside.n_tokens == outside.n_tokens == PREFIX and inside.layout.token0 == ids[0]
        for a, b in zip(inside.sections, outside.sections, strict=True):
            assert (a.layer, a.kind) == (b.layer, b.kind)
            err = float((a.data - b.data).abs().max() / b.data.abs().max())
            assert err < 2e-3, f"prompt {i} layer {a.layer} {a.kind}: relative error {err:.2e}"


def test_the_specialist_engines_own_prefill_is_the_specialists(run):
    own = run["consumer"]["logprobs"]["own"]
    for i in range(N):
        assert float((own[i] - run["oracle"][i]).abs().max()) < 2e-3


def agreement(consumer: dict, outside: dict, channels) -> list[str]:
    """KL and top-1 in the engine (against its own prefill) beside outside it, per channel; asserts the bounds."""
    own = consumer["logprobs"]["own"]
    rows = []
    for name in channels:
        got = consumer["logprobs"][name]
        kl_in = sum(float(metrics.kl_per_token(own[i], got[i]).mean()) for i in range(N)) / N
        top1_in = float(metrics.top1_agreement(own, got).mean())
        kl_out = sum(outside[name]["kl"]) / N
        top1_out = sum(outside[name]["top1"]) / len(outside[name]["top1"])
        rows.append(f"{name}: KL in {kl_in:.5f} out {kl_out:.5f}, top-1 in {top1_in:.4f} out {top1_out:.4f}, "
                    f"{outside[name]['bytes'][0] / PREFIX:,.0f} B/token")
        assert abs(kl_in - kl_out) <= 0.10 * kl_out, rows[-1]
        assert abs(top1_in - top1_out) <= 0.02, rows[-1]
    return rows


def test_kl_and_top1_in_the_engine_are_those_measured_outside_it(run):
    rows = agreement(run["consumer"], run["outside"], CHANNELS)
    c, p, f = run["consumer"], run["producer"], run["fan"]["consumer"]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print("\n" + "\n".join(rows))
    print(f"outside {run['outside_seconds']:.1f} s; producer engine: start {p['start_seconds']:.1f} s, process "
          f"{p['wall_seconds']:.1f} s, prefill median {med(p['seconds']['prefill']):.2f} s; consumer engine: start "
          f"{c['start_seconds']:.1f} s, process {c['wall_seconds']:.1f} s, request medians "
          + ", ".join(f"{k} {med(v):.2f} s" for k, v in c["seconds"].items())
          + f"; {FAN}'s engine: process {f['wall_seconds']:.1f} s")


def test_one_producer_prefill_serves_both_specialists(run):
    """Fan-out: each prompt was prefilled once by the producer (its connector saved every channel in that one
    request); the second specialist's engine took the same raw payload file and its own calibration's SCD payload,
    and holds the same bounds against scdviz outside the engine."""
    producer, fan = run["producer"], run["fan"]
    assert len(producer["seconds"]["prefill"]) == N
    saves = [r for r in producer["stats"] if r["event"] == "save"]
    for req in {r["req"] for r in saves}:  # one request (one prefill) wrote the payloads of both specialists
        assert sorted(r["channel"] for r in saves if r["req"] == req) == sorted(PRODUCED), req
    assert len({r["req"] for r in saves}) == N
    loaded = fan["consumer"]["loaded"]
    assert loaded["own"] == [0] * N
    for name in FAN_CHANNELS:
        assert loaded[name] == [PREFIX] * N, name
    raw_keys = {engine: sorted(r["key"] for r in c["stats"] if r["event"] == "load" and r["channel"] == "raw")
                for engine, c in (("jargon", run["consumer"]), (FAN, fan["consumer"]))}
    assert raw_keys["jargon"] == raw_keys[FAN] and len(set(raw_keys[FAN])) == N  # the same raw payload files
    own = fan["consumer"]["logprobs"]["own"]
    for i in range(N):  # the second engine runs the second specialist's weights
        assert float((own[i] - fan["oracle"][i]).abs().max()) < 2e-3
    print("\n" + "\n".join(agreement(fan["consumer"], fan["outside"], FAN_CHANNELS)))

"""The ScdConnector in two vLLM engines on the built-in pair, one table: ``python -m research.engine_demo``.

Needs the engine venv (``python -m scdviz.serving.setup_engine``). Held-out jargon windows (dev slice) of
``prefix + 1 + cont`` tokens, the prefix a whole number of 128-token blocks. Outside any engine, scdviz's own
transfer (as ``bench scd`` runs it) gives each plan's KL(own prefill || plan) and top-1 over the continuation;
inside, a producer engine saves raw KV and SCD reuse-only payloads, a fresh specialist engine (builtin:jargon
merged) scores the continuation teacher-forced over its own prefill and over each loaded prefix, then times the
first token of the prompt (``prefix + 1`` tokens) ``--repeats`` rounds after a warm-up (payloads already in the
shared folder: no link is modelled here). Prints the table and the engines' start times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from scdviz import data, metrics
from scdviz.models.pair import load_pair
from scdviz.scd import transfer
from scdviz.scd.calibration import Calibration
from scdviz.scd.codec import Codec
from scdviz.serving import models, setup_engine
from scdviz.settings import ASSETS_DIR, REPO_DIR

CALIB = ASSETS_DIR / "scd" / "jargon"
CHANNELS = {"raw": {"kind": "raw"}, "scd-reuse": {"kind": "scd", "calibration": str(CALIB), "patch_k": 0},
            "scd-tc3840": {"kind": "scd", "calibration": str(CALIB), "budget": 3840}}


def engine(role: str, model, store: Path, job: dict, folder: Path) -> dict:
    (folder / f"{role}.json").write_text(json.dumps(job))
    t0 = time.perf_counter()
    with open(folder / f"{role}.log", "w") as log:
        subprocess.run([str(setup_engine.python()), "-m", "scdviz.serving.engine", role, "--model", str(model),
                        "--store", str(store), "--job", str(folder / f"{role}.json"), "--out",
                        str(folder / f"{role}.pt")], cwd=REPO_DIR, stdout=log, stderr=subprocess.STDOUT, check=True)
    out = torch.load(folder / f"{role}.pt")
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out windows (default 8)")
    ap.add_argument("--prefix", type=int, default=256, help="prefix tokens, a multiple of 128 (default 256)")
    ap.add_argument("--cont", type=int, default=32, help="scored continuation tokens (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up (default 3)")
    args = ap.parse_args()
    if not setup_engine.ready():
        raise SystemExit(setup_engine.why_not_ready())
    pair = load_pair("builtin:smollm2-135m", "builtin:jargon")
    windows = [w.ids for w in data.eval_windows(pair.tokenizer, "jargon", "dev", args.prefix + 1 + args.cont,
                                                args.prompts)]
    calib = Calibration.load(CALIB, pair)
    plans = {"raw": (Codec.raw(len(pair.producer.model.layers)).plan, None),
             "scd-reuse": (Codec.of(calib, patch_k=0).plan, calib),
             "scd-tc3840": (Codec.of(calib, budget=3840).plan, calib)}
    outside = {name: {"kl": [], "top1": [], "bytes": []} for name in plans}
    for w in windows:
        case = transfer.prepare_case(pair.producer, pair.consumer, w, args.cont)
        for name, (plan, cal) in plans.items():
            got = transfer.run_plan(pair.consumer, case, plan, cal)
            outside[name]["kl"].append(float(metrics.kl_per_token(case.oracle_logits, got.logits).mean()))
            outside[name]["top1"] += metrics.top1_agreement(case.oracle_logits, got.logits).tolist()
            outside[name]["bytes"].append(got.payload_bytes)
    del pair
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prompts = [w[: args.prefix + 1] for w in windows]
        prod = engine("producer", models.producer_folder(), folder / "store",
                      {"prompts": prompts, "channels": CHANNELS}, folder)
        cons = engine("consumer", models.specialist_folder("jargon"), folder / "store",
                      {"prompts": windows, "channels": CHANNELS, "score": args.cont, "runs": ["own", *CHANNELS],
                       "timing_prompts": prompts, "timing_repeats": args.repeats}, folder)
    own = cons["logprobs"]["own"]
    n = len(windows)
    med = lambda rows: statistics.median(x for r in rows for x in r)  # noqa: E731
    print(f"{n} jargon dev windows, prefix {args.prefix} + 1 prompt token, {args.cont} scored tokens; "
          f"first token: median of {args.repeats} rounds x {n} prompts")
    print("| run | B/token | KL in engine | KL outside | top-1 in engine | top-1 outside | first token (s) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| own prefill | | | | | | {med(cons['ttft']['own']):.3f} |")
    for name in CHANNELS:
        got = cons["logprobs"][name]
        kl_in = sum(float(metrics.kl_per_token(own[i], got[i]).mean()) for i in range(n)) / n
        top1_in = float(metrics.top1_agreement(own, got).mean())
        o = outside[name]
        print(f"| {name} | {statistics.mean(o['bytes']) / args.prefix:,.0f} | {kl_in:.5f} | {sum(o['kl']) / n:.5f} | "
              f"{top1_in:.4f} | {sum(o['top1']) / len(o['top1']):.4f} | {med(cons['ttft'][name]):.3f} |")
    loads = [r for r in cons["stats"] if r["event"] == "load"]
    for name in CHANNELS:
        rows = [r for r in loads if r["channel"] == name]
        print(f"{name}: connector decode median {statistics.median(r['decode_s'] for r in rows):.3f} s, write "
              f"{statistics.median(r['write_s'] for r in rows):.4f} s ({len(rows)} loads)")
    saves = [r for r in prod["stats"] if r["event"] == "save"]
    for name in CHANNELS:
        rows = [r for r in saves if r["channel"] == name]
        print(f"{name}: producer encode median {statistics.median(r['encode_s'] for r in rows):.3f} s")
    print(f"engine start: producer {prod['start_seconds']:.1f} s, specialist {cons['start_seconds']:.1f} s; "
          f"processes {prod['wall_seconds']:.1f} s and {cons['wall_seconds']:.1f} s")


if __name__ == "__main__":
    main()

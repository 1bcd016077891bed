"""SCD in vLLM engines, one table: ``python -m research.engine_demo`` (``--record``: assets/scd/engine.json).

Needs the engine venv (``python -m scdviz.serving.setup_engine``). For each prompt length (``--lengths``, whole
128-token blocks: 512, 1,024, 2,048 tokens by default) ``--prompts`` held-out windows of ``length + 1 + cont``
tokens from the dev slice, alternating between the two built-in specialists' own corpora (jargon, austen).

1. **Outside any engine**, scdviz's own transfer (``scdviz.scd.transfer``, as ``bench scd`` runs it) gives, per
   specialist, each plan's KL(own prefill || plan) and top-1 over the ``cont`` continuation tokens.
2. **One producer engine** (the built-in producer's weights) prefills every prompt (``length + 1`` tokens) once;
   its ``ScdConnector`` writes one payload per channel into a shared folder: raw KV (shared by both specialists)
   and, per specialist, SCD reuse-only (int4 codes at the calibration's operating point) and transform-coded at
   3,840 B/token, each with that specialist's shipped calibration (``assets/scd/<name>/``). One prefill, a
   payload per target: fan-out.
3. **Each specialist's engine** (its LoRA merged; run one after the other) scores each window teacher-forced
   over its own prefill and over each prefix its connector loads, then times request to first token on
   ``--timing-prompts`` prompts per length (``length + 1`` tokens), ``--repeats`` rounds after a warm-up, with the
   payload already in the shared folder.

TTFT at a link = the engine's request-to-first-token + latency + bytes * 8 / bandwidth (``scdviz.link.Link``), per
prompt and round, then the median; the own prefill sends nothing. The producer's prefill and encode are not in
it (reported beside it). The table is rendered from the record (``scdviz.serving.table``), written to ``--out``
(default: the runs folder) or, with ``--record``, to ``assets/scd/engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from scdviz import data, link, metrics, records, runs
from scdviz.models import builtin, hf
from scdviz.models.pair import load_pair
from scdviz.scd import transfer
from scdviz.scd.calibration import Calibration
from scdviz.scd.codec import Codec
from scdviz.serving import kv, models, setup_engine, table
from scdviz.settings import ASSETS_DIR, REPO_DIR

PRODUCER = "smollm2-135m"
SPECIALISTS = ("jargon", "austen-before")
BUDGET = 3840.0  # B/token of the transform-coded plan
BANDWIDTHS = (1.0, 10.0, 100.0)  # Gbit/s
BLOCK = 128  # the engine's KV block: a prefix it can take is whole blocks


def channels_of(spec: str) -> dict[str, dict]:
    """The specialist's channels as the connector reads them: raw KV (the same payload for every specialist) and
    its two SCD plans, named ``scd-<calibration tag>-<plan>`` (the cache-salt scheme of docs/serving.md)."""
    calib = str(ASSETS_DIR / "scd" / spec)
    return {"raw": {"kind": "raw"},
            f"scd-{spec}-reuse": {"kind": "scd", "calibration": calib, "patch_k": 0},
            f"scd-{spec}-tc{BUDGET:.0f}": {"kind": "scd", "calibration": calib, "budget": BUDGET}}


def plans_of(pair, calib) -> dict[str, tuple]:
    """The same plans outside the engine, by channel kind: (plan, calibration or None, the table's label)."""
    reuse = Codec.of(calib, patch_k=0).plan
    return {"raw": (Codec.raw(len(pair.producer.model.layers)).plan, None, "raw KV"),
            "reuse": (reuse, calib, f"SCD reuse-only int{reuse.code_bits}"),
            "tc": (Codec.of(calib, budget=BUDGET).plan, calib, f"SCD transform-coded @{BUDGET:,.0f} B/token")}


def kind_of(channel: str) -> str:
    return "raw" if channel == "raw" else "reuse" if channel.endswith("-reuse") else "tc"


def say(text: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.0f} s] {text}", flush=True)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def engine(role: str, model: Path, store: Path, job: dict, folder: Path, t0: float, name: str | None = None) -> dict:
    """Run one engine process of the venv on ``job``, echoing its progress lines; its results."""
    name = name or role
    (folder / f"{name}.json").write_text(json.dumps(job))
    log_path, out = folder / f"{name}.log", folder / f"{name}.pt"
    start = time.perf_counter()
    cmd = [str(setup_engine.python()), "-m", "scdviz.serving.engine", role, "--model", str(model), "--store",
           str(store), "--job", str(folder / f"{name}.json"), "--out", str(out)]
    with open(log_path, "w") as log, subprocess.Popen(cmd, cwd=REPO_DIR, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            if line.startswith("scdviz-engine:"):
                say(f"{name}: {line.removeprefix('scdviz-engine:').strip()}", t0)
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        raise SystemExit(f"the {name} engine failed (exit {proc.returncode}); the end of {log_path}:\n{tail}")
    result = torch.load(out)
    result["wall_seconds"] = time.perf_counter() - start
    return result


def outside(pairs: dict, windows: list[dict], cont: int, t0: float) -> dict:
    """Per specialist, channel kind and window: KL, top-1 per token and payload bytes of scdviz's own transfer."""
    out = {spec: {k: {"kl": [], "top1": [], "bytes": []} for k in ("raw", "reuse", "tc")} for spec in pairs}
    producer = next(iter(pairs.values()))[0].producer
    for n, w in enumerate(windows):
        prefix, fed, targets = data.split_prompt(w["ids"], cont)
        state = transfer.producer_state(producer, prefix)  # one producer prefill for every specialist
        for spec, (pair, plans) in pairs.items():
            consumer = pair.consumer
            cache = hf.decoder_cache(consumer, prefix)
            logits, resid = transfer.continuation(consumer, cache, fed, prefix.shape[1])
            case = transfer.Case(state, fed, targets, logits, resid, cache, 0.0, 0.0)
            for kind, (plan, calib, _) in plans.items():
                got = transfer.run_plan(consumer, case, plan, calib)
                out[spec][kind]["kl"].append(float(metrics.kl_per_token(logits, got.logits).mean()))
                out[spec][kind]["top1"].append(metrics.top1_agreement(logits, got.logits).tolist())
                out[spec][kind]["bytes"].append(got.payload_bytes)
        say(f"outside the engine: window {n + 1}/{len(windows)} ({w['prefix']} tokens, {w['domain']}) done", t0)
    return out


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def rows_of(args, windows: list[dict], timing: list[int], out: dict, prod: dict, cons: dict, labels: dict) -> list:
    """The record's rows: one per specialist, prefix length and run."""
    links = [link.Link(g, args.latency_ms / 1000) for g in BANDWIDTHS]
    saves = [r for r in prod["stats"] if r["event"] == "save" and not r.get("warmup")]
    size = {(r["channel"], r["tokens"], r["key"]): r["bytes"] for r in saves}
    encode: dict[tuple, list[float]] = {}
    for r in saves:
        encode.setdefault((r["channel"], r["tokens"]), []).append(r["encode_s"])
    request = {}
    for w, s in zip(windows, prod["seconds"]["prefill"], strict=True):
        request.setdefault(w["prefix"], []).append(s)
    rows = []
    for spec in SPECIALISTS:
        c = cons[spec]
        own = c["logprobs"]["own"]
        loads = [r for r in c["stats"] if r["event"] == "load" and r.get("timed")]
        for prefix in args.lengths:
            idx = [i for i, w in enumerate(windows) if w["prefix"] == prefix]
            tidx = [j for j, i in enumerate(timing) if windows[i]["prefix"] == prefix]
            oracle = None
            for run in ["own", *channels_of(spec)]:
                samples = [x for j in tidx for x in c["ttft"][run][j]]
                q1, med, q3 = quartiles(samples)
                row = {"specialist": spec, "prefix_tokens": prefix, "prompt_tokens": prefix + 1, "channel": run,
                       "method": "own prefill" if run == "own" else labels[spec][kind_of(run)],
                       "engine_ms": round(1000 * med, 1), "engine_iqr_ms": [round(1000 * q1), round(1000 * q3)],
                       "n_timed": len(samples), "producer_request_ms": round(1000 * statistics.median(request[prefix]),
                                                                             1)}
                if run == "own":
                    oracle = row["engine_ms"]
                    row["oracle_ms"] = oracle
                    rows.append(row)
                    continue
                keys = [kv.prefix_key(run, windows[i]["ids"][:prefix]) for i in idx]
                nbytes = [size[(run, prefix, k)] for k in keys]
                tbytes = {j: size[(run, prefix, kv.prefix_key(run, windows[timing[j]]["ids"][:prefix]))]
                          for j in tidx}
                for lk in links:  # the link per prompt and round, then the median
                    row[f"ttft_{lk.gbps:g}gbps_ms"] = round(1000 * statistics.median(
                        x + lk.seconds(tbytes[j]) for j in tidx for x in c["ttft"][run][j]), 1)
                mine = [r for r in loads if r["channel"] == run and r["tokens"] == prefix]
                kl_in = [float(metrics.kl_per_token(own[i], c["logprobs"][run][i]).mean()) for i in idx]
                top1_in = [x for i in idx for x in metrics.top1_agreement(own[i], c["logprobs"][run][i]).tolist()]
                o = out[spec][kind_of(run)]
                row.update({
                    "oracle_ms": oracle, "bytes_per_token": round(statistics.mean(nbytes) / prefix, 1),
                    "payload_bytes": nbytes, "outside_payload_bytes": [o["bytes"][i] for i in idx],
                    "encode_ms": round(1000 * statistics.median(encode[(run, prefix)]), 1),
                    "load_ms": round(1000 * statistics.median(r["read_s"] + r["decode_s"] + r["write_s"]
                                                              for r in mine), 1),
                    "n_loads": len(mine),
                    "read_ms": round(1000 * statistics.median(r["read_s"] for r in mine), 1),
                    "decode_ms": round(1000 * statistics.median(r["decode_s"] for r in mine), 1),
                    "write_ms": round(1000 * statistics.median(r["write_s"] for r in mine), 1),
                    "kl_engine": round(statistics.mean(kl_in), 6),
                    "kl_outside": round(statistics.mean(o["kl"][i] for i in idx), 6),
                    "top1_engine": round(statistics.mean(top1_in), 5),
                    "top1_outside": round(statistics.mean(x for i in idx for x in o["top1"][i]), 5),
                    "kl_engine_per_prompt": [round(x, 6) for x in kl_in],
                    "kl_outside_per_prompt": [round(o["kl"][i], 6) for i in idx],
                    "loaded_tokens": [c["loaded"][run][i] for i in idx]})
                if len(mine) != 1 + args.repeats * len(tidx):  # a warm-up and every timed request loaded
                    raise SystemExit(f"{spec}'s connector loaded {run} {len(mine)} times at {prefix} tokens while "
                                     f"timing, not {1 + args.repeats * len(tidx)}")
                for lk in links:
                    g = f"{lk.gbps:g}gbps"
                    row[f"below_own_{g}"] = row[f"ttft_{g}_ms"] < oracle
                    row[f"ttft_with_encode_{g}_ms"] = round(row[f"ttft_{g}_ms"] + row["encode_ms"], 1)
                rows.append(row)
    for r in rows:
        idx = [i for i, w in enumerate(windows) if w["prefix"] == r["prefix_tokens"]]
        r["domains"], r["passages"] = [windows[i]["domain"] for i in idx], [windows[i]["passage"] for i in idx]
    return rows


def check_writable(path: Path, record: bool) -> Path:
    """``path``, unless it lies in the repository's assets/ and --record was not given."""
    if path.resolve().is_relative_to(ASSETS_DIR.resolve()) and not record:
        raise SystemExit(f"{path} is inside the shipped assets/ folder, which only --record writes")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.engine_demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048],
                    help="prefix tokens, each a multiple of 128 (the prompt is one token more)")
    ap.add_argument("--prompts", type=int, default=2, help="held-out windows per length, alternating the "
                    "specialists' corpora (default 2: one of each)")
    ap.add_argument("--timing-prompts", type=int, default=2, help="of those, timed per length (default 2)")
    ap.add_argument("--cont", type=int, default=32, help="scored continuation tokens (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up (default 3)")
    ap.add_argument("--latency-ms", type=float, default=link.Link(1).latency_s * 1000,
                    help="the link's one-way latency (default scdviz.link's, 0.5 ms)")
    ap.add_argument("--out", default=None, help="the record (default: <runs>/bench/engine-demo/record.json)")
    ap.add_argument("--record", action="store_true", help="maintainers: write the shipped record, "
                    f"assets/{table.RECORD}")
    args = ap.parse_args(argv)
    if any(n % BLOCK or n < BLOCK for n in args.lengths):
        raise SystemExit(f"--lengths must be whole multiples of {BLOCK} tokens (the engine takes whole blocks)")
    if not 1 <= args.timing_prompts <= args.prompts:
        raise SystemExit("--timing-prompts must be between 1 and --prompts")
    out_path = ASSETS_DIR / table.RECORD if args.record and args.out is None else Path(
        args.out or runs.folder("bench", "engine-demo") / "record.json")
    check_writable(out_path, args.record)
    if not setup_engine.ready():
        raise SystemExit(setup_engine.why_not_ready())
    t0 = time.perf_counter()
    load = {"start": load_average()}
    say(f"load average {load['start']}; preparing the specialists' engine folders", t0)
    folders = {spec: models.specialist_folder(spec) for spec in SPECIALISTS}
    pairs, labels = {}, {}
    for spec in SPECIALISTS:
        pair = load_pair(f"builtin:{PRODUCER}", f"builtin:{spec}")
        plans = plans_of(pair, Calibration.load(ASSETS_DIR / "scd" / spec, pair))
        pairs[spec], labels[spec] = (pair, plans), {k: v[2] for k, v in plans.items()}
    tokenizer = pairs[SPECIALISTS[0]][0].tokenizer
    domains = [builtin.training_corpus(spec) for spec in SPECIALISTS]
    windows, timing = [], []
    for prefix in args.lengths:
        per = {d: data.eval_windows(tokenizer, d, "dev", prefix + 1 + args.cont, -(-args.prompts // len(domains)))
               for d in domains}
        picked = [per[domains[i % len(domains)]][i // len(domains)] for i in range(args.prompts)]
        timing += [len(windows) + i for i in range(args.timing_prompts)]
        windows += [{"ids": w.ids, "prefix": prefix, "domain": w.domain, "passage": w.cluster} for w in picked]
    say(f"{len(windows)} windows ({args.prompts} per length {args.lengths}, dev slice of {', '.join(domains)}); "
        "scoring outside the engine", t0)
    out = outside(pairs, windows, args.cont, t0)
    del pairs, tokenizer
    all_channels = {k: v for spec in SPECIALISTS for k, v in channels_of(spec).items()}
    max_len = -(-(max(len(w["ids"]) for w in windows) + 1) // BLOCK) * BLOCK  # the longest window and a token out
    with tempfile.TemporaryDirectory(prefix="scd-engine-") as tmp:
        folder = Path(tmp)
        store = folder / "store"
        prompts = [w["ids"][: w["prefix"] + 1] for w in windows]
        warm = [prompts[0][1:] + [prompts[0][0]]]  # another prompt: the connector's first encode loads its codecs
        load["producer"] = load_average()
        say(f"producer engine: {len(prompts)} prompts, one prefill each, {len(all_channels)} payloads per prompt "
            f"(load average {load['producer']})", t0)
        prod = engine("producer", models.producer_folder(), store,
                      {"prompts": prompts, "warmup_prompts": warm, "channels": all_channels,
                       "max_model_len": max_len}, folder, t0)
        cons = {}
        for spec in SPECIALISTS:
            load[spec] = load_average()
            say(f"{spec}'s engine: {len(windows)} windows scored over 4 runs, then {len(timing)} prompts timed "
                f"{args.repeats} rounds (load average {load[spec]})", t0)
            cons[spec] = engine("consumer", folders[spec], store,
                                {"prompts": [w["ids"] for w in windows], "channels": channels_of(spec),
                                 "score": args.cont, "runs": ["own", *channels_of(spec)],
                                 "timing_prompts": [prompts[i] for i in timing], "timing_repeats": args.repeats,
                                 "max_model_len": max_len}, folder, t0, name=f"consumer-{spec}")
    for spec in SPECIALISTS:
        for run in channels_of(spec):
            got = cons[spec]["loaded"][run]
            want = [w["prefix"] for w in windows]
            if got != want:
                raise SystemExit(f"{spec}'s engine took {got} tokens from {run}, not {want}")
    load["end"] = load_average()
    rows = rows_of(args, windows, timing, out, prod, cons, labels)
    command = shlex.join(["python", "-m", "research.engine_demo", *(sys.argv[1:] if argv is None else argv)])
    shipped = {spec: {k: {**v, "calibration": f"assets/scd/{spec}"} if "calibration" in v else v
                      for k, v in channels_of(spec).items()} for spec in SPECIALISTS}
    settings = {"research": "engine_demo", "slice": "dev", "lengths": args.lengths, "prompts": args.prompts,
                "timing_prompts": args.timing_prompts, "cont": args.cont, "repeats": args.repeats,
                "latency_ms": args.latency_ms, "bandwidths_gbps": list(BANDWIDTHS), "producer": f"builtin:{PRODUCER}",
                "specialists": [f"builtin:{s}" for s in SPECIALISTS], "domains": domains, "channels": shipped,
                "engine": {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False,
                           "max_model_len": max_len, "max_num_seqs": 1, "block_size": BLOCK},
                "command": command}
    record = records.make("ttft", settings, 0, rows, "cpu", time.perf_counter() - t0)
    record.versions.update({"engine": prod["versions"], "load_average": load,
                            "engine_seconds": {"producer": round(prod["wall_seconds"], 1),
                                               **{s: round(cons[s]["wall_seconds"], 1) for s in SPECIALISTS}},
                            "engine_start_seconds": {"producer": round(prod["start_seconds"], 1),
                                                     **{s: round(cons[s]["start_seconds"], 1) for s in SPECIALISTS}}})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records.write(record, out_path)
    full = out_path.resolve()
    shown = full.relative_to(REPO_DIR.resolve()).as_posix() if full.is_relative_to(REPO_DIR.resolve()) else str(full)
    print()
    print(table.render(records.read(out_path), shown))
    print(f"\nrecord: {out_path}; {time.perf_counter() - t0:.0f} s in all (engines: producer "
          f"{prod['wall_seconds']:.0f} s, " + ", ".join(f"{s} {cons[s]['wall_seconds']:.0f} s" for s in SPECIALISTS)
          + f"; engine starts {prod['start_seconds']:.0f} / "
          + " / ".join(f"{cons[s]['start_seconds']:.0f}" for s in SPECIALISTS) + " s)")


if __name__ == "__main__":
    main()

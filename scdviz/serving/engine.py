"""Engine processes for the ScdConnector: run in the engine's venv, driven by the tests and the demo.

    .engine-venv/bin/python -m scdviz.serving.engine producer --model FOLDER --store DIR --job JOB.json --out OUT
    .engine-venv/bin/python -m scdviz.serving.engine consumer --model FOLDER --store DIR --job JOB.json --out OUT

JOB.json: ``{"prompts": [[token ids], ...], "channels": {NAME: CODEC, ...}, "score": n, "runs": [...]}``
(channels as ``scdviz.serving.connector`` reads them; ``max_model_len``, default 2048: the longest prompt the engine
takes, and the tokens of one engine step, so that a whole prompt is prefilled, and saved, in one step). Prompts are
token ids, never text: the tokenizer folder written under the project's transformers 5.2 is mis-read by the
engine's 5.19, so the engine starts without one (``skip_tokenizer_init``).

- ``producer``: one vLLM engine on the producer's weights with the connector as ``kv_producer``; every prompt is
  prefilled once (one token generated) and its whole blocks leave as one payload per channel in the store: one
  prefill, one payload per target calibration (fan-out). ``warmup_prompts`` run first (the connector loads the
  producer's weights and each channel's codec on first use); their connector rows are marked ``"warmup": true``.
- ``consumer``: one vLLM engine on the specialist's weights with the connector as ``kv_consumer``; every prompt is
  run once per entry of ``runs``, teacher-forced (``prompt_logprobs`` over the whole vocabulary): ``own`` is its
  own prefill (the request skips every external or cached prefix), a channel's name runs over the prefix the
  connector loads from that channel. The log-probabilities of the last ``score`` prompt tokens (the
  continuation, given the prompt) are kept.

With ``timing_repeats`` > 0 the consumer then times each run's first token on ``timing_prompts`` (default: the
prompts; ``first_token_seconds``: one token generated, no log-probs), after an untimed warm-up request per run on
the first timing prompt of each length; the connector rows written while timing are marked ``"timed": true``.

OUT.pt (torch.save): {"logprobs": {run: (P, score, V)}, "seconds": {run: [per prompt]}, "loaded": {run: [tokens
the engine took from outside, per prompt]}, "ttft": {run: [[seconds per round] per prompt]}, "stats": [rows the
connector appended], "start_seconds": engine start, "versions": {vllm, transformers, torch}}. The engine runs in
float32 (the numbers of scdviz outside an engine are float32 on the CPU), prefix caching off (each run computes
what it says). Progress lines on stdout start with ``scdviz-engine:``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CONNECTOR = "scdviz.serving.connector"


def make_engine(model: str, role: str, store: str, channels: dict, stats: str | None,
                max_model_len: int = 2048, eager: bool = True):
    """A vLLM engine on ``model`` with the ScdConnector as ``kv_<role>``. ``max_model_len`` is also the tokens of one
    engine step (a prompt is prefilled in one step: the connector saves only such prompts). ``eager``: no
    torch.compile (the first compile of a model costs about 90 s on 2 cores, and its cache did not load in another
    venv)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector="ScdConnector", kv_connector_module_path=CONNECTOR, kv_role=f"kv_{role}",
                                kv_connector_extra_config={"store": store, "channels": channels, "stats": stats})
    return LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len,
               max_num_batched_tokens=max_model_len, max_num_seqs=1, enable_prefix_caching=False,
               kv_transfer_config=transfer, max_logprobs=-1, seed=0, enforce_eager=eager)


class DenseRows(list):
    """A request's prompt log-probs as dense (rows, vocab) tensors, one per prefill chunk (``fast_prompt_logprobs``)."""


def fast_prompt_logprobs(vocab: int, keep: int | None = None) -> bool:
    """Keep whole-vocabulary prompt log-probs as tensors in this (front-end) process instead of vLLM's Python lists.

    vLLM 0.32 turns them into Python lists element by element (``FlatLogprobs.append_fast``: 56 million list appends
    and 7 s for one 289-token prompt on 2 cores, against 0.7 s for the request without log-probs); the engine
    computes the same numbers either way, only their hand-over changes. ``keep``: only the last ``keep`` rows of
    each prefill chunk are kept (the rows a caller reads, ``dense``; a chunk's last rows adjoin the next chunk's
    first, so the last ``keep`` rows of the request are right whatever the chunks). Patches
    ``LogprobsProcessor._update_prompt_logprobs``; False (nothing patched) where vLLM has no such method."""
    import torch

    try:
        from vllm.v1.engine.logprobs import LogprobsProcessor
    except ImportError:
        return False
    if not hasattr(LogprobsProcessor, "_update_prompt_logprobs"):
        return False

    def update(self, tensors) -> None:
        token_ids, logprobs = tensors[0], tensors[1]
        if keep is not None:
            token_ids, logprobs = token_ids[-keep:], logprobs[-keep:]
        token_ids, logprobs = token_ids.long(), logprobs.float()
        # some rows came with ids far outside the vocabulary (index 12582928 of 49152 was seen: uninitialised
        # memory, presumably positions the engine did not compute, e.g. a prefix the connector loaded; vLLM's
        # own lists carry them too and nothing reads them): such a row is NaN here, never scattered, and
        # ``dense`` refuses a NaN row among the positions asked for
        valid = ((token_ids >= 0) & (token_ids < vocab)).all(1)
        rows = torch.full((logprobs.shape[0], vocab), float("-inf"))
        rows[valid] = rows[valid].scatter(1, token_ids[valid], logprobs[valid])
        rows[~valid] = float("nan")
        if not isinstance(self.prompt_logprobs, DenseRows):
            self.prompt_logprobs = DenseRows()
        self.prompt_logprobs.append(rows)

    LogprobsProcessor._update_prompt_logprobs = update
    return True


def dense(prompt_logprobs, positions: range, vocab: int):
    """(len(positions), vocab) log-probs at the prompt's last ``positions`` from a request's prompt_logprobs, dense
    (``DenseRows``: its rows end at the prompt's last position) or vLLM's flat lists."""
    import torch

    if isinstance(prompt_logprobs, DenseRows):
        rows = torch.cat(list(prompt_logprobs))
        if rows.shape[0] < len(positions):
            raise ValueError(f"{rows.shape[0]} prompt positions have log-probs, {len(positions)} are asked")
        rows = rows[-len(positions):]
        if rows.isnan().any():
            raise ValueError("the engine returned no log-probs for some asked positions (it did not compute them)")
        return rows
    out = torch.full((len(positions), vocab), float("-inf"))
    for row, pos in enumerate(positions):
        s, e = prompt_logprobs.start_indices[pos], prompt_logprobs.end_indices[pos]
        if e <= s:
            raise ValueError(f"no prompt log-probs at position {pos} (the engine did not compute it)")
        out[row, torch.tensor(prompt_logprobs.token_ids[s:e])] = torch.tensor(prompt_logprobs.logprobs[s:e])
    return out


def first_token_seconds(llm, prompts: list[list[int]], runs: list[str], repeats: int) -> dict:
    """Seconds from request to first token (one generated token, no log-probs) per run and prompt, ``repeats``
    rounds after an untimed warm-up (each run once on the first prompt of each length), the runs' order rotating per
    round: {run: [[per round] per prompt]}. A channel's run includes reading and decoding its payload, which is
    already in the store (no link here: a harness adds the link's time, ``scdviz.link``)."""
    import time as clock

    from vllm import SamplingParams, TokensPrompt

    def request(ids: list[int], run: str) -> float:
        own = run == "own"
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=own,
                                extra_args=None if own else {"scd_channel": run})
        t = clock.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return clock.perf_counter() - t

    out = {run: [[] for _ in prompts] for run in runs}
    if repeats < 1:
        return out
    for ids in {len(ids): ids for ids in reversed(prompts)}.values():  # the first prompt of each length
        for run in runs:
            request(ids, run)
    for rnd in range(repeats):
        order = runs[rnd % len(runs):] + runs[: rnd % len(runs)]
        for i, ids in enumerate(prompts):
            for run in order:
                out[run][i].append(request(ids, run))
        progress(f"timing round {rnd + 1}/{repeats} done")
    return out


def progress(text: str) -> None:
    """A progress line on stdout (a harness echoes the lines starting ``scdviz-engine:``)."""
    print(f"scdviz-engine: {text}", flush=True)


def connector_rows(path: Path) -> list[dict]:
    """The rows the connector appended to its stats file (none yet: [])."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def run_producer(llm, job: dict, stats: Path, result: dict) -> None:
    """Warm-up prompts, then every prompt once: prefilled, its payloads saved (``seconds["prefill"]``: the request,
    prefill and every channel's gather, encode and write)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for ids in job.get("warmup_prompts") or []:
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    result["warmup_rows"] = len(connector_rows(stats))
    result["seconds"]["prefill"] = []
    for n, ids in enumerate(job["prompts"]):
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        result["seconds"]["prefill"].append(time.perf_counter() - t)
        progress(f"prompt {n + 1}/{len(job['prompts'])} ({len(ids)} tokens) prefilled and saved, "
                 f"{result['seconds']['prefill'][-1]:.1f} s")


def run_consumer(llm, job: dict, channels: dict, stats: Path, result: dict) -> None:
    """Every prompt teacher-forced once per run (log-probs of the last ``score`` tokens), then the timed first
    tokens."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    # "slow_logprobs": vLLM's own lists (a check that the fast hand-over gives the same numbers)
    score, runs = int(job["score"]), list(job.get("runs") or ["own", *channels])
    result["fast_logprobs"] = False if job.get("slow_logprobs") else fast_prompt_logprobs(vocab, keep=score)
    rows = {run: [] for run in runs}
    for run in runs:
        result["seconds"][run], result["loaded"][run] = [], []
    for n, ids in enumerate(job["prompts"]):
        positions = range(len(ids) - score, len(ids))
        for run in runs:
            own = run == "own"
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=-1,
                                    flat_logprobs=True, skip_reading_prefix_cache=own,
                                    extra_args=None if own else {"scd_channel": run})
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            result["seconds"][run].append(time.perf_counter() - t)
            result["loaded"][run].append(int(out.num_cached_tokens or 0))
            rows[run].append(dense(out.prompt_logprobs, positions, vocab))
        progress(f"prompt {n + 1}/{len(job['prompts'])} ({len(ids)} tokens) scored over {len(runs)} runs")
    result["logprobs"] = {run: torch.stack(r) for run, r in rows.items()}
    result["timed_rows"] = len(connector_rows(stats))
    result["ttft"] = first_token_seconds(llm, job.get("timing_prompts") or job["prompts"], runs,
                                         int(job.get("timing_repeats", 0)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scdviz.serving.engine")
    ap.add_argument("role", choices=["producer", "consumer"])
    ap.add_argument("--model", required=True, help="a safetensors model folder (scdviz.serving.models)")
    ap.add_argument("--store", required=True, help="the shared folder payloads cross")
    ap.add_argument("--job", required=True, help="JSON: prompts (token ids), channels, score, runs")
    ap.add_argument("--out", required=True, help="where the results go (torch.save)")
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slow first start)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of paged KV: ample for 2k tokens of a 135M model

    import torch
    import transformers
    import vllm

    job = json.loads(Path(args.job).read_text())
    stats = Path(args.out).with_suffix(".stats.jsonl")
    stats.unlink(missing_ok=True)
    t0 = time.perf_counter()
    channels = job.get("channels") or {"raw": {"kind": "raw"}}
    llm = make_engine(args.model, args.role, args.store, channels, str(stats), int(job.get("max_model_len", 2048)),
                      eager=not args.compile)
    result = {"start_seconds": time.perf_counter() - t0, "seconds": {}, "loaded": {}, "logprobs": {},
              "versions": {"vllm": str(vllm.__version__), "transformers": str(transformers.__version__),
                           "torch": str(torch.__version__)}}
    progress(f"{args.role} engine started in {result['start_seconds']:.1f} s")
    if args.role == "producer":
        run_producer(llm, job, stats, result)
    else:
        run_consumer(llm, job, channels, stats, result)
    result["stats"] = connector_rows(stats)
    for i, row in enumerate(result["stats"]):
        if i < result.get("warmup_rows", 0):
            row["warmup"] = True
        if i >= result.get("timed_rows", len(result["stats"])):
            row["timed"] = True
    torch.save(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("logprobs", "stats")}, default=str)[:3000])
    llm.llm_engine.engine_core.shutdown()  # the engine core and its worker stop here, not in interpreter teardown
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # past this point only interpreter teardown is left, where vLLM 0.32's threads once aborted the process after
    # its results were written ("terminate called without an active exception", exit -6): skip it
    os._exit(code)

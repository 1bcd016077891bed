"""scdviz web app: builds the Gradio Blocks from the library and launches it.

    python app.py            # serves on http://127.0.0.1:7860 (GRADIO_SERVER_PORT to change)

Settings come from environment variables (see scdviz/settings.py): SCDVIZ_PRODUCER,
SCDVIZ_CONSUMER, SCDVIZ_DEVICE, SCDVIZ_HOSTED, SCDVIZ_MAX_PROMPT_TOKENS,
SCDVIZ_MAX_NEW_TOKENS, SCDVIZ_CACHE. Models load once and are shared by all users;
per-user results live in gr.State. Nothing heavy happens at import time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gradio as gr

from scdviz import data, drift, service, settings
from scdviz.ui import evict_tab, pair_tab, results_tab, scd_tab, train_tab

try:  # ZeroGPU Spaces: run model work under a GPU allocation; a no-op elsewhere
    import spaces  # type: ignore

    gpu = spaces.GPU
except ImportError:  # pragma: no cover - the package exists only on Spaces

    def gpu(fn):
        return fn


def _examples(n: int = 3, chars: int = 600) -> list[str]:
    """Opening text of a few shipped evaluation passages."""
    out = []
    for corpus in data.corpora():
        for passage in data.load_split(corpus, "eval")[1 : 1 + (n + 1) // 2]:
            out.append(passage[:chars].rsplit(" ", 1)[0])
    return out[:n]


def _key(producer: str, consumer: str) -> str:
    return f"{producer}\n{consumer}"


def load(producer, consumer, progress):
    pair = service.get_pair(producer, consumer, progress=progress)
    return service.pair_summary(pair), drift.facts_rows(pair), _key(pair.producer_source, pair.consumer_source)


@gpu
def generate(key, prompt, max_new, chat):
    pair = _pair(key)
    gen = service.generate_both(pair, prompt, max_new, chat)
    tok = pair.tokenizer
    pieces = [[tok.decode([i]) for i in ids] for ids in (gen.producer_ids, gen.consumer_ids)]
    same = sum(a == b for a, b in zip(gen.producer_ids, gen.consumer_ids))
    md = (f"Prompt: {gen.prompt_tokens} tokens. Consumer agrees with producer on {same}/{len(gen.consumer_ids)} "
          f"generated positions. Both generations took {gen.seconds:.1f} s.")
    return pieces[0], pieces[1], md


def _pair(key: str):
    return service.get_pair(*key.split("\n"))


@gpu
def scd_run(key, text, cont, gen, bits, rank_k, rank_v, patch_k, placement, layers, gbps, latency_s, fan_out=False):
    """One text through every method; with fan_out, also for every other built-in specialist (one table)."""
    import pandas as pd

    pair = _pair(key)
    args = (text, cont, gen, bits, rank_k, rank_v, patch_k, placement, layers, gbps, latency_s)
    out = service.scd_run(pair, *args)
    if fan_out:
        tables = [out["table"].assign(specialist=pair.consumer_source)]
        for consumer in service.builtin_choices()[1]:
            if consumer != pair.consumer_source:
                other = service.scd_run(service.get_pair(pair.producer_source, consumer), *args)
                tables.append(other["table"].assign(specialist=consumer))
        out["table"] = pd.concat(tables, ignore_index=True)
        out["info"] += (f" Fan-out: {len(tables)} specialists on the same text from the same producer, each with "
                        "its own calibration; texts and plots show the loaded pair.")
    return out


@gpu
def evict_run(key, context, question, aware, unit, budget, which, method):
    return service.evict_run(_pair(key), context, question, aware, unit, budget, which, method)


def calibrate(key, corpus, n_fit, op_k, bits, name):
    from scdviz import plots

    calib, folder = service.calibrate_for(_pair(key), corpus, n_fit, op_k, bits, name)
    md = (f"Calibrated in {calib.stats.get('seconds_total', '?')} s and saved to `{folder}`; the SCD tab now uses it. "
          f"Patch order: {calib.patch_order}.")
    return md, plots.selection_curve(calib.selection_kl, calib.patch_order)


def load_calibration(key, folder):
    from scdviz import plots

    calib = service.load_calibration_for(_pair(key), folder)
    return f"Loaded; the SCD tab now uses it. Patch order: {calib.patch_order}.", plots.selection_curve(
        calib.selection_kl, calib.patch_order)


@gpu
def train(key, steps, contexts, per_head, name):
    from scdviz import plots

    pair = _pair(key)
    log = None
    for log in service.train_policy_live(pair.producer_source, steps, contexts, per_head, name):
        done = len((log or {}).get("steps", []))
        yield f"Training on {pair.producer_source}: {done}/{steps} REINFORCE steps.", plots.training_curve(log)
    folder = service.runs_dir(name)
    yield f"Done: {len(log['steps'])} steps; policy saved in `{folder}`.", plots.training_curve(log)


def load_results(path):
    from scdviz import plots

    df, kind = service.load_results(path)
    csv = Path(tempfile.mkdtemp(prefix="scdviz-")) / (Path(path).stem + ".csv")  # gradio serves temp files
    df.to_csv(csv, index=False)
    return f"{len(df)} {kind} records from `{Path(path).name}`.", df, plots.results_overview(df, kind), str(csv)


def _windows(n: int = 3, tokens: int = 288) -> list[str]:
    """Decoded evaluation windows of ``tokens`` tokens (the benchmark's own windows)."""
    from transformers import AutoTokenizer

    from scdviz.models import builtin

    tok = AutoTokenizer.from_pretrained(builtin.producer_dir())
    out = []
    for corpus in data.corpora():
        for w in data.token_windows(tok, data.load_split(corpus, "eval"), tokens, (n + 1) // 2):
            out.append(tok.decode(w))
    return out[:n]


def build_demo() -> gr.Blocks:
    """The whole app as a Blocks object (tests build it without launching)."""
    producer, consumers = service.builtin_choices()
    with gr.Blocks(title="scdviz") as demo:
        gr.Markdown(
            "# scdviz\nMove a KV cache from a producer model to a fine-tuned consumer (SCD) and prune it "
            "with a learned eviction policy (DistillCache), and see what happens inside both models."
        )
        pair_state = gr.State("")
        with gr.Tab("Pair"):
            pair_tab.build(
                pair_tab.PairTabFns(
                    producer_choices=[producer],
                    consumer_choices=consumers,
                    default_producer=settings.default_producer(),
                    default_consumer=settings.default_consumer(),
                    load=load,
                    generate=generate,
                    examples=_examples(),
                    max_new_tokens=settings.max_new_tokens(),
                ),
                pair_state,
                demo,
            )
        windows = _windows()
        with gr.Tab("SCD transfer"):
            scd_tab.build(scd_run, windows, pair_state)
        with gr.Tab("DistillCache eviction"):
            evict_tab.build(evict_run, _examples(3, 2000), pair_state)
        with gr.Tab("Calibrate / train"):
            train_tab.build(calibrate, load_calibration, train, data.corpora(), pair_state)
        with gr.Tab("Results"):
            files = [*settings.ASSETS_DIR.glob("scd/*/bench.json"), *settings.ASSETS_DIR.glob("policy/bench/*.json")]
            results_tab.build(load_results, [(str(p.relative_to(settings.REPO_DIR)), str(p)) for p in sorted(files)])
    demo.queue(default_concurrency_limit=1, max_size=32)
    return demo


if __name__ == "__main__":
    build_demo().launch(server_name="0.0.0.0" if settings.hosted() else "127.0.0.1")

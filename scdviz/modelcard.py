"""Write the model card (README.md + eval.json) of a built-in LoRA specialist.

    python -m scdviz model-card --name jargon --maintainer

Reads the adapter's ``train_log.json`` (written by ``python -m scdviz finetune``), measures
held-out perplexity, raw-reuse drift and its task (token F1) with ``scdviz.drift.evaluate_pair`` on every
shipped corpus, and writes both into the adapter folder. It does not train anything.
"""

from __future__ import annotations

import json

from scdviz import drift
from scdviz.finetune import TARGETS
from scdviz.models import builtin
from scdviz.models.pair import load_pair

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 48) -> str:
    """A unicode sparkline of ``values`` resampled to ``width`` buckets (bucket means)."""
    n = len(values)
    buckets = [values[i * n // width : max(i * n // width + 1, (i + 1) * n // width)] for i in range(min(width, n))]
    means = [sum(b) / len(b) for b in buckets]
    lo, hi = min(means), max(means)
    return "".join(SPARK[int((m - lo) / (hi - lo + 1e-12) * (len(SPARK) - 1))] for m in means)


def write_card(name: str, n_prompts: int = 16, prompt_len: int = 256, cont_len: int = 32) -> str:
    """Measure and write assets/adapters/<name>/{eval.json,README.md}; returns the card text."""
    folder = builtin.adapter_dir(name)
    log = json.loads((folder / "train_log.json").read_text())
    pair = load_pair(f"builtin:{builtin.PRODUCER_NAME}", f"builtin:{name}")
    report = drift.evaluate_pair(pair, n_prompts=n_prompts, prompt_len=prompt_len, cont_len=cont_len)
    (folder / "eval.json").write_text(json.dumps(report, indent=1))
    card = render(name, log, report)
    (folder / "README.md").write_text(card)
    return card


def render(name: str, log: dict, report: dict) -> str:
    """The card's markdown from a training log and an evaluate_pair report."""
    cfg = log["config"]
    targets = list(cfg.get("targets") or TARGETS)
    loss = log["loss"]
    tail = sum(loss[-5:]) / min(5, len(loss))
    every = max(1, len(loss) // 8)
    loss_rows = " · ".join(f"{i + 1}: {loss[i]:.3f}" for i in range(0, len(loss), every))
    eval_cmd = (f"python -m scdviz pair-info --consumer builtin:{name} --eval "
                f"--limit {report['corpora'][cfg['corpus']]['n_prompts']} "
                f"--prompt-len {report['prompt_len']} --cont-len {report['cont_len']}")
    task = cfg.get("task") or "text"
    layers = list(cfg.get("layers") or [])
    train_cmd = (f"python -m scdviz finetune --corpus {cfg['corpus']} --rank {cfg['rank']} --steps {cfg['steps']} "
                 f"--batch {cfg['batch']} --seq-len {cfg['seq_len']} --lr {cfg['lr']} --seed {cfg['seed']} "
                 + (f"--task {task} --answer-len {cfg['answer_len']} --text-loss {cfg.get('text_loss', 0.0)} "
                    if task != "text" else "")
                 + (f"--targets {' '.join(targets)} " if targets != TARGETS else "")
                 + (f"--layers {' '.join(map(str, layers))} " if layers else "") + f"--name {name} --maintainer")
    what = ("next-token prediction on each window" if task == "text" else
            f"the `{task}` context-QA task (scdviz.qa: {cfg['answer_len']} answer tokens after each window)"
            + (f" plus {cfg.get('text_loss')} × the window's next-token loss" if cfg.get("text_loss") else ""))
    threads = log["torch_threads"]
    where = ("Windows spread evenly through the dev slice of each shipped corpus's eval split (never used for "
             "training or calibration; the test slice is left for the benches' reports)"
             if report.get("windows") == "dev" else  # a report made before evaluate_pair spread its windows
             "Eval split of each shipped corpus (never used for training or calibration)")
    lines = [
        f"# `builtin:{name}` — a LoRA specialist of SmolLM2-135M-Instruct",
        "",
        f"A consumer for the built-in pair: the producer fine-tuned on the **{cfg['corpus']}** corpus "
        f"(assets/text/{cfg['corpus']}/train.txt.gz; provenance and licence in assets/text/README.md).",
        "",
        "## Training",
        f"- LoRA rank {cfg['rank']}, alpha {cfg['alpha'] or 2 * cfg['rank']}, on {', '.join(targets)}"
        + (f" in layers {', '.join(map(str, layers))} (the others are the producer's)" if layers else "")
        + "; adapter stored in fp16 safetensors.",
        f"- Objective: {what}.",
        f"- {cfg['steps']} steps × {cfg['batch']} windows × {cfg['seq_len']} tokens = {log['tokens_seen']:,} tokens "
        f"(of {log['train_windows_available']} windows available), AdamW lr {cfg['lr']} with {cfg['warmup']} warm-up "
        f"steps and cosine decay, seed {cfg['seed']}, fp32 on CPU, {threads} thread{'' if threads == 1 else 's'}, "
        f"{log['seconds']:.0f} s.",
        f"- Loss {loss[0]:.3f} → {tail:.3f} (mean of the last 5 steps): `{sparkline(loss)}`",
        f"- Loss by step: {loss_rows}",
        f"- Reproduce: `{train_cmd}`",
        "",
        "## Held-out measurements",
        f"{where}: {report['prompt_len']}-token "
        f"prompts + {report['cont_len']} teacher-forced continuation tokens. *Raw reuse* = the consumer continues "
        "from the producer's KV cache of the prompt; KL is mean KL(oracle ‖ raw reuse) per continuation token "
        "(± s.e. over prompts), top-1 is agreement with the oracle (the consumer's own prefill). *Producer alone* = "
        "the producer's own next-token prediction at the same positions: raw reuse tends toward it as the cache, not "
        "the weights, decides.",
        "",
        "| corpus | PPL producer | PPL specialist | cont. PPL oracle | cont. PPL raw reuse | KL raw reuse "
        "| top-1 raw reuse | top-1 producer alone | prompts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for corpus, r in report["corpora"].items():
        tag = " (in-domain)" if corpus == cfg["corpus"] else " (out-of-domain)"
        alone = f"{r['top1_producer']:.3f}" if "top1_producer" in r else "—"  # an older report did not measure it
        lines.append(
            f"| {corpus}{tag} | {r['ppl_producer']:.2f} | {r['ppl_consumer']:.2f} | {r['ppl_cont_oracle']:.2f} | "
            f"{r['ppl_cont_reuse']:.2f} | {r['kl_reuse']:.3f} ± {r['kl_reuse_se']:.3f} | {r['top1_reuse']:.3f} | "
            f"{alone} | {r['n_prompts']} |")
    scored = bool(report.get("question")) and all("qa_f1_oracle" in r for r in report["corpora"].values())
    if scored:
        own = report["question"] == task  # fine-tuned on this question, or on text (then it is asked to quote)
        lines += ["", (f"**Its task**: after each prompt the question it was fine-tuned on (`{task}`, scdviz.qa), "
                       if own else
                       f"**Quote recall** (it was fine-tuned on text, not on a question): after each prompt the "
                       f"context-QA question `{report['question']}` (scdviz.qa: continue a quote of the prompt), ")
                  + f"{report['answer_len']} greedy answer tokens scored by token F1 against the reference: the "
                  "producer alone, the specialist from its own cache (the oracle) and from the producer's (raw reuse).",
                  "", "| corpus | F1 producer alone | F1 specialist | F1 raw reuse | raw reuse ÷ specialist |",
                  "|---|---|---|---|---|"]
        for corpus, r in report["corpora"].items():
            share = f"{r['qa_f1_reuse'] / r['qa_f1_oracle']:.2f}×" if r["qa_f1_oracle"] else "—"
            lines.append(f"| {corpus} | {r['qa_f1_producer']:.3f} | {r['qa_f1_oracle']:.3f} | {r['qa_f1_reuse']:.3f} "
                         f"| {share} |")
    lines += ["", f"Reproduce every number in {'these tables' if scored else 'this table'}: `{eval_cmd}`",
              "(written by `python -m scdviz model-card --name " + name + " --maintainer`)", ""]
    return "\n".join(lines)

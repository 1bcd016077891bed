"""How far a consumer has drifted from its producer: facts, perplexities, raw-reuse drift.

``evaluate_pair`` measures, on held-out windows spread evenly through the *dev* slice of every shipped
corpus's eval split (the test slice stays for the benches' reports), or through the user's text:
  - perplexity of producer and consumer on whole windows;
  - raw KV reuse: the consumer continues from the *producer's* cache of the prompt;
    mean KL(oracle || reuse) per continuation token, top-1 agreement with the oracle
    (the consumer's own prefill), and the continuation perplexity of both;
  - the consumer's task: the context-QA question it is asked (scdviz.qa: the task it was
    fine-tuned on, else continuing a quote) about each prompt, answered greedily by the producer
    alone, the consumer from its own cache (the oracle) and the consumer from the producer's
    cache (raw reuse); token F1 against the reference.

Convention used everywhere in scdviz: a cache covers prompt[:-1]; the consumer itself
feeds the last prompt token (the first decode step) and then the continuation, so the
logits of every continuation token come from the consumer.
This module does not transfer anything cleverer than raw KV (that is scdviz.scd).
"""

from __future__ import annotations

from tqdm.auto import tqdm

from scdviz import data, metrics, qa
from scdviz.models import hf
from scdviz.models.pair import Pair


def facts_rows(pair: Pair) -> list[list[str]]:
    """[fact, producer, consumer] rows for both models' facts."""
    pf, cf = pair.producer_facts, pair.consumer_facts
    rows = [["source", pair.producer_source, pair.consumer_source]]
    rows += [[key, str(getattr(pf, key)), str(getattr(cf, key))] for key in pf.__dataclass_fields__]
    rows.append(["fp16 KV bytes/token", str(pf.kv_bytes_per_token_fp16), str(cf.kv_bytes_per_token_fp16)])
    return rows


def facts_table(pair: Pair) -> str:
    """Producer and consumer facts side by side as aligned text."""
    rows = [["", "producer", "consumer"], *facts_rows(pair)]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows)


TASK = ("qa_f1_producer", "qa_f1_oracle", "qa_f1_reuse")  # evaluate_pair's task columns (token F1)


def reuse_drift(pair: Pair, window: list[int], cont_len: int, item: qa.QAItem | None = None) -> dict:
    """Per-token KL/top-1/NLL of raw producer-KV reuse vs the oracle on one window; with ``item`` (a question
    about the prompt, asked after its last token) also the token F1 of the producer alone, the oracle and raw
    reuse answering it."""
    prefix, fed, targets = data.split_prompt(window, cont_len)
    start = prefix.shape[1]
    oracle_cache = hf.forward(pair.consumer, prefix).cache
    producer_cache = hf.forward(pair.producer, prefix).cache
    answers = {}
    if item is not None:  # each answer from its own copy: answering and continuing both append to a cache
        for key, model, cache in (("qa_f1_producer", pair.producer, producer_cache),
                                  ("qa_f1_oracle", pair.consumer, oracle_cache),
                                  ("qa_f1_reuse", pair.consumer, producer_cache)):
            answers[key] = qa.answer(model, hf.clone_cache(model, cache), item, start)["qa_f1"]
    oracle = hf.continue_logits(pair.consumer, oracle_cache, fed, start)[0]
    own = hf.forward(pair.producer, hf.ids_tensor(window[:-1])).logits[0, start:]  # the producer alone, same positions
    reuse = hf.continue_logits(pair.consumer, producer_cache, fed, start)[0]
    targets = targets[0].to(oracle.device)
    return {
        "kl": metrics.kl_per_token(oracle, reuse).tolist(),
        "top1": metrics.top1_agreement(oracle, reuse).tolist(),
        "kl_producer": metrics.kl_per_token(oracle, own).tolist(),
        "top1_producer": metrics.top1_agreement(oracle, own).tolist(),
        "nll_oracle": metrics.nll_per_token(oracle, targets).tolist(),
        "nll_reuse": metrics.nll_per_token(reuse, targets).tolist(),
        **answers,
    }


def window_nll(model, window: list[int]) -> list[float]:
    """Next-token NLL of every position of a window (teacher-forced, one pass)."""
    ids = hf.ids_tensor(window)
    logits = hf.forward(model, ids[:, :-1]).logits[0]
    return metrics.nll_per_token(logits, ids[0, 1:].to(logits.device)).tolist()


def evaluate_pair(
    pair: Pair, n_prompts: int = 16, prompt_len: int = 256, cont_len: int = 32, corpora: list[str] | None = None,
    texts: str | None = None,
) -> dict:
    """Perplexities, raw-reuse drift and the consumer's task on ``n_prompts`` windows spread through the dev slice
    of the given (default: every shipped) corpora's eval split, or through the user's text (reported as corpus
    "texts")."""
    kind = qa.kind_for(pair.consumer_source)
    report = {
        "producer": pair.producer_source,
        "consumer": pair.consumer_source,
        "prompt_len": prompt_len,
        "cont_len": cont_len,
        "question": kind,
        "answer_len": qa.ANSWER_LEN,
        "windows": "texts" if texts else "dev",  # spread through the user's text, or through each dev slice
        "corpora": {},
    }
    for corpus in ["texts"] if texts else corpora or data.corpora():
        length = prompt_len + cont_len
        try:
            windows = ([w.ids for w in data.eval_windows(pair.tokenizer, corpus, "dev", length, n_prompts)]
                       if not texts else
                       data.token_windows(pair.tokenizer, data.passages(corpus, "eval", texts), length, n_prompts,
                                          spread=True))
        except ValueError:  # eval_windows: the slice has no window this long
            windows = []
        if not windows:
            raise ValueError(f"the eval split of {texts or corpus} has no window of {prompt_len + cont_len} tokens; "
                             "give more text or lower --prompt-len")
        acc: dict[str, list[float]] = {k: [] for k in ("kl", "top1", "nll_oracle", "nll_reuse", "prod", "cons",
                                                  "kl_producer", "top1_producer", *TASK)}
        per_prompt_kl = []
        for i, window in enumerate(tqdm(windows, desc=f"eval {corpus}")):
            item = qa.prompt_item(pair.tokenizer, window[: len(window) - cont_len], i, kind=kind)
            drift = reuse_drift(pair, window, cont_len, item)
            for key in TASK:
                acc[key].append(drift[key])
            for key in ("kl", "top1", "nll_oracle", "nll_reuse", "kl_producer", "top1_producer"):
                acc[key] += drift[key]
            per_prompt_kl.append(sum(drift["kl"]) / len(drift["kl"]))
            acc["prod"] += window_nll(pair.producer, window)
            acc["cons"] += window_nll(pair.consumer, window)
        kl, kl_se = metrics.mean_se(per_prompt_kl)
        report["corpora"][corpus] = {
            "ppl_producer": round(metrics.perplexity(acc["prod"]), 3),
            "ppl_consumer": round(metrics.perplexity(acc["cons"]), 3),
            "ppl_cont_oracle": round(metrics.perplexity(acc["nll_oracle"]), 3),
            "ppl_cont_reuse": round(metrics.perplexity(acc["nll_reuse"]), 3),
            "kl_reuse": round(kl, 4),
            "kl_reuse_se": round(kl_se, 4),
            "top1_reuse": round(sum(acc["top1"]) / len(acc["top1"]), 4),
            "kl_producer": round(sum(acc["kl_producer"]) / len(acc["kl_producer"]), 4),
            "top1_producer": round(sum(acc["top1_producer"]) / len(acc["top1_producer"]), 4),
            **{key: round(sum(acc[key]) / len(acc[key]), 4) for key in TASK},
            "n_prompts": len(windows),
            "n_cont_tokens": len(acc["kl"]),
        }
    return report


def report_table(report: dict) -> str:
    """The evaluate_pair report as a plain-text table."""
    cols = ["ppl_producer", "ppl_consumer", "ppl_cont_oracle", "ppl_cont_reuse", "kl_reuse", "kl_reuse_se",
            "top1_reuse", "top1_producer", *TASK, "n_prompts"]
    lines = [f"consumer {report['consumer']} vs producer {report['producer']} "
             f"(prompt {report['prompt_len']} + {report['cont_len']} teacher-forced tokens; task: the "
             f"{report['question']!r} question, {report['answer_len']} answer tokens, token F1)"]
    lines.append("corpus".ljust(8) + "".join(c.rjust(16) for c in cols))
    for corpus, row in report["corpora"].items():
        lines.append(corpus.ljust(8) + "".join(str(row[c]).rjust(16) for c in cols))
    return "\n".join(lines)

"""A context-QA task built from the shipped text: recall a passage of the context.

Each item asks the model to continue a quote from the context after the context:
``<context> \\n\\nFrom the text above: "<12 context tokens>`` and the answer is the next
``answer_len`` context tokens. With the full cache a model copies them (induction); after
eviction (DistillCache) or a cache transfer (SCD) it can only if the cache still holds what
it needs. Accuracy = the first greedy token equals the first answer token; ``qa_f1`` is
token-F1 over ``answer_len`` greedy tokens. Positions are spread over the middle third of
the context. Shared by both methods' benches; no models are loaded here.

Two kinds of question (``KINDS``): ``quote`` (above: continue the quote, which a model's
induction heads already do) and ``before`` (backward recall: ``<context> \n\nIn the text
above, the words before "<12 context tokens>", nearest first:`` and the answer is the
``answer_len`` context tokens before the quote, last one first), which the built-in producer
cannot do and a specialist can be trained to (``finetune --task before``).
"""

from __future__ import annotations

from dataclasses import dataclass

from scdviz import metrics
from scdviz.models import hf
from scdviz.models import pair as pairmod

CUE = 12  # context tokens quoted in the question
LEAD = '\n\nFrom the text above: "'  # what the question says before the quote
BEFORE = ('\n\nIn the text above, the words before "', '", nearest first:')  # backward recall: around the quote
KINDS = ("quote", "before")
ANSWER_LEN = 8  # answer tokens the benches, pair-info and finetune ask for by default


def kind_for(consumer_source: str, asked: str | None = None) -> str:
    """The question a consumer is asked: ``asked``, else the task it was fine-tuned on when that is one of ``KINDS``
    (a specialist is measured and calibrated on the task it was trained for), else quote."""
    task = asked or pairmod.training_log(consumer_source).get("config", {}).get("task")
    return task if task in KINDS else "quote"


def question_tokens(tokenizer, kind: str, cue: list[int]) -> list[int]:
    """The question of ``kind`` about the quoted ``cue`` tokens, as ``make_item`` asks it (the answer follows it)."""
    if kind == "before":
        head, tail = (tokenizer(x, add_special_tokens=False)["input_ids"] for x in BEFORE)
        return head + list(cue) + tail
    return tokenizer(LEAD, add_special_tokens=False)["input_ids"] + list(cue)


@dataclass
class QAItem:
    """One question about a context."""

    question: list[int]  # tokens fed after the (compressed) context
    answer: list[int]  # reference continuation (context tokens)


def make_item(tokenizer, context: list[int], index: int, answer_len: int = 3, pending: list[int] = (),
              kind: str = "quote") -> QAItem:
    """The question for the ``index``-th context: quote CUE tokens, answer the next answer_len (``quote``) or the
    answer_len before the quote, nearest first (``before``).

    pending: context tokens not yet in the cache the question is asked from (SCD's caches
    hold the prompt but its last token); they are fed first, as part of the question.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown question kind {kind!r}; use one of {KINDS}")
    t = len(context)
    third = max(1, t // 3)
    p = third + (index * 37) % third
    if kind == "before":
        p = max(CUE + answer_len, min(p, t))
        return QAItem(question=list(pending) + question_tokens(tokenizer, kind, context[p - CUE : p]),
                      answer=context[p - CUE - answer_len : p - CUE][::-1])
    p = max(CUE, min(p, t - answer_len))
    return QAItem(question=list(pending) + question_tokens(tokenizer, kind, context[p - CUE : p]),
                  answer=context[p : p + answer_len])


def prompt_item(tokenizer, prompt: list[int], index: int, answer_len: int = ANSWER_LEN, kind: str = "quote") -> QAItem:
    """``make_item`` about a prompt whose cache holds all but its last token (the convention of every transfer
    here): that token is fed first, as part of the question, and the answer starts after ``len(prompt) - 1``."""
    return make_item(tokenizer, prompt, index, answer_len, pending=prompt[-1:], kind=kind)


def answer(model, cache, item: QAItem, start: int) -> dict:
    """Greedy answer from a (possibly pruned) cache of ``start`` context tokens: its tokens (``answer``), correct
    and F1."""
    ids = hf.ids_tensor(item.question)
    got = hf.generate(model, cache, ids, start, len(item.answer))
    return {"answer": got, "qa_correct": float(got[:1] == item.answer[:1]), "qa_f1": metrics.token_f1(got, item.answer)}

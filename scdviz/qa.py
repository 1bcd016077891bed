"""A context-QA task built from the shipped text: recall a passage of the context.

Each item asks the model to continue a quote from the context after the context:
``<context> \\n\\nFrom the text above: "<12 context tokens>`` and the answer is the next
``answer_len`` context tokens. With the full cache a model copies them (induction); after
eviction (DistillCache) or a cache transfer (SCD) it can only if the cache still holds what
it needs. Accuracy = the first greedy token equals the first answer token; ``qa_f1`` is
token-F1 over ``answer_len`` greedy tokens. Positions are spread over the middle third of
the context. Shared by both methods' benches; no models are loaded here.
"""

from __future__ import annotations

from dataclasses import dataclass

from scdviz import metrics
from scdviz.models import hf

CUE = 12  # context tokens quoted in the question
LEAD = '\n\nFrom the text above: "'  # what the question says before the quote


@dataclass
class QAItem:
    """One question about a context."""

    question: list[int]  # tokens fed after the (compressed) context
    answer: list[int]  # reference continuation (context tokens)


def make_item(tokenizer, context: list[int], index: int, answer_len: int = 3, pending: list[int] = ()) -> QAItem:
    """The question for the ``index``-th context: quote CUE tokens, answer the next answer_len.

    pending: context tokens not yet in the cache the question is asked from (SCD's caches
    hold the prompt but its last token); they are fed first, as part of the question.
    """
    t = len(context)
    third = max(1, t // 3)
    p = third + (index * 37) % third
    p = max(CUE, min(p, t - answer_len))
    lead = tokenizer(LEAD, add_special_tokens=False)["input_ids"]
    return QAItem(question=list(pending) + lead + context[p - CUE : p], answer=context[p : p + answer_len])


def answer(model, cache, item: QAItem, start: int) -> dict:
    """Greedy answer from a (possibly pruned) cache of ``start`` context tokens: correct and F1."""
    ids = hf.ids_tensor(item.question)
    got = hf.generate(model, cache, ids, start, len(item.answer))
    return {"qa_correct": float(got[:1] == item.answer[:1]), "qa_f1": metrics.token_f1(got, item.answer)}

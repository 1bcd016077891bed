"""One text through every SCD method, as the SCD tab shows it (the DistillCache twin is
``scdviz.evict.view``).

``transfer_view(pair, codec, text)`` makes one benchmark window of the text (its last
``cont_len`` tokens the teacher-forced continuation) and runs ``scdviz.scd.bench.bench`` on
it, so its numbers equal ``python -m scdviz bench scd`` on that window. No sweeps over
held-out text here (``bench.run``), except the tail and raw-layer sweeps asked for.
"""

from __future__ import annotations

from scdviz import qa, settings
from scdviz.models.pair import Pair
from scdviz.progress import Reporter
from scdviz.scd import bench, calibration
from scdviz.scd.codec import Codec
from scdviz.scd.plan import Plan


def window_of(pair: Pair, text: str, cont_len: int, max_tokens: int) -> list[int]:
    """Token ids of ``text`` as one benchmark window (prompt + continuation)."""
    if not text or not text.strip():
        raise ValueError("the prompt is empty")
    ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < cont_len + 16:
        raise ValueError(f"the text has {len(ids)} tokens; SCD needs at least {cont_len + 16} "
                         f"(a prompt of 16+ tokens and {cont_len} continuation tokens to score)")
    if len(ids) > max_tokens:
        raise ValueError(f"the text has {len(ids)} tokens; this app accepts at most {max_tokens}")
    return list(ids)


def question_of(pair: Pair, window: list[int], cont_len: int, answer_len: int = qa.ANSWER_LEN) -> tuple[str, qa.QAItem]:
    """The consumer's question about a window's prompt as ``transfer_view`` asks it with ``qa_answer_len`` (the
    bench's first context-QA item, ``qa.prompt_item``; ``bench.qa_kind``: its fine-tuning task, else continuing a
    quote): (its kind, the item). ValueError for a prompt too short to quote from (the quote is taken from its
    middle third)."""
    prompt = window[: len(window) - cont_len]
    need = 3 * (qa.CUE + answer_len)
    if len(prompt) < need:
        raise ValueError(f"the prompt has {len(prompt)} tokens; asking the consumer's question needs at least {need} "
                         f"(a longer text, or do not ask it)")
    kind = bench.qa_kind(bench.ScdBenchConfig(), pair)
    return kind, qa.prompt_item(pair.tokenizer, prompt, 0, answer_len, kind)


EXTRA = ("tails", "qa_answer_len")  # the ScdBenchConfig fields transfer_view's ``extra`` sets


def transfer_view(pair: Pair, calib: calibration.Calibration | Codec, text: str, plan: Plan | None = None,
               cont_len: int = 32, gen_tokens: int = 24, budget: float | None = None, coder: str = "transform",
               progress: bool | Reporter = False, extra: dict | None = None) -> bench.BenchReport:
    """The SCD tab's view of one text: ``bench`` on the one window made from it.

    Its last ``cont_len`` tokens are the teacher-forced continuation, so the numbers equal
    ``python -m scdviz bench scd`` on the same window and settings; ``plan`` is SCD full
    (e.g. from ``plan.user_plan``), or with ``budget`` the ``coder`` plan for this text's length (``budget_plan``).
    ``calib`` may be a ``Codec``: its calibration, and its plan as SCD full. ``progress``: a reporter
    (``scdviz.progress``) told each method as it runs. ``extra``: the ``ScdBenchConfig`` fields set beyond
    these (``EXTRA``): the bench's sweeps ``{"tails": [32]}`` (raw KV and SCD reuse-only with the consumer
    recomputing the last 32 prompt tokens itself) and ``{"qa_answer_len": 8}``: each method also answers the
    consumer's question about the prompt (``question_of``: the bench's first context-QA item), its tokens in
    ``qa_answers`` and its token-F1 in ``qa_f1``. A text of more tokens than ``SCDVIZ_MAX_PROMPT_TOKENS``
    (default 1024) is refused before any work.
    """
    if isinstance(calib, Codec):
        calib, plan = calib.calibration, calib.plan
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA))
    if unknown:
        raise ValueError(f"transfer_view sets {list(EXTRA)}; not {unknown}")
    window = window_of(pair, text, cont_len, settings.max_prompt_tokens())
    if extra.get("qa_answer_len"):
        question_of(pair, window, cont_len, extra["qa_answer_len"])  # refuses a prompt too short to quote from
    cfg = bench.ScdBenchConfig(cont_len=cont_len, gen_tokens=gen_tokens, sweeps=False, budget=budget, coder=coder,
                               sent_rows=False, qa_answer_len=extra.pop("qa_answer_len", 0),
                               **{k: list(v) for k, v in extra.items()})
    return bench.bench(pair, calib, [window], cfg, pair.consumer_source, progress=progress, scd_full=plan)

"""The app's loaded pairs and the Pair tab's work: the shared LRU of pairs, prompts, generation.

Loaded models are heavy and shared by every user of a running app (an LRU of a few
pairs); each request works on its own caches, and ``scdviz.models.hf`` serialises the
model work that installs hooks, so concurrent requests never see each other's tensors.
Per-user artefacts (calibrations, policies, run folders) live in a ``Session`` held in
``gr.State``; shipped artefacts are loaded read-only. Every user mistake raises
``UserError`` with a specific message, checked (``scdviz.app.inputs``) before work starts.
The tabs' work is in ``scd``, ``evict``, ``train`` and ``results`` beside this module.
These modules import torch but not gradio; the UI modules import gradio but not torch.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from scdviz import settings
from scdviz.app import hosting, inputs
from scdviz.app.inputs import UserError
from scdviz.app.requests import GenerateRequest
from scdviz.models import hf
from scdviz.models.pair import Pair, PairError, load_pair
from scdviz.progress import steps

_PAIRS: OrderedDict[tuple[str, str], Pair] = OrderedDict()
_LOCK = threading.Lock()  # guards _PAIRS and _LOADING only (never held while a model loads)
_LOADING: dict[tuple[str, str], threading.Lock] = {}  # one lock per pair being loaded


def _fresh_locks() -> None:
    """In a forked child (a ZeroGPU worker): locks of its own, never one another thread of the parent held at the
    fork (a copy of a held lock is never released there)."""
    global _LOCK
    _LOCK = threading.Lock()
    _LOADING.clear()


os.register_at_fork(after_in_child=_fresh_locks)
# pairs kept in memory at once (each ~1 GB in fp32 for the built-in pair): the producer with every built-in specialist
MAX_PAIRS = 3


def builtin_choices() -> tuple[str, list[str]]:
    """(producer source, consumer sources) of the built-in pair."""
    producer, *consumers = hosting.builtin_sources()
    return producer, consumers


def get_pair(producer, consumer, progress=None) -> Pair:
    """The loaded pair for these sources, loading (and caching) it on first request.

    Sources are checked (scdviz.app.hosting: hosted mode's rules, hub ids probed) before anything
    loads. Only requests for the *same* pair wait for its load; everyone else's pairs stay
    available meanwhile.
    """
    hub = []
    for what, source in (("producer", producer), ("consumer", consumer)):
        if not isinstance(source, str) or not source.strip():
            raise UserError(f"choose a {what}")
        try:
            kind, name = hosting.check_source(source)
        except UserError as err:
            raise UserError(f"{what}: {err}") from None
        hub += [name] if kind == "hub" else []
    key = (producer.strip(), consumer.strip())
    with _LOCK:
        if key in _PAIRS:
            _PAIRS.move_to_end(key)
            return _PAIRS[key]
        loading = _LOADING.setdefault(key, threading.Lock())
    with loading:
        with _LOCK:
            if key in _PAIRS:
                return _PAIRS[key]
        try:
            for repo_id in hub:  # in seconds, rather than after transformers' own retries
                hosting.probe_hub(repo_id)
            pair = load_pair(*key, progress=progress)
        except PairError as err:
            raise UserError(str(err)) from None
        finally:
            with _LOCK:
                _LOADING.pop(key, None)
        with _LOCK:
            _PAIRS[key] = pair
            while len(_PAIRS) > MAX_PAIRS:
                _PAIRS.popitem(last=False)
        return pair


def text_field(value, field: str, required: bool = True) -> str:
    """A text field capped in characters before any tokenizer sees it."""
    return inputs.text(value, field, settings.max_prompt_chars(), required)


def encode_prompt(pair: Pair, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt, checked against the configured length limits (characters first)."""
    prompt = text_field(prompt, "the prompt")
    if chat:
        messages = [{"role": "user", "content": prompt}]
        ids = pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # a BatchEncoding (transformers 5) or a dict holds the ids under input_ids; older versions return a list
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    else:
        ids = pair.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    limit = settings.max_prompt_tokens()
    if len(ids) > limit:
        raise UserError(f"the prompt has {len(ids)} tokens; this app accepts at most {limit} "
                        f"(SCDVIZ_MAX_PROMPT_TOKENS)")
    if len(ids) < 2:
        raise UserError("the prompt needs at least 2 tokens")
    return list(ids)


@dataclass
class Generation:
    """Greedy continuations of one prompt by producer and consumer."""

    prompt_tokens: int  # tokens in the prompt
    producer_ids: list[int]  # generated by the producer from its own prefill
    consumer_ids: list[int]  # generated by the consumer from its own prefill (the oracle)
    producer_text: str  # decoded producer_ids
    consumer_text: str  # decoded consumer_ids
    seconds: float  # wall time for both
    stopped_at_turn_end: bool = False  # a chat generation that ended its turn (the end token is not shown)


def end_of_turn(tokenizer) -> int | None:
    """The token a chat template closes an assistant turn with (``<|im_end|>`` for ChatML), or None: the first
    token the template puts after a rendered assistant message, when it is a special or added token."""
    marker = "scdviz-turn-marker"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - no chat template (a base model): no turn to end
        return None
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        return None
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())  # <|im_end|> is often only
    return ids[0] if ids[0] in special else None  # an added token, not a "special" one


def generate_both(pair: Pair, request: GenerateRequest, progress=False) -> Generation:
    """Greedy generation from the producer and the consumer, each from its own prefill (``progress``: a
    reporter, ``scdviz.progress``, told each model)."""
    req = request.checked()
    max_new_tokens = req.new_tokens
    ids = encode_prompt(pair, req.prompt, req.chat)
    t0 = time.perf_counter()
    prefix, last = hf.ids_tensor(ids[:-1]), hf.ids_tensor(ids[-1:])  # cache covers prompt[:-1]
    turn = end_of_turn(pair.tokenizer) if req.chat else None
    stops = [t for t in (pair.tokenizer.eos_token_id, turn) if t is not None]
    outs = []
    for _name, model in steps((("producer", pair.producer), ("consumer", pair.consumer)), "generate", progress,
                             name=lambda item: item[0]):
        with hf.exclusive(model):  # prefill + decode of this request back to back
            cache = hf.forward(model, prefix).cache
            outs.append(hf.generate(model, cache, last, len(ids) - 1, max_new_tokens, stops))
    ended = turn is not None and any(out[-1:] == [turn] for out in outs)
    outs = [out[:-1] if turn is not None and out[-1:] == [turn] else out for out in outs]  # the end is not text
    decode = pair.tokenizer.decode
    return Generation(len(ids), outs[0], outs[1], decode(outs[0]), decode(outs[1]), time.perf_counter() - t0,
                      ended)


def pair_summary(pair: Pair) -> str:
    """Markdown: load time, device and the compatibility verdict."""
    return (
        f"**Compatible**: {pair.producer_source} → {pair.consumer_source} share architecture, "
        f"shapes, RoPE and tokenizer. Loaded in {pair.load_seconds:.1f} s on `{pair.device}` ({pair.dtype})."
    )

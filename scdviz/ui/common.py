"""Shared UI helpers: turn library errors into messages a person can act on."""

from __future__ import annotations

import functools
import inspect
import logging

import gradio as gr

log = logging.getLogger("scdviz.ui")


def guard(fn):
    """Wrap a handler so user errors show as a message and nothing shows a traceback.

    ValueError (UserError, PairError, bad ranges) keeps its own message; anything else is
    logged on the server with its traceback and reported to the user in one line.
    """

    def translate(err: Exception) -> gr.Error:
        if isinstance(err, gr.Error):
            return err
        if isinstance(err, ValueError):
            return gr.Error(str(err), print_exception=False)
        log.exception("handler %s failed", fn.__name__)
        return gr.Error(f"internal error ({type(err).__name__}): {err}", print_exception=False)

    if inspect.isgeneratorfunction(fn):  # streaming handlers (live plots)

        @functools.wraps(fn)
        def gen_wrapper(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - the server must survive any handler failure
                raise translate(err) from None

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - the server must survive any handler failure
            raise translate(err) from None

    return wrapper


def diff_tokens(tokens: list[str], reference: list[str], label: str = "differs") -> list[tuple[str, str | None]]:
    """(text, label) pairs for gr.HighlightedText: tokens that differ from the reference at the same position."""
    return [(tok, None if i < len(reference) and reference[i] == tok else label) for i, tok in enumerate(tokens)]

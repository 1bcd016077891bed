"""Progress of long loops, one way for the CLI and the app: a tqdm bar, nothing, or a reporter.

The library's long loops iterate through ``steps(items, desc, progress)``. ``progress`` is

- ``True``: a tqdm bar (the CLI);
- ``False``: nothing (tests, inner loops);
- a callable ``report(desc, done, total)``: called before each item and after the last. The app
  passes one that shows the step in the page and raises ``Stopped`` once the visitor cancelled,
  so a cancelled calibration or training ends at its next step instead of running on.

This module imports neither torch nor gradio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from tqdm.auto import tqdm

Reporter = Callable[[str, int, int], None]


class Stopped(Exception):
    """Raised by a reporter to end the work it follows (the visitor cancelled, the page closed)."""


def steps(items: Iterable, desc: str, progress: bool | Reporter = True, total: int | None = None,
          name: Callable | None = None) -> Iterator:
    """``items`` one by one, with progress shown as ``progress`` says (module docstring); ``name(item)``
    adds what each step is to a reporter's ``desc`` (``methods: SCD full``). With a bool, the tqdm bar
    itself (a caller may ``set_postfix`` on it)."""
    if not callable(progress):
        return tqdm(items, desc=desc, total=total, disable=not progress)
    return _reported(items, desc, progress, total, name)


def _reported(items: Iterable, desc: str, progress: Reporter, total: int | None, name: Callable | None) -> Iterator:
    items = list(items) if total is None else items
    n = len(items) if total is None else total
    done = 0
    for item in items:
        progress(f"{desc}: {name(item)}" if name is not None else desc, done, n)
        yield item
        done += 1
    progress(desc, done, n)



def tell(progress: bool | Reporter, desc: str, done: int, total: int) -> None:
    """Tell a reporter one phase of work that is not a loop; a bool shows nothing."""
    if callable(progress):
        progress(desc, done, total)

"""Hosted mode's rules in one place: which model sources and paths a request may name.

A public demo (``SCDVIZ_HOSTED=1``) is used by strangers, so every string a request can
turn into a file-system or network access passes through here:

* ``check_source`` classifies a model source (``scdviz.models.pair.source_kind``) and applies
  hosted mode's rules: only the shipped built-in models load (the producer and its specialists,
  whose weights come with the app; not a built-in base that would be fetched first); local
  folders are refused; hub ids are refused unless listed in ``SCDVIZ_HUB_ALLOW``. The app checks
  here before the library loads.
* ``probe_hub`` answers within seconds whether a hub id can be fetched (before any lock
  other users need is taken and before transformers' own long retries).
* ``user_folder`` / ``user_file`` check a folder or file a user names (a calibration to
  load, a benchmark record to open): refused when hosted unless inside the allowed roots.

Per-session folders and what a visitor may write are ``scdviz.app.session``. This module
imports neither torch nor gradio.
"""

from __future__ import annotations

from pathlib import Path

from scdviz import settings
from scdviz.app import inputs
from scdviz.errors import UserError
from scdviz.models import builtin, pair
from scdviz.models.pair import PairError

MAX_SOURCE_CHARS = 300


def builtin_sources() -> list[str]:
    """Every ``builtin:NAME`` source: the producer first, then the shipped specialists."""
    return [f"builtin:{n}" for n in (builtin.PRODUCER_NAME, *builtin.specialists())]


def check_source(source) -> tuple[str, str]:
    """(kind, what) for a model source string: ('builtin', NAME), ('local', PATH) or ('hub', ID).

    Raises UserError naming what is accepted (in hosted mode: built-in names and the hub
    allow-list only). The app checks every source here before the library loads it.
    """
    if not isinstance(source, str) or not source.strip():
        raise UserError("empty model source; choose a built-in model, or type a model folder or hub id")
    source = source.strip()
    if len(source) > MAX_SOURCE_CHARS:
        raise UserError(f"a model source has at most {MAX_SOURCE_CHARS} characters, got {len(source):,}")
    inputs.unicode_text(source, "the model source")
    if settings.hosted() and source.startswith("builtin:") and source not in builtin_sources():
        name = source.split(":", 1)[1]
        if name in builtin.BASES:  # a built-in base the app would first fetch and convert: local installs only
            raise UserError(f"this hosted demo loads only the models shipped with it ({', '.join(builtin_sources())});"
                            f" {source} is fetched on first use and runs in a local install")
        raise UserError(f"unknown built-in model {name[:60]!r}; this hosted demo loads {', '.join(builtin_sources())}")
    if settings.hosted() and not source.startswith("builtin:"):
        if pair.looks_local(source) or not pair.HUB_ID.fullmatch(source):
            raise UserError(f"this hosted demo loads only built-in models ({', '.join(builtin_sources())})"
                            + (f" and these hub models: {', '.join(settings.hub_allow())}"
                               if settings.hub_allow() else "")
                            + "; local folders are not available here")
        if source not in settings.hub_allow():
            allowed = ", ".join(settings.hub_allow()) or "none"
            raise UserError(f"this hosted demo loads hub models only from its allow-list (SCDVIZ_HUB_ALLOW: "
                            f"{allowed}); {source!r} is not on it")
        return "hub", source
    try:
        return pair.source_kind(source)
    except PairError as err:
        raise UserError(str(err)) from None


def probe_hub(repo_id: str, timeout: float | None = None) -> None:
    """Return if ``repo_id`` is in the local HF cache or answers on the hub within ``timeout`` s.

    Raises UserError otherwise, in seconds rather than after transformers' retries.
    """
    import huggingface_hub as hub

    cached = hub.try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return
    if hub.constants.HF_HUB_OFFLINE:
        raise UserError(f"{repo_id} is not in the local model cache and this machine is offline (HF_HUB_OFFLINE)")
    timeout = settings.hub_timeout() if timeout is None else timeout
    try:
        hub.HfApi().model_info(repo_id, timeout=timeout)
    except hub.errors.RepositoryNotFoundError:
        raise UserError(f"no model {repo_id!r} on the hub (or it is private)") from None
    except Exception as err:  # noqa: BLE001 - network errors of every kind end the same way
        raise UserError(f"could not reach the hub for {repo_id!r} within {timeout:g} s "
                        f"({type(err).__name__}); check the id and the network") from None


def user_folder(path, what: str, roots: tuple[Path, ...] = ()) -> Path:
    """A folder a user named (e.g. a saved calibration): hosted mode allows only ``roots``."""
    return _user_path(path, what, roots, folder=True)


def user_file(path, what: str, roots: tuple[Path, ...] = ()) -> Path:
    """A file a user named or uploaded (e.g. a benchmark record): hosted mode allows only ``roots``."""
    return _user_path(path, what, roots, folder=False)


def _user_path(path, what: str, roots: tuple[Path, ...], folder: bool) -> Path:
    if not isinstance(path, str | Path) or not str(path).strip():
        raise UserError(f"no {what} given")
    if len(str(path)) > 1000:
        raise UserError(f"the {what} path is too long")
    inputs.unicode_text(str(path), f"the {what} path")
    resolved = Path(str(path).strip()).expanduser().resolve()
    inside = any(resolved.is_relative_to(Path(r).resolve()) for r in roots)
    if settings.hosted() and not inside:
        raise UserError(f"this hosted demo does not read local paths; the {what} must be one offered here")
    if folder and not resolved.is_dir():
        raise UserError(f"{resolved} is not a folder (the {what})")
    if not folder and not resolved.is_file():
        raise UserError(f"{resolved} is not a file (the {what})")
    return resolved

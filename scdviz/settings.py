"""Settings read from environment variables (for hosted use); nothing else.

Every knob a hosted demo may want to change lives here, read lazily so that tests can
monkeypatch the environment. This module does not load models.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
# shipped, read-only artefacts: beside the checkout, or inside an installed package (scdviz/assets)
ASSETS_DIR = REPO_DIR / "assets" if (REPO_DIR / "assets" / "adapters").is_dir() else PACKAGE_DIR / "assets"


def cache_dir() -> Path:
    """Folder for converted weights and, by default, runs: SCDVIZ_CACHE, else $XDG_CACHE_HOME/scdviz,
    else ~/.cache/scdviz (the platform cache folder, as HF_HOME's default follows it)."""
    path = os.environ.get("SCDVIZ_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scdviz"
    return Path(path).expanduser()


def work_dir() -> Path:
    """Folder for runs (``runs/<kind>/<name>``, see scdviz.runs) and per-session folders (SCDVIZ_WORK,
    default the cache folder). On a Space,
    point it at persistent storage (e.g. /data) to keep local-mode runs across restarts."""
    path = os.environ.get("SCDVIZ_WORK")
    return Path(path).expanduser() if path else cache_dir()


def device_name() -> str:
    """Requested device: 'auto' (CUDA when present), 'cpu' or 'cuda' (SCDVIZ_DEVICE)."""
    return os.environ.get("SCDVIZ_DEVICE", "auto").lower()


def hosted() -> bool:
    """Hosted (public demo) mode: no local paths, hub ids only from an allow-list, per-session
    folders (SCDVIZ_HOSTED=1). The rules themselves are in scdviz.app.hosting."""
    return os.environ.get("SCDVIZ_HOSTED", "0").lower() in ("1", "true", "yes")


def max_prompt_tokens() -> int:
    """Longest prompt the app accepts (SCDVIZ_MAX_PROMPT_TOKENS)."""
    return int(os.environ.get("SCDVIZ_MAX_PROMPT_TOKENS", "1024"))


def hosted_methods() -> int:
    """Eviction methods one request may compare in hosted mode (SCDVIZ_HOSTED_METHODS; the focused set is 6), so
    that no request holds the eviction worker for minutes (all 25 on a 1,020-token context: 147 s on 2 cores)."""
    return int(os.environ.get("SCDVIZ_HOSTED_METHODS", "6"))


def hosted_context_tokens() -> int:
    """Longest eviction context (with its question) one request may send in hosted mode
    (SCDVIZ_HOSTED_CONTEXT_TOKENS)."""
    return int(os.environ.get("SCDVIZ_HOSTED_CONTEXT_TOKENS", "600"))


def max_new_tokens() -> int:
    """Most tokens the app generates per request (SCDVIZ_MAX_NEW_TOKENS)."""
    return int(os.environ.get("SCDVIZ_MAX_NEW_TOKENS", "64"))


def default_producer() -> str:
    """Producer source the app loads first (SCDVIZ_PRODUCER)."""
    return os.environ.get("SCDVIZ_PRODUCER", "builtin:smollm2-135m")


def default_consumer() -> str:
    """Consumer source the app loads first (SCDVIZ_CONSUMER)."""
    return os.environ.get("SCDVIZ_CONSUMER", "builtin:austen-before")


def threads() -> int | None:
    """Fixed CPU thread count (SCDVIZ_THREADS); None means: choose by measurement."""
    value = os.environ.get("SCDVIZ_THREADS")
    return int(value) if value else None


def max_prompt_chars() -> int:
    """Longest text field in characters, checked before tokenising (SCDVIZ_MAX_PROMPT_CHARS).

    Default: 16 characters per allowed prompt token (English averages about 4.5).
    """
    return int(os.environ.get("SCDVIZ_MAX_PROMPT_CHARS") or 16 * max_prompt_tokens())


def hub_allow() -> list[str]:
    """Hub ids a hosted demo may load (SCDVIZ_HUB_ALLOW, comma-separated; default none)."""
    return [s.strip() for s in os.environ.get("SCDVIZ_HUB_ALLOW", "").split(",") if s.strip()]


def hub_timeout() -> float:
    """Seconds to wait for the hub to answer about a model id (SCDVIZ_HUB_TIMEOUT)."""
    return float(os.environ.get("SCDVIZ_HUB_TIMEOUT", "5"))


def max_upload_mb() -> int:
    """Largest uploaded file in MB (SCDVIZ_MAX_UPLOAD_MB)."""
    return int(os.environ.get("SCDVIZ_MAX_UPLOAD_MB", "8"))


def max_session_runs() -> int:
    """Runs (calibrations, policies) one session (one open page) may make per SCDVIZ_SESSION_TTL, and keep, in
    hosted mode (SCDVIZ_MAX_SESSION_RUNS); all sessions of one address together stop at max_address_runs."""
    return int(os.environ.get("SCDVIZ_MAX_SESSION_RUNS", "4"))


def max_address_runs() -> int:
    """Runs all sessions of one client address (a visitor, ``scdviz.app.jobs.visitor_of``) may make together per
    SCDVIZ_SESSION_TTL in hosted mode (SCDVIZ_MAX_ADDRESS_RUNS): the ceiling for a lab behind one address, and
    for a visitor who reloads the page to get a new session."""
    return int(os.environ.get("SCDVIZ_MAX_ADDRESS_RUNS", "16"))


def session_ttl() -> int:
    """Seconds after which an idle session's state and folder are removed (SCDVIZ_SESSION_TTL)."""
    return int(os.environ.get("SCDVIZ_SESSION_TTL", "7200"))


def max_jobs() -> int:
    """Heavy jobs (calibration, distillation, fitting, training) the server runs at once (SCDVIZ_MAX_JOBS)."""
    return int(os.environ.get("SCDVIZ_MAX_JOBS", "2"))


def max_visitor_jobs() -> int:
    """Heavy jobs one visitor (one client address) runs at once (SCDVIZ_MAX_VISITOR_JOBS)."""
    return int(os.environ.get("SCDVIZ_MAX_VISITOR_JOBS", "1"))


def max_exports() -> int:
    """Figure exports the server writes at once (SCDVIZ_MAX_EXPORTS); an export (a fraction of a second) is not
    a heavy job: it neither waits for nor blocks calibration and training."""
    return int(os.environ.get("SCDVIZ_MAX_EXPORTS", "4"))


def trust_proxy() -> bool:
    """Name visitors by the X-Forwarded-For address their proxy appended (SCDVIZ_TRUST_PROXY=1): the
    right-most entry (``proxy_hops``), never the left-most, which the client writes. Only behind a proxy that
    appends it, as a Space's does. Off, the client's own address names it, and the app tells uvicorn to trust
    no forwarded header (``FORWARDED_ALLOW_IPS``, unless set) so that no header rewrites that address."""
    return os.environ.get("SCDVIZ_TRUST_PROXY", "0").lower() in ("1", "true", "yes")


def proxy_hops() -> int:
    """Trusted proxies in front of the app, each appending one X-Forwarded-For entry (SCDVIZ_PROXY_HOPS, default 1):
    the visitor is that many entries from the right, the address the outermost trusted proxy saw."""
    return max(1, int(os.environ.get("SCDVIZ_PROXY_HOPS", "1")))


def visitor_mb() -> float:
    """MB of files (uploads, figure exports, CSV) the app takes or writes for one visitor per SCDVIZ_SESSION_TTL
    (SCDVIZ_VISITOR_MB); an upload past it is refused with HTTP 429 (413 when it alone is larger)."""
    return float(os.environ.get("SCDVIZ_VISITOR_MB", "100"))


def visitor_uploads() -> int:
    """Upload requests (``POST /gradio_api/upload``) one visitor may send per SCDVIZ_SESSION_TTL in hosted mode
    (SCDVIZ_VISITOR_UPLOADS); past it they are refused with HTTP 429."""
    return int(os.environ.get("SCDVIZ_VISITOR_UPLOADS", "20"))

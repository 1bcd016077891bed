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


def max_new_tokens() -> int:
    """Most tokens the app generates per request (SCDVIZ_MAX_NEW_TOKENS)."""
    return int(os.environ.get("SCDVIZ_MAX_NEW_TOKENS", "64"))


def default_producer() -> str:
    """Producer source the app loads first (SCDVIZ_PRODUCER)."""
    return os.environ.get("SCDVIZ_PRODUCER", "builtin:smollm2-135m")


def default_consumer() -> str:
    """Consumer source the app loads first (SCDVIZ_CONSUMER)."""
    return os.environ.get("SCDVIZ_CONSUMER", "builtin:jargon")


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
    """Runs (calibrations, policies) one visitor may keep in hosted mode (SCDVIZ_MAX_SESSION_RUNS)."""
    return int(os.environ.get("SCDVIZ_MAX_SESSION_RUNS", "4"))


def session_ttl() -> int:
    """Seconds after which an idle session's state and folder are removed (SCDVIZ_SESSION_TTL)."""
    return int(os.environ.get("SCDVIZ_SESSION_TTL", "7200"))


def max_jobs() -> int:
    """Heavy jobs (calibration, training, figure export) the server runs at once (SCDVIZ_MAX_JOBS)."""
    return int(os.environ.get("SCDVIZ_MAX_JOBS", "2"))


def max_visitor_jobs() -> int:
    """Heavy jobs one visitor (one client address) runs at once (SCDVIZ_MAX_VISITOR_JOBS)."""
    return int(os.environ.get("SCDVIZ_MAX_VISITOR_JOBS", "1"))


def trust_proxy() -> bool:
    """Name visitors by the first X-Forwarded-For address (SCDVIZ_TRUST_PROXY=1): only behind a proxy
    that sets it, as a Space's does; otherwise a client could name itself."""
    return os.environ.get("SCDVIZ_TRUST_PROXY", "0").lower() in ("1", "true", "yes")


def visitor_mb() -> float:
    """MB of files (figure exports, CSV) the app writes for one visitor per session time (SCDVIZ_VISITOR_MB)."""
    return float(os.environ.get("SCDVIZ_VISITOR_MB", "100"))

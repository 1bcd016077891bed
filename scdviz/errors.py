"""The error a person can fix, shared by the library (run folders) and the app (every request check)."""

from __future__ import annotations


class UserError(ValueError):
    """A request the user can fix; the message says how."""

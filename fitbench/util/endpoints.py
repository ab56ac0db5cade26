"""The address of a server fitbench talks to (Ollama's, for the written analysis), checked as text:
no connection is made here, so options can be validated before anything runs."""

from __future__ import annotations

from urllib.parse import urlsplit

from fitbench.util.errors import excerpt


def http_url_problem(text: object) -> str | None:
    """Why ``text`` is not an http(s) URL of a host (``http://localhost:11434``), None when it is one."""
    if not isinstance(text, str) or not text.strip():
        return f"{excerpt(text)} is not a URL"
    try:
        parts = urlsplit(text.strip())
        parts.port  # reading the port checks it: one that is not a number from 0 to 65535 raises
    except ValueError as error:
        return f"{excerpt(text)} is not a URL ({error})"
    if parts.scheme not in ("http", "https"):
        return f"{excerpt(text)} is not an http:// or https:// URL"
    if not parts.hostname or any(ch.isspace() for ch in text.strip()):
        return f"{excerpt(text)} names no host"
    return None

"""Units in one place: results store bytes and seconds; people read GB, ms and B."""

from __future__ import annotations

GB = 1e9


def format_bytes(value: float | None) -> str:
    """Decimal gigabytes, as GPU datasheets and nvidia-smi's headline figures use."""
    if value is None:
        return "-"
    if value >= 0.1 * GB:
        return f"{value / GB:.1f} GB"
    return f"{value / 1e6:.0f} MB"


def format_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"


def format_count(value: float | None) -> str:
    """Parameter counts: 6.74B, 124.4M."""
    if value is None:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:.2f}{suffix}" if scale >= 1e9 else f"{value / scale:.1f}{suffix}"
    return str(int(value))


def parse_bytes(text: str) -> float:
    """'80GB' -> 80e9, '80GiB' -> 80 x 2^30, '512MB' -> 512e6; a bare number is bytes."""
    units = {"TIB": 1024**4, "GIB": 1024**3, "MIB": 1024**2, "TB": 1e12, "GB": 1e9, "MB": 1e6, "B": 1}
    cleaned = text.strip().upper().replace(" ", "")
    for suffix, scale in units.items():
        if cleaned.endswith(suffix):
            return float(cleaned[: -len(suffix)]) * scale
    return float(cleaned)

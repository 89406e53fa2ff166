"""Sizes (1K, 64M, 1G: binary units) and link rates (tc's syntax), parsed and printed."""

from __future__ import annotations

import re

__all__ = ["parse_size", "parse_sizes", "parse_rate", "parse_time", "format_size",
           "format_bytes", "format_ms"]

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^(\d+)\s*([KMG]?)(?:I?B)?$", re.IGNORECASE)

# tc(8): bit/kbit/mbit/gbit/tbit are bits per second in SI units, the "i"
# forms are binary, and bps/kbps/... are *bytes* per second.
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([a-z]*)$", re.IGNORECASE)
_RATE_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)(s|sec|ms|msec|us|usec)?$", re.IGNORECASE)
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_size(text: str) -> int:
    """'64M' -> 67108864 bytes (K, M, G are powers of 1024; an optional B/iB)."""
    match = _SIZE_RE.match(text.strip())
    if not match:
        raise ValueError(f"size {text!r}: expected a number with an optional unit K, M or G "
                         "(e.g. 1K, 64M)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """'1K,1M,64M' or the range 'MIN:MAX[:FACTOR]' (geometric, factor 2 by default).

    Every size must be a positive multiple of 4 bytes (whole float32 elements).
    The result is sorted and without repeats.
    """
    text = text.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"sizes {text!r}: a range is MIN:MAX or MIN:MAX:FACTOR")
        low, high = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else None
        if len(parts) == 3 and (factor is None or factor < 2):
            raise ValueError(f"sizes {text!r}: FACTOR must be an integer >= 2")
        if low <= 0 or high < low:
            raise ValueError(f"sizes {text!r}: need 0 < MIN <= MAX")
        sizes, size = [], low
        while size <= high:
            sizes.append(size)
            size *= factor or 2
    else:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError("sizes: give at least one size")
    for size in sizes:
        if size <= 0 or size % 4:
            raise ValueError(f"size {size} bytes: must be a positive multiple of 4 "
                             "(whole float32 elements)")
    return sorted(set(sizes))


def parse_rate(text: str) -> float:
    """A rate in tc's syntax ('200mbit', '1gbit', '10mbps') -> bytes per second."""
    match = _RATE_RE.match(text.strip())
    unit = match.group(2).lower() if match else ""
    if unit.endswith("bit"):
        prefix, scale = unit[:-3], 1 / 8
    elif unit.endswith("bps"):
        prefix, scale = unit[:-3], 1.0
    elif unit == "":
        prefix, scale = "", 1 / 8  # a bare number is bits per second in tc
    else:
        prefix, scale = None, 0.0
    if not match or prefix not in _RATE_PREFIX or float(match.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: expected tc's syntax, e.g. 200mbit, 1gbit, 10mbps")
    return float(match.group(1)) * _RATE_PREFIX[prefix] * scale


def parse_time(text: str) -> float:
    """A delay in tc's syntax ('2ms', '500us', '0.1s') -> seconds."""
    match = _TIME_RE.match(text.strip())
    if not match:
        raise ValueError(f"delay {text!r}: expected e.g. 2ms, 500us, 0.1s")
    return float(match.group(1)) * _TIME_UNITS[(match.group(2) or "s").lower()]


def format_size(nbytes: int) -> str:
    """Exact binary size: 1024 -> '1 KiB', 67108864 -> '64 MiB', 1536 -> '1536 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def format_bytes(nbytes: float) -> str:
    """Approximate binary size for measured counts: '8.39 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def format_ms(seconds: float) -> str:
    """Milliseconds: 3 significant digits below 100 ms, whole ones above."""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"

"""Sizes (1K, 64M, 1G: binary units) and link rates (tc's syntax), parsed and printed.

The grammar of rates, delays and sizes is reducerd.ops.units', shared with
`reducerd plan`; a rate here is handed to tc as written, so only tc's own
syntax reads (200mbit, not "200 Mbit/s").
"""

from __future__ import annotations

from reducerd.ops.units import parse_bytes
from reducerd.ops.units import parse_rate as _parse_rate
from reducerd.ops.units import parse_time as _parse_time

__all__ = ["parse_size", "parse_sizes", "parse_rate", "parse_time", "format_size",
           "format_bytes", "format_ms"]


def parse_size(text: str) -> int:
    """'64M' -> 67108864 bytes (reducerd.ops.units.parse_bytes: K, M, G are powers of 1024)."""
    nbytes = parse_bytes(text)
    if not nbytes.is_integer():
        raise ValueError(f"size {text!r}: {nbytes} bytes is not a whole number of bytes")
    return int(nbytes)


def parse_rate(text: str) -> float:
    """A rate in tc's syntax ('200mbit', '1gbit', '10mbps') -> bytes per second."""
    return _parse_rate(text, tc_only=True)


def parse_time(text: str) -> float:
    """A delay ('2ms', '500us', '0.1s') -> seconds."""
    return _parse_time(text, what="delay")


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

"""The planner's quantities as people write them: link rates, delays, model sizes.

Rates use tc's syntax, as `reducerd bench --emulate-cluster` does (100gbit,
200mbit; bps means *bytes* per second there), and also the usual "100Gbit/s".
A model is a parameter count ("340M params", "25.6Mparams", "1.5B params")
or the size of its float32 gradient ("1.3G", "64MiB", "1.3GB"): K, M, G, T
and KiB, MiB, GiB, TiB are powers of 1024, as in `reducerd bench --sizes`;
KB, MB, GB, TB are powers of 1000. Parameter counts are decimal (M = 1e6).
Every parser raises ValueError with a message that says what it expected.
"""

from __future__ import annotations

import re

__all__ = ["parse_rate", "parse_time", "parse_params", "format_rate", "format_bytes",
           "format_seconds"]

_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]*?)(/s)?$", re.IGNORECASE)
_RATE_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                "ki": 1024.0, "mi": 1024.0**2, "gi": 1024.0**3, "ti": 1024.0**4}
_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|sec|ms|msec|us|usec|ns)?$", re.IGNORECASE)
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6,
               "ns": 1e-9}
_NUMBER = r"(\d+(?:\.\d+)?(?:e\d+)?)"
_PARAMS_RE = re.compile(_NUMBER + r"\s*([kmgtb]?)\s*[-_ ]?\s*(params?|p)$", re.IGNORECASE)
_PARAM_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}
_BYTES_RE = re.compile(_NUMBER + r"\s*([kmgt]?)(i?b)?$", re.IGNORECASE)
_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(text: str) -> float:
    """'100gbit', '100Gbit/s', '200mbit', '10gbps' (bytes) -> bytes per second."""
    match = _RATE_RE.match(text.strip())
    unit = match.group(2).lower() if match else ""
    if unit.endswith("bit"):
        prefix, scale = unit[:-3], 1 / 8
    elif unit.endswith("bps"):
        prefix, scale = unit[:-3], 1.0
    elif unit == "" and match and not match.group(3):
        prefix, scale = "", 1 / 8  # a bare number is bits per second, as in tc
    else:
        prefix, scale = None, 0.0
    if not match or prefix not in _RATE_PREFIX or float(match.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: expected a positive rate in tc's syntax, "
                         "e.g. 100gbit, 100Gbit/s, 200mbit (or 12.5gbps: bytes per second)")
    return float(match.group(1)) * _RATE_PREFIX[prefix] * scale


def parse_time(text: str) -> float:
    """'20us', '1.5ms', '0' -> seconds (>= 0)."""
    match = _TIME_RE.match(text.strip())
    if not match:
        raise ValueError(f"time {text!r}: expected e.g. 20us, 1.5ms, 0.1s")
    return float(match.group(1)) * _TIME_UNITS[(match.group(2) or "s").lower()]


def parse_params(text: str) -> int | None:
    """A model size -> its parameter count; None when `text` is not a size at all
    (then it may be a model's name). Bytes are of the float32 gradient."""
    text = text.strip()
    match = _PARAMS_RE.match(text)
    if match:
        params = float(match.group(1)) * _PARAM_PREFIX[match.group(2).lower()]
    else:
        match = _BYTES_RE.match(text)
        if not match:
            return None
        prefix, suffix = match.group(2).lower(), (match.group(3) or "").lower()
        # "1.3G", "64MiB": binary, as `reducerd bench --sizes`; "1.3GB": decimal.
        scale = _DECIMAL[prefix] if suffix == "b" and prefix else _BINARY[prefix]
        params = float(match.group(1)) * scale / 4
    if params < 1:
        raise ValueError(f"model size {text!r}: must be at least one parameter "
                         "(4 bytes of float32 gradient)")
    return round(params)


def format_rate(bytes_per_s: float) -> str:
    """Bytes per second as link people say it: '100 Gbit/s', '200 Mbit/s'."""
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {unit}"
    return f"{bits:.4g} bit/s"


def format_bytes(nbytes: float) -> str:
    """Decimal units, as link rates are: '672.5 MB', '1.345 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """'61.2 ms', '1.35 s', '320 us'."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"

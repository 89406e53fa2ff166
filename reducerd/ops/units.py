"""Link rates, delays and byte sizes as people write them: one grammar for every command.

`reducerd bench` and `reducerd plan` both read these (bench/units.py and
plan/units.py add what only one of them prints or parses).

- Rates use tc(8)'s syntax: bit, kbit, mbit, gbit, tbit are bits per second
  in SI units, the "i" forms (kibit, ...) binary, and bps, kbps, ... are
  *bytes* per second; a bare number is bits per second, as in tc. Where the
  text is not handed to tc, "100Gbit/s" and "25 Gbit/s" read too.
- Delays: s, sec, ms, msec, us, usec, ns; a bare number is seconds.
- Sizes: K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024, KB, MB, GB,
  TB powers of 1000, a bare number or "B" is bytes.

Every parser raises ValueError with a message that says what it expected.
"""

from __future__ import annotations

import re

__all__ = ["parse_rate", "parse_time", "parse_bytes", "NUMBER"]

_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(\s*)([a-z]*?)(/s)?$", re.IGNORECASE)
_RATE_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                "ki": 1024.0, "mi": 1024.0**2, "gi": 1024.0**3, "ti": 1024.0**4}
_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|sec|ms|msec|us|usec|ns)?$", re.IGNORECASE)
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6,
               "ns": 1e-9}
NUMBER = r"(\d+(?:\.\d+)?(?:e\d+)?)"  # 64, 1.5, 3.4e8: no sign, sizes and counts are >= 0
_BYTES_RE = re.compile(NUMBER + r"\s*([kmgt]?)(i?b)?$", re.IGNORECASE)
_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(text: str, *, tc_only: bool = False) -> float:
    """'100gbit', '200mbit', '10gbps' (bytes), '100Gbit/s' -> bytes per second (> 0).

    tc_only: accept only what tc itself reads (no space before the unit, no
    "/s"), for a rate that is handed to tc as it was written.
    """
    match = _RATE_RE.match(text.strip())
    spaced_or_per_s = bool(match and (match.group(2) or match.group(4)))
    unit = match.group(3).lower() if match else ""
    if unit.endswith("bit"):
        prefix, scale = unit[:-3], 1 / 8
    elif unit.endswith("bps"):
        prefix, scale = unit[:-3], 1.0
    elif unit == "" and match and not match.group(4):
        prefix, scale = "", 1 / 8  # a bare number is bits per second, as in tc
    else:
        prefix, scale = None, 0.0
    if (not match or prefix not in _RATE_PREFIX or float(match.group(1)) <= 0
            or (tc_only and spaced_or_per_s)):
        examples = "200mbit, 1gbit" if tc_only else "100gbit, 100Gbit/s, 200mbit"
        raise ValueError(f"rate {text!r}: expected a positive rate in tc's syntax, e.g. "
                         f"{examples} (or 10mbps: bytes per second)")
    return float(match.group(1)) * _RATE_PREFIX[prefix] * scale


def parse_time(text: str, *, what: str = "time") -> float:
    """'20us', '1.5ms', '0.1s', '0' -> seconds (>= 0); `what` names it in the error."""
    match = _TIME_RE.match(text.strip())
    if not match:
        raise ValueError(f"{what} {text!r}: expected e.g. 20us, 1.5ms, 0.1s")
    return float(match.group(1)) * _TIME_UNITS[(match.group(2) or "s").lower()]


def parse_bytes(text: str, *, what: str = "size") -> float:
    """'64M', '64MiB' (binary), '1.3GB' (decimal), '4096' -> bytes (>= 0, maybe fractional).

    `what` names the quantity in the error ("size", "model size").
    """
    match = _BYTES_RE.match(text.strip())
    if not match:
        raise ValueError(f"{what} {text!r}: expected a number with an optional unit: K, M, G, "
                         "T or KiB, MiB, ... (powers of 1024), KB, MB, ... (powers of 1000), "
                         "e.g. 1K, 64M, 1.3GB")
    prefix, suffix = match.group(2).lower(), (match.group(3) or "").lower()
    scale = _DECIMAL[prefix] if suffix == "b" and prefix else _BINARY[prefix]
    return float(match.group(1)) * scale

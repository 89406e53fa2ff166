"""The planner's quantities as people write them: link rates, delays, model sizes.

Rates, delays and byte sizes follow reducerd.ops.units, the grammar `reducerd
bench` reads too (rates in tc's syntax: 100gbit, 200mbit, 10gbps in bytes
per second; here also "100Gbit/s"). A model is a parameter count ("340M
params", "25.6Mparams", "1.5B params"; decimal, M = 1e6) or the size of its
float32 gradient ("1.3G", "64MiB": binary; "1.3GB": decimal). Every parser
raises ValueError with a message that says what it expected.
"""

from __future__ import annotations

import math
import re

from reducerd.ops.units import NUMBER, parse_bytes, parse_rate, parse_time

__all__ = ["parse_rate", "parse_time", "parse_params", "format_rate", "format_bytes",
           "format_seconds"]

_PARAMS_RE = re.compile(NUMBER + r"\s*([kmgtb]?)\s*[-_ ]?\s*(params?|p)$", re.IGNORECASE)
_PARAM_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}


def parse_params(text: str) -> int | None:
    """A model size -> its parameter count; None when `text` is not a size at all
    (then it may be a model's name). Bytes are of the float32 gradient."""
    text = text.strip()
    match = _PARAMS_RE.match(text)
    if match:
        params = float(match.group(1)) * _PARAM_PREFIX[match.group(2).lower()]
    else:
        try:
            params = parse_bytes(text) / 4
        except ValueError:
            return None
    if not 1 <= params < math.inf:
        raise ValueError(f"model size {text!r}: must be at least one parameter "
                         "(4 bytes of float32 gradient), and finite")
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

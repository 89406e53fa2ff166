"""Status codes on the wire: gRPC's numeric codes, in replies and STATUS frames."""

from __future__ import annotations

import grpc

__all__ = ["status_code_from_value", "status_code_from_name"]

_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_code_from_value(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a numeric code from the wire (UNKNOWN if none)."""
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def status_code_from_name(name: str) -> grpc.StatusCode:
    """The grpc.StatusCode called `name` ("INVALID_ARGUMENT"); KeyError if none."""
    return grpc.StatusCode[name]

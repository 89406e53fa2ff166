"""The one interface every benchmarked system's allreduce meets (reducerd.bench.systems).

Its own module, below the systems and the TCP floor (reducerd.bench.floor),
so that make_comm can build a FloorComm and FloorComm can be a Comm without
either importing the other.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["Comm"]


class Comm(Protocol):
    """One system's allreduce of `numel` float32 elements on this rank.

    prepare() allocates, refill() restores the input (outside the timed
    region: Gloo and MXNet reduce in place), run() is the timed allreduce
    including any dtype casts the system needs, result() returns the float32
    output that check() compares with the expected sum, barrier() syncs all
    ranks, close() tears down.
    """

    def prepare(self, numel: int) -> None: ...
    def refill(self) -> None:
        return None
    def run(self) -> None: ...
    def result(self) -> np.ndarray: ...

    def check(self, numel: int, expected: int, allowed: float, label: str) -> None:
        """AssertionError unless result() has `numel` elements, each within `allowed`
        of `expected`."""
        out = self.result()
        if out.size != numel:
            raise AssertionError(f"{label}: {out.size} elements back, not {numel}")
        wrong = np.abs(out.astype(np.float64) - expected) > allowed
        if wrong.any():
            bad = np.flatnonzero(wrong)[:3].tolist()
            raise AssertionError(f"{label}: wrong sum at elements {bad}: {out[bad].tolist()} "
                                 f"(expected {expected} within {allowed:g})")
    def barrier(self) -> None: ...
    def close(self) -> None: ...

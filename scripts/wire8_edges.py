"""What each 8-bit wire makes of values at the edge of its range (docs/explanation/numerics.md).

    python scripts/wire8_edges.py

Each value is encoded and decoded by reducer_wire.quant, with the C kernels
(where built) and with NumPy; the two must give the same bits (the script
stops otherwise). int8 encodes each value alone in a block of zeros.
"""

from __future__ import annotations

import sys

import numpy as np
from reducer_wire import dtypes, quant

LABELED = [("448", 448.0), ("449", 449.0), ("464", 464.0),
           ("464 + 1 ulp", float(np.nextafter(np.float32(464), np.float32(1e9)))),
           ("480", 480.0), ("57344", 57344.0), ("61440 - 1 ulp", 61439.996),
           ("61440", 61440.0), ("65504 (float16's largest)", 65504.0), ("1e5", 1e5),
           ("float32's largest", float(np.finfo(np.float32).max)), ("+Inf", np.inf),
           ("-Inf", -np.inf), ("NaN", np.nan), ("2^-9", 2.0 ** -9), ("2^-10", 2.0 ** -10),
           ("2^-16", 2.0 ** -16), ("2^-17", 2.0 ** -17), ("1e-40 (float32 subnormal)", 1e-40)]
VALUES = [value for _, value in LABELED]
WIRES = ("fp8_e4m3", "fp8_e5m2", "int8")


def round_trip(wire: str, use_c: bool) -> np.ndarray:
    dtype = dtypes.EIGHT_BIT_DTYPES[wire]
    block = dtypes.wire_block(dtype)
    x = np.zeros(len(VALUES) * block, np.float32)
    x[::block] = VALUES
    data = np.empty(dtypes.wire_nbytes(dtype, x.size), np.uint8)
    quant.encode(x, dtype, data, use_c=use_c)
    out = np.empty(x.size, np.float32)
    with np.errstate(over="ignore"):
        quant.decode(data, dtype, out, use_c=use_c)
    return out[::block]


def shown(value: float) -> str:
    if np.isnan(value):
        return "-NaN" if np.signbit(value) else "NaN"
    if np.isinf(value) or value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.9g}"
    return f"{value:.6g}"


def main() -> int:
    results = {}
    for wire in WIRES:
        got = round_trip(wire, use_c=False)
        if quant.kernels() is not None:
            c = round_trip(wire, use_c=True)
            if not np.array_equal(c.view(np.uint32), got.view(np.uint32)):
                print(f"{wire}: C and NumPy differ", file=sys.stderr)
                return 1
        results[wire] = got
    print("| float32 in | " + " | ".join(f"`{w}` out" for w in WIRES) + " |")
    print("|---" * (len(WIRES) + 1) + "|")
    for i in range(len(VALUES)):
        row = [LABELED[i][0]] + [shown(float(results[w][i])) for w in WIRES]
        print("| " + " | ".join(row) + " |")
    print(f"\n(C kernels {'and NumPy: the same bits' if quant.kernels() else 'not built: NumPy'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

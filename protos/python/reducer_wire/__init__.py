"""reducer_wire: what reducerd and reducer_client share, and nothing else.

The generated protobuf modules (_proto), the Shard codec (codec), the TCP data
plane's framing (framing), wire dtypes and reduce ops (dtypes), conversions
between wire dtypes and float32 (convert, with C kernels in _kernels), and the
status codes on the wire (codes). Neither side imports the other: they meet
here (../shared/INTERFACE.md section 1).
"""

"""The chunk layout, for scripts that imported it from here: it lives in the
neutral wire package now (reducer_wire.layout), which the daemon's planner
imports too. These are the same objects."""

from reducer_wire.layout import (  # noqa: F401 (re-exported)
    DEFAULT_CHUNK_BYTES,
    LAYOUT_RULE,
    MIN_CHUNK_BYTES,
    PIPELINE_CHUNKS_PER_DAEMON,
    Chunk,
    chunk_count,
    layout_fingerprint,
    pipelined_chunk_bytes,
    plan_chunks,
    plan_wire_chunks,
)

__all__ = ["Chunk", "chunk_count", "plan_chunks", "plan_wire_chunks", "layout_fingerprint",
           "pipelined_chunk_bytes", "DEFAULT_CHUNK_BYTES", "MIN_CHUNK_BYTES",
           "PIPELINE_CHUNKS_PER_DAEMON", "LAYOUT_RULE"]

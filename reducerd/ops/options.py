"""The daemon's options: their defaults, command-line flags and help, and
which of them SIGHUP reloads. reducerd.ops.config builds and checks the one
Config from them (flags > TOML file > defaults).
"""

from __future__ import annotations

import os

from reducerd.core.limits import MAX_OPEN_CHUNKS_PER_JOB
from reducerd.ops.busy import DEFAULT_POOL_BUSY_CORES

__all__ = ["DEFAULT_LISTEN", "STALLED_AFTER_S", "DEFAULT_MAX_WORLD_SIZE", "MAX_THREADS",
           "DEFAULT_POOL_CHUNK_BYTES", "WORLD_SIZE_FIELD_MAX", "DATA_LOOPS", "DEFAULT_DATA_LOOP",
           "RELOADABLE", "available_cpus"]

# Defaults that other modules use too; this is their one home.
DEFAULT_LISTEN = "127.0.0.1:7070"  # loopback only: `reducerd` alone runs and exposes nothing
STALLED_AFTER_S = 5.0
DEFAULT_MAX_WORLD_SIZE = 65536
WORLD_SIZE_FIELD_MAX = (1 << 32) - 1  # Shard.world_size is a uint32
MAX_THREADS = 1024
# Measured (scripts/daemon_threads.py): the summing threads' hand-off costs ~45 us per
# contribution, as much as adding 0.5 MiB of float16 with the C kernel.
DEFAULT_POOL_CHUNK_BYTES = 1 << 20
# What reads plain-TCP data-plane frames (Config.data_loop). The C loop
# (reducerd.dataplane.cloop) passes every data-plane test, but measured on
# 2 shared cores it takes as much daemon CPU per GB as the event loop or more
# (the copies move to its thread, and each frame crosses threads), so the
# event loop stays the default.
DATA_LOOPS = ("c", "python")
DEFAULT_DATA_LOOP = "python"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask): --threads' default."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity mask on this platform
        return max(1, os.cpu_count() or 1)


# Command-line flag -> Config field.
_FLAGS = {
    "--listen": "listen",
    "--metrics-listen": "metrics_listen",
    "--metrics-auth-file": "metrics_auth_file",
    "--auth-token-file": "auth_token_file",
    "--tls-cert": "tls_cert",
    "--tls-key": "tls_key",
    "--tls-client-ca": "tls_client_ca",
    "--round-timeout": "round_timeout_s",
    "--max-inflight-bytes": "max_inflight_bytes",
    "--max-message-bytes": "max_message_bytes",
    "--drain-grace": "drain_grace_s",
    "--log-level": "log_level",
    "--port-offset": "port_offset",
    "--auth-token-credential": "auth_token_credential",
    "--metrics-max-jobs": "metrics_max_jobs",
    "--stalled-after": "stalled_after_s",
    "--max-open-chunks-per-job": "max_open_chunks_per_job",
    "--max-inflight-bytes-per-job": "max_inflight_bytes_per_job",
    "--stream-idle-timeout": "stream_idle_timeout_s",
    "--data-listen": "data_listen",
    "--max-world-size": "max_world_size",
    "--threads": "threads",
    "--pool-chunk-bytes": "pool_chunk_bytes",
    "--pool-busy-cores": "pool_busy_cores",
    "--max-record-bytes": "max_record_bytes",
    "--token-grace": "token_grace_s",
    "--job-idle-expiry": "job_idle_expiry_s",
    "--status-max-jobs": "status_max_jobs",
    "--grpc-idle-timeout": "grpc_idle_timeout_s",
    "--data-loop": "data_loop",
}
# What SIGHUP changes in a serving daemon (besides the token); the rest needs a restart.
RELOADABLE = ("log_level", "stalled_after_s", "stream_idle_timeout_s", "token_grace_s",
              "job_idle_expiry_s", "status_max_jobs")
_HELP = {
    "listen": f"gRPC address to serve (default {DEFAULT_LISTEN})",
    "metrics_listen": "serve Prometheus metrics over HTTP here (port 0: any free one; "
                      "HTTPS under --tls-cert)",
    "metrics_auth_file": "file of one line USER:PASSWORD that /metrics asks for "
                         "(HTTP basic auth)",
    "auth_token_file": "file holding the bearer token every call must carry",
    "tls_cert": "server certificate (PEM), with --tls-key",
    "tls_key": "server private key (PEM)",
    "tls_client_ca": "require client certificates signed by this CA (mutual TLS)",
    "round_timeout_s": "seconds a chunk waits for its last contribution (default 60)",
    "max_inflight_bytes": "bytes held for open chunks at most (default 2 GiB)",
    "max_message_bytes": "largest gRPC message accepted or sent (default 64 MiB)",
    "drain_grace_s": "seconds SIGTERM waits for open rounds (default 30)",
    "log_level": "debug, info, warning or error (default info)",
    "port_offset": "add N to the listen, metrics and data ports (reducerd@N.service)",
    "auth_token_credential": "read the token from $CREDENTIALS_DIRECTORY/NAME (systemd)",
    "metrics_max_jobs": "jobs with their own metrics label, the rest are 'other' (default 20)",
    "stalled_after_s": f"status lists open chunks older than this as stalled (default "
                       f"{STALLED_AFTER_S:g})",
    "max_open_chunks_per_job": f"open chunks one job may hold at once (default "
                               f"{MAX_OPEN_CHUNKS_PER_JOB})",
    "max_inflight_bytes_per_job": "bytes one job's open chunks may hold at most (default "
                                  "0: half of --max-inflight-bytes)",
    "stream_idle_timeout_s": "end streams idle this many seconds with nothing open "
                             "(default 600)",
    "max_world_size": f"largest world_size a shard may declare (default "
                      f"{DEFAULT_MAX_WORLD_SIZE})",
    "threads": f"summing threads, chunks spread over them (default: the CPUs this process "
               f"may run on, {available_cpus()} here; 1 sums on the event loop's thread)",
    "pool_chunk_bytes": f"with --threads > 1, sum chunks of at least this many wire bytes on "
                        f"the summing threads, smaller ones on the event loop's thread "
                        f"(default {DEFAULT_POOL_CHUNK_BYTES}; 0: every chunk)",
    "pool_busy_cores": f"with --threads > 1, pool chunks only while the daemon uses this many "
                       f"cores, else sum inline (default {DEFAULT_POOL_BUSY_CORES}; 0: always)",
    "max_record_bytes": "bytes the open chunks' records and names may hold, beside "
                        "--max-inflight-bytes; one job half (default 0: 1/8 of "
                        "--max-inflight-bytes)",
    "token_grace_s": "after SIGHUP rotates the token, seconds the previous one still "
                     "authorizes (default 300; 0: none)",
    "job_idle_expiry_s": "forget a job (status row, counters) idle this many seconds with "
                         "nothing open (default 300)",
    "status_max_jobs": "GetStatus lists this many jobs at most, the most active first, "
                       "unless asked for more (default 100)",
    "grpc_idle_timeout_s": "close gRPC connections that carried no call for this many "
                           "seconds (default 30)",
    "data_loop": f"what reads plain-TCP data-plane frames and sends their replies: 'c' (a C "
                 f"thread; the event loop where it is not built) or 'python' (the event "
                 f"loop); also $REDUCERD_DATA_LOOP (default {DEFAULT_DATA_LOOP})",
    "data_listen": "TCP data plane: HOST:PORT, 'auto' (listen host, any free port; "
                   "the default) or 'off'; over TLS under --tls-cert",
}

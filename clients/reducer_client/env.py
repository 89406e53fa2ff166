"""Client settings from the environment: the one place the core reads it.

REDUCER_ADDRESSES (comma-separated HOST:PORT), REDUCER_JOB, REDUCER_TOKEN,
REDUCER_WIRE_DTYPE, REDUCER_TIMEOUT (seconds), REDUCER_CHUNK_BYTES,
REDUCER_DATA_PLANE (auto, tcp or grpc: how shards travel), REDUCER_LINK_GBIT
(each worker's link to the daemons in Gbit/s, which sizes the chunks), TLS with
REDUCER_TLS=1 (system roots) or REDUCER_TLS_CA / REDUCER_TLS_CERT /
REDUCER_TLS_KEY / REDUCER_TLS_SERVER_NAME (files, name override); rank and
world size from REDUCER_RANK / REDUCER_WORLD_SIZE, else the launcher's own:
torchrun (RANK / WORLD_SIZE), TensorFlow (TF_CONFIG), MXNet / ps-lite
(DMLC_WORKER_ID / DMLC_NUM_WORKER).

Node-local aggregation (node.py): the worker's place on its host from
REDUCER_LOCAL_RANK / REDUCER_LOCAL_SIZE, else torchrun's LOCAL_RANK /
LOCAL_WORLD_SIZE; neither set means one worker per host. Other launchers have
no such pair (TF_CONFIG, DMLC_*) or name it their own way: set the REDUCER_
pair, e.g. from Open MPI's OMPI_COMM_WORLD_LOCAL_RANK / _LOCAL_SIZE, or
SLURM_LOCALID / SLURM_NTASKS_PER_NODE. Ranks are assumed node-major (node =
rank // local size, torchrun's default); REDUCER_NODE_RANK names the node
otherwise. REDUCER_NODE_LOCAL=0 turns node-local aggregation off.

REDUCER_WIRE_NUMPY=1 converts to and from the wire dtypes in NumPy instead of
reducer_wire's C kernels (same bits, slower; for comparison), and so also
keeps every chunk on the Python path; REDUCER_CLIENT_C_LOOP=0 does only the
latter (fastpath.py: whole keys through a C loop, the default where it was
built).

settings_from_env(mapping) reads that mapping alone and returns every
setting, the documented defaults where a variable is unset; from_env passes
them all, and the mapping itself for REDUCER_WIRE_NUMPY, so a client built
from a mapping reads nothing else. Nothing here is read at import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["settings_from_env", "rank_and_size_from_env", "local_settings_from_env",
           "data_plane_from_env", "link_gbit_from_env", "wire_numpy_from_env",
           "client_loop_from_env", "DATA_PLANES",
           "DEFAULT_WIRE_DTYPE", "DEFAULT_TIMEOUT_S"]

# How shards may travel (ReducerClient(data_plane=...), REDUCER_DATA_PLANE).
DATA_PLANES = ("auto", "tcp", "grpc")
# ReducerClient's defaults, here so that the constructor and this module share them.
DEFAULT_WIRE_DTYPE = "float16"
DEFAULT_TIMEOUT_S = 60.0

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def rank_and_size_from_env(environ: Mapping[str, str]) -> tuple[int, int]:
    """(rank, world_size) from the first launcher whose variables are set."""
    for rank_var, size_var in (("REDUCER_RANK", "REDUCER_WORLD_SIZE"),
                               ("RANK", "WORLD_SIZE"),
                               ("DMLC_WORKER_ID", "DMLC_NUM_WORKER")):
        if rank_var in environ and size_var in environ:
            return _int(environ, rank_var), _int(environ, size_var)
    if "TF_CONFIG" in environ:
        try:
            tf_config = json.loads(environ["TF_CONFIG"])
            cluster, task = tf_config["cluster"], tf_config["task"]
            # The chief (if any) is rank 0, then the workers in order.
            chiefs = len(cluster.get("chief", []))
            workers = len(cluster.get("worker", []))
            index = int(task.get("index", 0))
            rank = index if task["type"] == "chief" else chiefs + index
            return rank, chiefs + workers
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"TF_CONFIG is not a valid cluster spec: {exc!r}") from None
    raise ValueError("rank and world size: set REDUCER_RANK and REDUCER_WORLD_SIZE "
                     "(or run under torchrun, TF_CONFIG or DMLC_* variables)")


def local_settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """local_rank, local_size, node_rank and node_local, for those that are set."""
    environ = os.environ if environ is None else environ
    settings: dict[str, Any] = {}
    for rank_var, size_var in (("REDUCER_LOCAL_RANK", "REDUCER_LOCAL_SIZE"),
                               ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank_var in environ and size_var in environ:
            settings["local_rank"] = _int(environ, rank_var)
            settings["local_size"] = _int(environ, size_var)
            break
    if environ.get("REDUCER_NODE_RANK"):
        settings["node_rank"] = _int(environ, "REDUCER_NODE_RANK")
    switch = environ.get("REDUCER_NODE_LOCAL", "").strip().lower()
    if switch:
        if switch not in _FALSE + _TRUE:
            raise ValueError(f"REDUCER_NODE_LOCAL={switch!r}: use 1 or 0")
        settings["node_local"] = switch in _TRUE
    return settings


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every ReducerClient keyword argument, from `environ` alone (default os.environ).

    Unset variables give the constructor's documented defaults, so a client
    built from these reads nothing else.
    """
    environ = os.environ if environ is None else environ
    addresses = [a.strip() for a in environ.get("REDUCER_ADDRESSES", "").split(",")
                 if a.strip()]
    if not addresses:
        raise ValueError("REDUCER_ADDRESSES is not set: give the daemons as "
                         "HOST:PORT,HOST:PORT")
    rank, world_size = rank_and_size_from_env(environ)
    timeout = environ.get("REDUCER_TIMEOUT")
    try:
        timeout_s = float(timeout) if timeout else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"REDUCER_TIMEOUT={timeout!r} is not a number of seconds") from None
    settings: dict[str, Any] = {
        "addresses": addresses,
        "job": environ.get("REDUCER_JOB", "default"),
        "rank": rank,
        "world_size": world_size,
        "token": environ.get("REDUCER_TOKEN") or None,
        "wire_dtype": environ.get("REDUCER_WIRE_DTYPE") or DEFAULT_WIRE_DTYPE,
        "timeout": timeout_s,
        "chunk_bytes": (_int(environ, "REDUCER_CHUNK_BYTES")
                        if environ.get("REDUCER_CHUNK_BYTES") else None),
        "data_plane": data_plane_from_env(environ),
        "link_gbit": link_gbit_from_env(environ),
        "tls": None,
        "local_rank": 0, "local_size": 1, "node_rank": None, "node_local": True,
    }
    tls_files = {field: environ.get(f"REDUCER_TLS_{name}") or None
                 for field, name in (("ca_file", "CA"), ("cert_file", "CERT"),
                                     ("key_file", "KEY"), ("server_name", "SERVER_NAME"))}
    if any(tls_files.values()):
        from reducer_client.tls import TLSConfig

        settings["tls"] = TLSConfig(**tls_files)
    elif environ.get("REDUCER_TLS", "").lower() in _TRUE:
        settings["tls"] = True
    settings.update(local_settings_from_env(environ))
    return settings


def wire_numpy_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """REDUCER_WIRE_NUMPY=1: convert in NumPy instead of reducer_wire's C kernels."""
    environ = os.environ if environ is None else environ
    return environ.get("REDUCER_WIRE_NUMPY", "") not in ("", "0")


def client_loop_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether plain-TCP keys go through the C loop (fastpath.py) where it was
    built: yes unless REDUCER_CLIENT_C_LOOP is 0 (false, no, off)."""
    environ = os.environ if environ is None else environ
    switch = environ.get("REDUCER_CLIENT_C_LOOP", "").strip().lower()
    if switch and switch not in _FALSE + _TRUE:
        raise ValueError(f"REDUCER_CLIENT_C_LOOP={switch!r}: use 1 or 0")
    return switch not in _FALSE


def data_plane_from_env(environ: Mapping[str, str] | None = None) -> str:
    """REDUCER_DATA_PLANE (auto, tcp or grpc), else "auto"."""
    environ = os.environ if environ is None else environ
    value = environ.get("REDUCER_DATA_PLANE", "").strip().lower() or "auto"
    if value not in DATA_PLANES:
        raise ValueError(f"REDUCER_DATA_PLANE must be auto, tcp or grpc, got {value!r}")
    return value


def link_gbit_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """REDUCER_LINK_GBIT (a worker's link rate in Gbit/s, e.g. 25 or 0.2), else None."""
    environ = os.environ if environ is None else environ
    value = environ.get("REDUCER_LINK_GBIT", "").strip()
    if not value:
        return None
    try:
        rate = float(value)
    except ValueError:
        rate = float("nan")
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"REDUCER_LINK_GBIT={value!r}: give the link rate in Gbit/s, "
                         "a number above 0 (25 for 25 Gbit/s, 0.2 for 200 Mbit/s)")
    return rate

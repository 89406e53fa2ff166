"""Daemon Config (flags, TOML) and client settings from the environment."""

import argparse
import json

import pytest
from reducer_client.env import client_loop_from_env, settings_from_env

from reducerd.ops.config import ConfigError, add_arguments, config_from_args


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_flags_override_toml(tmp_path):
    path = tmp_path / "reducerd.toml"
    path.write_text('listen = "127.0.0.1:7000"\nround-timeout = 12\n'
                    'max_inflight_bytes = 4096\n')
    config = parse("--config", str(path), "--round-timeout", "3.5")
    assert config.listen == "127.0.0.1:7000"
    assert config.round_timeout_s == 3.5 and config.max_inflight_bytes == 4096


def test_a_jobs_share_of_the_inflight_bytes():
    assert parse().job_inflight_bytes == parse().max_inflight_bytes // 2
    assert parse("--max-inflight-bytes", "8192").job_inflight_bytes == 4096
    config = parse("--max-inflight-bytes", "8192", "--max-inflight-bytes-per-job", "8192")
    assert config.job_inflight_bytes == 8192
    with pytest.raises(ConfigError, match="max_inflight_bytes_per_job"):
        parse("--max-inflight-bytes-per-job", "-1")


def test_listen_defaults_to_loopback():
    """Contract section 3: `reducerd` alone runs, on loopback only."""
    assert parse().listen == "127.0.0.1:7070"


def test_from_env_reducer_variables():
    settings = settings_from_env({"REDUCER_ADDRESSES": "h1:1, h2:2", "REDUCER_JOB": "bert",
                                  "REDUCER_RANK": "3", "REDUCER_WORLD_SIZE": "8",
                                  "REDUCER_TOKEN": "s3cret", "REDUCER_WIRE_DTYPE": "bfloat16"})
    assert settings == {"addresses": ["h1:1", "h2:2"], "job": "bert", "rank": 3,
                        "world_size": 8, "token": "s3cret", "wire_dtype": "bfloat16",
                        # every other setting explicit, at its documented default:
                        "timeout": 60.0, "chunk_bytes": None, "data_plane": "auto",
                        "link_gbit": None,
                        "tls": None, "local_rank": 0, "local_size": 1, "node_rank": None,
                        "node_local": True}


@pytest.mark.parametrize("env,expected", [
    ({"RANK": "1", "WORLD_SIZE": "4"}, (1, 4)),
    ({"DMLC_WORKER_ID": "2", "DMLC_NUM_WORKER": "3"}, (2, 3)),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["a"], "worker": ["b", "c"]},
                               "task": {"type": "worker", "index": 1}})}, (2, 3)),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["b", "c"]},
                               "task": {"type": "worker", "index": 0}})}, (0, 2)),
])
def test_from_env_launcher_variables(env, expected):
    settings = settings_from_env({"REDUCER_ADDRESSES": "h:1", **env})
    assert (settings["rank"], settings["world_size"]) == expected


def test_from_env_missing_is_a_clear_error():
    with pytest.raises(ValueError, match="REDUCER_ADDRESSES"):
        settings_from_env({})
    with pytest.raises(ValueError, match="REDUCER_RANK"):
        settings_from_env({"REDUCER_ADDRESSES": "h:1"})


def test_data_listen_settings():
    base = ("--listen", "10.0.0.5:7000")
    assert parse(*base).data_address == ("10.0.0.5", 0)  # auto: the listen host, any port
    assert parse(*base, "--data-listen", "off").data_address is None
    assert parse(*base, "--data-listen", "0.0.0.0:7100",
                 "--port-offset", "3").data_address == ("0.0.0.0", 7103)
    with pytest.raises(ConfigError, match="data_listen: expected HOST:PORT"):
        parse(*base, "--data-listen", "7100")


def test_data_listen_is_on_under_tls_too(tmp_path):
    """Contract section 2 (new): under TLS the data plane is offered over TLS."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    tls = ("--listen", "127.0.0.1:7000", "--tls-cert", str(cert), "--tls-key", str(key))
    assert parse(*tls).data_address == ("127.0.0.1", 0)
    assert parse(*tls, "--data-listen", "127.0.0.1:7100").data_address == ("127.0.0.1", 7100)
    assert parse(*tls, "--data-listen", "off").data_address is None


@pytest.mark.parametrize("value,expected", [("", "auto"), ("TCP", "tcp"), ("grpc", "grpc")])
def test_data_plane_from_env(value, expected):
    from reducer_client.env import data_plane_from_env
    assert data_plane_from_env({"REDUCER_DATA_PLANE": value}) == expected
    settings = settings_from_env({"REDUCER_ADDRESSES": "h:1", "REDUCER_RANK": "0",
                                  "REDUCER_WORLD_SIZE": "1", "REDUCER_DATA_PLANE": value})
    assert settings.get("data_plane", "auto") == expected


def test_bad_data_plane_is_a_clear_error():
    from reducer_client.env import data_plane_from_env
    with pytest.raises(ValueError, match="REDUCER_DATA_PLANE must be auto, tcp or grpc"):
        data_plane_from_env({"REDUCER_DATA_PLANE": "udp"})
    from reducer_client import ReducerClient
    with pytest.raises(ValueError, match="data_plane must be one of"):
        ReducerClient(["127.0.0.1:1"], "j", 0, 1, data_plane="udp")


# What os.environ says in the tests below: were it read, the client would
# differ in its data plane, its conversions, its node group (L = 2) and its
# chunk sizes (a 200 Mbit/s link).
OTHER_ENVIRONMENT = {"REDUCER_DATA_PLANE": "tcp", "REDUCER_WIRE_NUMPY": "1",
                     "REDUCER_LINK_GBIT": "0.2",
                     "REDUCER_LOCAL_RANK": "0", "REDUCER_LOCAL_SIZE": "2",
                     "REDUCER_NODE_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


@pytest.fixture
def other_environment(monkeypatch):
    from reducer_wire import convert
    for name, value in OTHER_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    previous = convert.use_accelerator(True)
    yield
    convert.use_accelerator(previous)


def _chain(client):
    return [[t.name for t in link._transports] for link in client._links]


def test_from_env_mapping_is_read_alone(other_environment):
    """from_env(mapping) reads nothing from os.environ: not the data plane,
    not REDUCER_WIRE_NUMPY, not the node-local settings."""
    from reducer_client import ReducerClient
    from reducer_wire import convert
    mapping = {"REDUCER_ADDRESSES": "127.0.0.1:1", "REDUCER_RANK": "1",
               "REDUCER_WORLD_SIZE": "2", "REDUCER_JOB": "mapping-only"}
    with ReducerClient.from_env(mapping) as client:
        assert client._node is None and (client.local_rank, client.local_size) == (0, 1)
        assert _chain(client) == [["tcp", "grpc"]]  # auto, not os.environ's tcp
        assert convert.accelerated() == _kernels_built()
        assert client.job == "mapping-only" and client.timeout == 60.0
        assert client.link_gbit is None
    with ReducerClient.from_env({**mapping, "REDUCER_WIRE_NUMPY": "1",
                                 "REDUCER_DATA_PLANE": "grpc"}) as client:
        assert not convert.accelerated() and _chain(client) == [["grpc"]]


def test_the_constructor_keeps_its_environment_defaults(other_environment, monkeypatch):
    """Called directly, the documented defaults still come from os.environ."""
    from reducer_client import ReducerClient
    from reducer_wire import convert
    monkeypatch.setenv("REDUCER_NODE_LOCAL", "0")  # no node group for this one
    with ReducerClient(["127.0.0.1:1"], "j", 0, 2) as client:
        assert _chain(client) == [["tcp"]] and not convert.accelerated()
        assert (client.local_rank, client.local_size) == (0, 2) and client._node is None
        assert client.link_gbit == 0.2


def _kernels_built():
    import importlib.util
    return importlib.util.find_spec("reducer_wire._kernels") is not None


def test_the_link_rate_sizes_the_chunks_and_is_in_the_fingerprint():
    """link_gbit / REDUCER_LINK_GBIT: the chunks of a key are cut for it
    (reducer_wire.layout rule v4), and ranks given another rate or a fixed
    chunk size send another layout fingerprint; bad rates are named."""
    from reducer_client import ReducerClient
    from reducer_client.env import link_gbit_from_env
    from reducer_wire import dtypes
    from reducer_wire.layout import KeyLayout

    assert link_gbit_from_env({}) is None and link_gbit_from_env({"REDUCER_LINK_GBIT": ""}) is None
    assert link_gbit_from_env({"REDUCER_LINK_GBIT": " 25 "}) == 25.0
    for bad in ("fast", "0", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=f"REDUCER_LINK_GBIT='{bad}': give the link rate"):
            link_gbit_from_env({"REDUCER_LINK_GBIT": bad})
    for bad in (0, -2.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="link_gbit must be a link rate in Gbit/s"):
            ReducerClient(["127.0.0.1:1", "127.0.0.1:2"], "j", 0, 1, link_gbit=bad)
    f16 = dtypes.WIRE_DTYPES["float16"]
    base = {"REDUCER_ADDRESSES": "127.0.0.1:1,127.0.0.1:2", "REDUCER_RANK": "0",
            "REDUCER_WORLD_SIZE": "1", "REDUCER_NODE_LOCAL": "0"}
    layouts = {}
    for name, extra in (("fast", {}), ("25", {"REDUCER_LINK_GBIT": "25"}),
                        ("slow", {"REDUCER_LINK_GBIT": "0.2"}),
                        ("fixed", {"REDUCER_CHUNK_BYTES": str(1 << 20)})):
        with ReducerClient.from_env({**base, **extra}) as client:
            layouts[name] = client._layouts
            assert client._layout == KeyLayout.for_link(
                2, client.chunk_bytes if name == "fixed" else None,
                None if client.link_gbit is None else client.link_gbit * 125e6)
            sizes = {c.numel for c in client._layout.plan(16 << 20, f16, "k")}
            assert sizes == {256 << 10 if name == "slow" else 512 << 10}
    # 25 Gbit/s is more than a daemon sums: the same chunks as a fast network.
    assert layouts["fast"] == layouts["25"]
    assert len({tuple(v) for v in layouts.values()}) == 3


def test_bad_timeout_is_a_clear_error():
    with pytest.raises(ValueError, match="REDUCER_TIMEOUT='soon' is not a number"):
        settings_from_env({"REDUCER_ADDRESSES": "h:1", "REDUCER_RANK": "0",
                           "REDUCER_WORLD_SIZE": "1", "REDUCER_TIMEOUT": "soon"})


def test_the_client_loop_is_on_unless_switched_off():
    assert client_loop_from_env({}) is True
    for on in ("1", "true", "YES", " on "):
        assert client_loop_from_env({"REDUCER_CLIENT_C_LOOP": on}) is True
    for off in ("0", "false", "No", "off"):
        assert client_loop_from_env({"REDUCER_CLIENT_C_LOOP": off}) is False
    with pytest.raises(ValueError, match="REDUCER_CLIENT_C_LOOP='maybe': use 1 or 0"):
        client_loop_from_env({"REDUCER_CLIENT_C_LOOP": "maybe"})


def test_data_loop_setting_from_flag_environment_and_file(tmp_path):
    """--data-loop beats $REDUCERD_DATA_LOOP, which beats the TOML file's data-loop."""
    from reducerd.ops.options import DEFAULT_DATA_LOOP

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def config(*argv, environ=None):
        return config_from_args(parser.parse_args(list(argv)), environ or {})

    assert config().data_loop == DEFAULT_DATA_LOOP
    path = tmp_path / "reducerd.toml"
    path.write_text('data-loop = "c"\n')
    assert config("--config", str(path)).data_loop == "c"
    assert config("--config", str(path),
                  environ={"REDUCERD_DATA_LOOP": "python"}).data_loop == "python"
    assert config("--data-loop", "c", environ={"REDUCERD_DATA_LOOP": "python"}).data_loop == "c"
    with pytest.raises(ConfigError, match="data_loop: one of c, python, got 'rust'"):
        config("--data-loop", "rust")
    with pytest.raises(ConfigError, match="data_loop: one of c, python, got 'C '"):
        config(environ={"REDUCERD_DATA_LOOP": "C "})

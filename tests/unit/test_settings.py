"""Daemon Config (flags, TOML) and client settings from the environment."""

import argparse
import json

import pytest
from reducer_client.env import settings_from_env

from reducerd.config import ConfigError, add_arguments, config_from_args


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


def test_listen_is_required():
    with pytest.raises(ConfigError, match="listen"):
        parse()


def test_from_env_reducer_variables():
    settings = settings_from_env({"REDUCER_ADDRESSES": "h1:1, h2:2", "REDUCER_JOB": "bert",
                                  "REDUCER_RANK": "3", "REDUCER_WORLD_SIZE": "8",
                                  "REDUCER_TOKEN": "s3cret", "REDUCER_WIRE_DTYPE": "bfloat16"})
    assert settings == {"addresses": ["h1:1", "h2:2"], "job": "bert", "rank": 3,
                        "world_size": 8, "token": "s3cret", "wire_dtype": "bfloat16"}


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


def test_data_listen_is_off_under_tls_and_cannot_be_forced(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    tls = ("--listen", "127.0.0.1:7000", "--tls-cert", str(cert), "--tls-key", str(key))
    assert parse(*tls).data_address is None
    with pytest.raises(ConfigError, match="not encrypted"):
        parse(*tls, "--data-listen", "127.0.0.1:7100")


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

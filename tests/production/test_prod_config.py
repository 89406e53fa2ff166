"""Configuration for operators: the TOML file, --print-config, start-up errors.

Scenarios: the example file names every option and loads; --print-config
prints TOML that reads back to the same Config, flags applied; bad files stop
the daemon at start with exit 2 and a message naming the key; the template's
port offset and the systemd token credential resolve as documented.
"""

import argparse
import dataclasses
import re
import subprocess
import sys
import tomllib

import pytest
from conftest import DEPLOY

from reducerd.ops.config import _FLAGS, Config, ConfigError, add_arguments, config_from_args

EXAMPLE = DEPLOY / "reducerd.toml.example"


def parse(*argv, environ=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)), environ=environ or {})


def toml_key(flag: str) -> str:
    return flag[2:].replace("-", "_")


def test_every_option_has_a_toml_key_in_the_example():
    text = EXAMPLE.read_text()
    documented = set(re.findall(r"(?m)^#? ?([a-z_]+) = ", text))
    assert {toml_key(flag) for flag in _FLAGS} <= documented


def test_example_config_loads():
    config = parse("--config", str(EXAMPLE))
    assert config.listen == "0.0.0.0:7000" and config.metrics_listen == "0.0.0.0:9400"


def test_print_config_reads_back_to_the_same_config(tmp_path):
    result = subprocess.run([sys.executable, "-m", "reducerd", "--config", str(EXAMPLE),
                             "--round-timeout", "7", "--print-config"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "round_timeout = 7.0" in result.stdout
    printed = tmp_path / "printed.toml"
    printed.write_text(result.stdout)
    assert set(tomllib.loads(result.stdout)) <= {toml_key(f) for f in _FLAGS}
    assert parse("--config", str(printed)) == parse("--config", str(EXAMPLE),
                                                    "--round-timeout", "7")


def test_print_config_round_trips_every_kind_of_value(tmp_path):
    token = tmp_path / "token"
    token.write_text("t")
    config = parse("--listen", "[::1]:7000", "--auth-token-file", str(token),
                   "--drain-grace", "1e-3", "--log-level", "debug", "--port-offset", "2")
    path = tmp_path / "again.toml"
    path.write_text(config.to_toml())
    assert parse("--config", str(path)) == config
    assert "serving on [::1]:7002" in config.to_toml()


@pytest.mark.parametrize("toml,message", [
    ('listen = "127.0.0.1:1"\nround-timout = 3\n', "unknown key 'round-timout'"),
    ('listen = "127.0.0.1:1"\nmax_inflight_bytes = "2G"\n', "max_inflight_bytes"),
    ('listen = "127.0.0.1:1"\nmax_inflight_bytes = 10\n', "max_inflight_bytes: must be"),
    ('listen = "127.0.0.1:1"\nmetrics_listen = "9400"\n', "metrics_listen: expected HOST:PORT"),
    ('listen = "127.0.0.1:1"\nmetrics_max_jobs = -1\n', "metrics_max_jobs"),
    ('listen = "127.0.0.1:1"\nstalled_after = 0\n', "stalled_after_s: must be > 0"),
    ('listen = "127.0.0.1:1"\nlog_level = "loud"\n', "log_level"),
    ('listen = "127.0.0.1:0"\nport_offset = 5\n', "port_offset: needs a fixed listen port"),
    ('listen = "127.0.0.1:65535"\nport_offset = 5\n', "passes 65535"),
    ('listen = "127.0.0.1:1"\nauth_token_file = "/nonexistent/token"\n', "auth_token_file"),
    ('listen = "127.0.0.1:1"\ntls_cert = "/etc/hostname"\n', "tls_cert and tls_key"),
    ('listen = "127.0.0.1:1"\ndrain_grace = true\n', "drain_grace"),
    ('listen = "127.0.0.1:1"\nbogus = 1\n', "unknown key 'bogus'"),
    ('listen = "127.0.0.1:1"\nround_timeout = "soon"\n', "round_timeout"),
    ('listen = "nohostport"\n', "HOST:PORT"),
    ('listen = "127.0.0.1:1"\nround_timeout = -1\n', "round_timeout_s: must be > 0"),
    ('listen = ', "not valid TOML"),
])
def test_bad_config_is_a_clear_error(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        parse("--config", str(path))


def test_daemon_with_a_bad_config_exits_2_naming_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('listen = "127.0.0.1:0"\nround_timeout = -5\n')
    result = subprocess.run([sys.executable, "-m", "reducerd", "--config", str(path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "round_timeout_s: must be > 0, got -5" in result.stderr


def test_port_offset_shifts_listen_and_metrics_ports():
    config = parse("--listen", "0.0.0.0:7000", "--metrics-listen", "0.0.0.0:9400",
                   "--port-offset", "3")
    assert config.listen_address == "0.0.0.0:7003"
    assert config.metrics_address == "0.0.0.0:9403"
    assert Config(listen="h:1").validate().listen_address == "h:1"


def test_token_from_a_systemd_credential(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    config = parse("--listen", "h:1", "--auth-token-credential", "token",
                   environ={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert config.auth_token() == "s3cret"
    assert config.token_path == str(tmp_path / "token")
    assert dataclasses.replace(config, credentials_directory=None).auth_token_file is None


@pytest.mark.parametrize("argv,environ,message", [
    (["--auth-token-credential", "token"], {}, r"\$CREDENTIALS_DIRECTORY is not set"),
    (["--auth-token-credential", "other"], None, "no credential 'other'"),
    (["--auth-token-credential", "../token"], None, "not a path"),
    (["--auth-token-credential", "token", "--auth-token-file", "/etc/hostname"], None,
     "give one, not both"),
])
def test_bad_credential_is_a_clear_error(tmp_path, argv, environ, message):
    (tmp_path / "token").write_text("s3cret\n")
    environ = {"CREDENTIALS_DIRECTORY": str(tmp_path)} if environ is None else environ
    with pytest.raises(ConfigError, match=message):
        parse("--listen", "h:1", *argv, environ=environ)


def test_empty_credential_is_refused(tmp_path):
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ConfigError, match="auth_token_credential: .* holds only blanks"):
        parse("--listen", "h:1", "--auth-token-credential", "token",
              environ={"CREDENTIALS_DIRECTORY": str(tmp_path)})


def test_listen_defaults_to_loopback_port_7070(tmp_path):
    """`reducerd` alone runs (contract section 3): --listen defaults to
    127.0.0.1:7070, shown by --print-config; a real start binds what it is given."""
    from support import start_daemon

    from reducerd.ops.config import DEFAULT_LISTEN

    assert Config().listen == DEFAULT_LISTEN == "127.0.0.1:7070"
    config = parse()
    assert config.listen_address == "127.0.0.1:7070"
    assert config.data_address == ("127.0.0.1", 0)  # the data plane beside it, any port
    assert parse("--port-offset", "2").listen_address == "127.0.0.1:7072"
    result = subprocess.run([sys.executable, "-m", "reducerd", "--print-config"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["listen"] == "127.0.0.1:7070"
    daemon = start_daemon(log_dir=tmp_path)  # --listen 127.0.0.1:0
    try:
        assert daemon.address.startswith("127.0.0.1:") and not daemon.address.endswith(":0")
    finally:
        assert daemon.stop() == 0

"""Repository-level checks: generated code is fresh, the core imports no framework."""

import filecmp
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_proto_code_is_fresh(tmp_path):
    """Committed *_pb2*.py match what grpcio-tools makes from protos/ now."""
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools not installed")
    subprocess.run([sys.executable, str(ROOT / "scripts/gen_proto.py"), str(tmp_path)],
                   check=True)
    generated = tmp_path / "reducer_client/_proto/reducer/v1"
    committed = ROOT / "clients/reducer_client/_proto/reducer/v1"
    for name in ("reducer_pb2.py", "reducer_pb2_grpc.py", "reducer_pb2.pyi"):
        assert filecmp.cmp(generated / name, committed / name, shallow=False), (
            f"{name} is stale: run `make proto` and commit the result")


def test_core_and_daemon_import_no_framework():
    code = ("import sys, reducer_client, reducer_client.client, reducer_client.testing, "
            "reducerd.server, reducerd.__main__; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'mxnet', 'keras') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "[]"


def test_c_conversions_are_built_and_current_where_a_compiler_is():
    """setup.py builds reducer_client._fastwire optionally, so a failed build
    would only make everything slower: fail here instead. A stale build (the
    C file changed since) is caught too: `make` rebuilds it."""
    import shutil

    from reducer_client import wire
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the NumPy conversions are used")
    assert wire.accelerated(), "reducer_client._fastwire is missing: run `make build`"
    import reducer_client._fastwire as fastwire
    source = ROOT / "clients/reducer_client/_fastwire.c"
    built = Path(fastwire.__file__)
    if built.is_relative_to(ROOT):
        assert built.stat().st_mtime >= source.stat().st_mtime, (
            f"{built.name} is older than _fastwire.c: run `make build`")

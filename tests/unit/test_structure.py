"""Repository-level checks: the layers of ../shared/INTERFACE.md section 1 hold.

reducerd and reducer_client meet only in reducer_wire; the client core imports
no framework; generated code is fresh; the C kernels are built; no module
grows past the size one reader can hold.
"""

import ast
import filecmp
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAEMON = ROOT / "reducerd"
CLIENT = ROOT / "clients/reducer_client"
WIRE = ROOT / "protos/python/reducer_wire"
MAX_MODULE_LINES = 400


def _modules(package: Path, skip: tuple[str, ...] = ()) -> list[Path]:
    return [p for p in sorted(package.rglob("*.py"))
            if "_proto" not in p.parts and not any(p.is_relative_to(package / s) for s in skip)]


def _imported(path: Path) -> set[str]:
    """Top-level-qualified names of every module `path` imports (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _offenders(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {name}" for p in paths
            for name in sorted(_imported(p))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_daemon_never_imports_the_client():
    """The daemon (all but its bench, the leaf that drives real workers) meets
    the client only in reducer_wire."""
    assert _offenders(_modules(DAEMON, skip=("bench",)), ("reducer_client",)) == []


def test_only_the_command_line_reaches_the_bench():
    paths = [p for p in _modules(DAEMON, skip=("bench",)) if p.name != "__main__.py"]
    assert _offenders(paths, ("reducerd.bench",)) == []


def test_wire_package_imports_neither_side():
    assert _offenders(_modules(WIRE), ("reducerd", "reducer_client")) == []


def test_client_imports_no_daemon_and_carries_no_daemon_code():
    assert _offenders(_modules(CLIENT), ("reducerd",)) == []
    daemon_only = ("add_wire_into", "copy_wire_into", "f16_add", "bf16_add")
    found = [f"{p.relative_to(ROOT)}: {name}" for p in _modules(CLIENT)
             for name in daemon_only if name in p.read_text()]
    assert found == []
    # Its one C module is the data-plane loop, which converts through
    # reducer_wire's kernels (their C API, _api.h), with no conversion of its own.
    sources = list(CLIENT.rglob("*.c"))
    assert [p.relative_to(CLIENT).as_posix() for p in sources] == ["transport/_tcploop.c"]
    loop = sources[0].read_text()
    assert "reducer_wire/_api.h" in loop
    assert not any(word in loop for word in ("_mm", "half_bits", "round_to_nearest"))


def test_client_layers_read_straight_down():
    """transport and node sit below the client facade and the operation; the
    core sits below the framework shims; nothing climbs back up."""
    shims = ("reducer_client.torch", "reducer_client.tensorflow", "reducer_client.mxnet")
    upper = ("reducer_client.client", "reducer_client.process", *shims)
    assert _offenders(_modules(CLIENT / "transport"), (*upper, "reducer_client.node")) == []
    assert _offenders(_modules(CLIENT / "node"), (*upper, "reducer_client.transport")) == []
    core = [p for p in _modules(CLIENT) if not any(
        p.is_relative_to(CLIENT / s) or p.stem == s for s in ("torch", "tensorflow", "mxnet"))]
    assert _offenders(core, (*shims, "torch", "tensorflow", "keras", "mxnet")) == []


@pytest.mark.parametrize("package", [DAEMON, CLIENT, WIRE], ids=lambda p: p.name)
def test_no_module_over_the_size_limit(package):
    long = {str(p.relative_to(ROOT)): n for p in _modules(package)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_generated_proto_code_is_fresh(tmp_path):
    """Committed *_pb2*.py match what grpcio-tools makes from protos/ now."""
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools not installed")
    subprocess.run([sys.executable, str(ROOT / "scripts/gen_proto.py"), str(tmp_path)],
                   check=True)
    generated = tmp_path / "reducer_wire/_proto/reducer/v1"
    committed = WIRE / "_proto/reducer/v1"
    for name in ("reducer_pb2.py", "reducer_pb2_grpc.py", "reducer_pb2.pyi"):
        assert filecmp.cmp(generated / name, committed / name, shallow=False), (
            f"{name} is stale: run `make proto` and commit the result")


def test_core_and_daemon_import_no_framework_and_no_each_other():
    code = ("import sys, reducer_client, reducer_client.client, reducer_client.testing; "
            "client = sorted(m for m in ('torch', 'tensorflow', 'mxnet', 'keras', 'reducerd') "
            "if m in sys.modules); "
            "import reducerd.daemon.server, reducerd.daemon.status, reducerd.__main__; "
            "print(client, 'reducer_client.torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "[] False"
    code = ("import sys, reducerd.daemon.server, reducerd.daemon.status, reducerd.ops.metrics, "
            "reducerd.__main__; "
            "print(sorted(m for m in sys.modules if m.startswith('reducer_client')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "[]"


def test_c_kernels_are_built_and_current_where_a_compiler_is():
    """setup.py builds reducer_wire._kernels optionally, so a failed build
    would only make everything slower: fail here instead. A stale build (the
    C file changed since) is caught too: `make` rebuilds it."""
    import shutil

    from reducer_wire import convert
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the NumPy conversions are used")
    assert convert.accelerated(), "reducer_wire._kernels is missing: run `make build`"
    import reducer_wire._kernels as kernels
    source = WIRE / "_kernels.c"
    built = Path(kernels.__file__)
    if built.is_relative_to(ROOT):
        assert built.stat().st_mtime >= source.stat().st_mtime, (
            f"{built.name} is older than _kernels.c: run `make build`")


def test_the_daemons_c_summing_pool_is_built_and_current_where_a_compiler_is():
    """reducerd.core._sumpool is optional too (the Python SummingPool stands in), so
    a failed or stale build would pass every test on the slower pool: fail here."""
    import shutil

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the Python summing pool is used")
    from reducerd.core.summing_c import CSummingPool, _sumpool, summing_pool
    assert _sumpool is not None, "reducerd.core._sumpool is missing: run `make build`"
    assert isinstance(summing_pool(2), CSummingPool)
    built = Path(_sumpool.__file__)
    if built.is_relative_to(ROOT):
        for source in sorted((DAEMON / "core").glob("_sumpool*.[ch]")):
            assert built.stat().st_mtime >= source.stat().st_mtime, (
                f"{built.name} is older than {source.name}: run `make build`")

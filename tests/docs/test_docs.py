"""The documentation site: its generated pages, its strict build and its pages' code.

The tutorial's, the how-tos' and the README's shell blocks start real daemons
on 127.0.0.1 (on free ports, substituted for the page's) and their Python
blocks run against them (page_blocks.py); a block that cannot run here says
why. The generated pages (CLI, options table, benchmark results, README's
figures) must be what their generators make now.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "scripts"))
import gen_bench_pages  # noqa: E402
import gen_cli_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import page_blocks  # noqa: E402

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
README = ROOT / "README.md"


def _env() -> dict[str, str]:
    paths = [str(ROOT), str(ROOT / "clients"), str(ROOT / "protos" / "python")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


@pytest.mark.timeout(60)
def test_cli_reference_is_what_the_parsers_print():
    assert (DOCS / "reference" / "cli.md").read_text() == gen_cli_reference.render(), (
        "docs/reference/cli.md is stale: run scripts/gen_cli_reference.py")


@pytest.mark.timeout(60)
def test_options_table_is_what_the_code_says():
    page = (DOCS / "reference" / "configuration.md").read_text()
    assert page == gen_cli_reference.render_configuration(page), (
        "docs/reference/configuration.md's options table is stale: run "
        "scripts/gen_cli_reference.py")
    from reducerd.ops.options import _FLAGS

    for flag in _FLAGS:  # every option has its row
        assert f"| `{flag}` |" in page, flag


@pytest.mark.timeout(30)
def test_reference_names_every_client_variable_and_metric():
    """The environment variables the client reads and the metrics the daemon serves
    each appear in their reference page."""
    env_code = (ROOT / "clients" / "reducer_client" / "env.py").read_text()
    env_code += (ROOT / "clients" / "reducer_client" / "elastic" / "lobby.py").read_text()
    config_page = (DOCS / "reference" / "configuration.md").read_text()
    variables = set(re.findall(r"\bREDUCER_[A-Z0-9_]*[A-Z0-9]\b", env_code))
    assert {"REDUCER_ADDRESSES", "REDUCER_CLIENT_C_LOOP"} <= variables
    assert not {v for v in variables if v not in config_page}
    metrics_code = (ROOT / "reducerd" / "ops" / "metrics.py").read_text()
    metrics_page = (DOCS / "reference" / "metrics.md").read_text()
    names = set(re.findall(r'"(reducerd_[a-z_]+)"', metrics_code))
    assert len(names) >= 10
    assert not {n for n in names if n not in metrics_page}


@pytest.mark.timeout(60)
def test_pages_speak_of_no_sessions_or_issue_numbers():
    """What is true now, for a user: no history in the docs or the README."""
    for page in [README, *DOCS.rglob("*")]:
        if page.is_file():
            text = page.read_text(errors="replace")
            assert not re.search(r"session|issue [0-9]", text, re.I), page


@pytest.mark.timeout(30)
def test_docs_stay_small():
    total = sum(p.stat().st_size for p in DOCS.rglob("*") if p.is_file())
    assert total < 1_000_000, f"docs/ holds {total} bytes: keep only current results"


@pytest.mark.timeout(60)
def test_benchmark_pages_and_readme_figures_are_what_the_json_says():
    for path, text in gen_bench_pages.outputs().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run scripts/gen_bench_pages.py")
    assert gen_bench_pages.README_START in README.read_text()


@pytest.mark.timeout(30)
def test_benchmark_page_shows_the_recorded_command_cpu_and_date():
    bench = gen_bench_pages.BENCHMARKS[0]
    data = json.loads(bench.data.read_text())
    data["config"]["host"] = {"cpu_model": "Test CPU 9000", "cpus": 2, "python": "3.11.7",
                              "kernel": "6.1", "date": "2030-01-02T03:04:05Z",
                              "command": "reducerd bench --workers 9 --daemons 9"}
    page = gen_bench_pages.render_page(bench, data)
    assert "- CPU: Test CPU 9000, 2 logical CPUs" in page
    assert "- Date (UTC): 2030-01-02T03:04:05Z" in page
    assert "reducerd bench --workers 9 --daemons 9" in page  # measured otherwise: said so
    assert bench.command in page
    total_s = sum(b.run_s for b in gen_bench_pages.BENCHMARKS)
    assert total_s <= 15 * 60, "the benchmarks the docs quote must re-run in 15 minutes"


@pytest.mark.timeout(30)
def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) < 150
    assert "make test" in text  # CI's command
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).exists(), f"README links to a missing {target}"


@pytest.mark.timeout(90)
def test_readme_blocks_run(tmp_path):
    _run_page_blocks(README, tmp_path, timeout_s=80)


@pytest.mark.timeout(120)
def test_site_builds_strict_with_no_warning(tmp_path):
    if shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists():
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    run = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=110,
                         env={**_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WARNING" not in run.stderr, run.stderr[-3000:]
    assert (tmp_path / "site" / "tutorial" / "first-job" / "index.html").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(port: int, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"no daemon serving on 127.0.0.1:{port} after {deadline_s} s")


@pytest.mark.timeout(90)
def test_tutorial_blocks_run_against_real_daemons():
    text = (DOCS / "tutorial" / "first-job.md").read_text()
    blocks = BLOCK.findall(text)
    assert [lang for lang, _ in blocks] == ["bash", "bash", "python"]
    ports = {"7071": str(_free_port()), "7072": str(_free_port())}

    def local(code: str) -> str:
        for page_port, port in ports.items():
            code = code.replace(f"127.0.0.1:{page_port}", f"127.0.0.1:{port}")
        return code

    daemons = []
    try:
        for line in blocks[0][1].strip().splitlines():
            argv = local(line.rstrip(" &")).split()
            assert argv[0] == "reducerd"
            daemons.append(subprocess.Popen([sys.executable, "-m", "reducerd", *argv[1:]],
                                            env=_env(), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE))
        for port in ports.values():
            _wait_serving(int(port), 30)
        status_argv = local(blocks[1][1].strip()).split()
        status = subprocess.run([sys.executable, "-m", "reducerd", *status_argv[1:]],
                                env=_env(), capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        worker = subprocess.run([sys.executable, "-c", local(blocks[2][1])], env=_env(),
                                capture_output=True, text=True, timeout=60)
        assert worker.returncode == 0, worker.stderr[-3000:]
        assert "mean of 1 and 2 on both ranks: [1.5 1.5 1.5]" in worker.stdout
    finally:
        for proc in daemons:
            proc.send_signal(signal.SIGTERM)
        for proc in daemons:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


# -- every how-to's code blocks ------------------------------------------------

HOWTOS = sorted((DOCS / "howto").glob("*.md"))
# Pages whose blocks need another interpreter than this one: its bin/ first on PATH.
PAGE_PYTHON = {"mxnet.md": ROOT / ".venv-mxnet" / "bin"}
PAGE_TIMEOUT_S = {"keras.md": 120}  # two TensorFlow imports


@pytest.mark.timeout(30)
@pytest.mark.parametrize("page", HOWTOS, ids=[p.name for p in HOWTOS])
def test_every_block_runs_or_says_why_not(page):
    """A block the runner would skip names its reason; output blocks alone go unmarked."""
    for block in page_blocks.blocks(page.read_text()):
        runnable = block.lang in page_blocks.RUNNABLE or block.title
        if block.not_run is None:
            assert runnable or block.lang in page_blocks.OUTPUT, (
                f"{page.name}: a {block.lang} block neither runs nor says why not "
                f"(<!-- not-run: REASON -->):\n{block.code[:200]}")
        else:
            assert len(block.not_run) >= 10, f"{page.name}: give the reason: {block.not_run!r}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("page", HOWTOS, ids=[p.name for p in HOWTOS])
def test_howto_blocks_run(page, tmp_path):
    _run_page_blocks(page, tmp_path, PAGE_TIMEOUT_S.get(page.name, 90))


def _run_page_blocks(page: Path, tmp_path: Path, timeout_s: float) -> None:
    text = page.read_text()
    runnable = [b for b in page_blocks.blocks(text)
                if b.not_run is None and b.lang in page_blocks.RUNNABLE]
    if not runnable:
        pytest.skip(f"{page.name} has no runnable block (each says why)")
    env = _env()
    bin_dir = PAGE_PYTHON.get(page.name, Path(sys.executable).parent)
    if not (bin_dir / "python").exists():
        pytest.skip(f"{page.name} needs {bin_dir.parent} (make venv-mxnet)")
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    script = page_blocks.script(text, page_blocks.local_ports(text))
    for name in ("deploy", "examples"):  # the pages run from the repository root
        (tmp_path / name).symlink_to(ROOT / name)
    try:
        run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=timeout_s,
                             start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{page.name}: its blocks ran past {timeout_s} s\n"
                             f"{(exc.stderr or b'')[-3000:]!r}") from None
    assert run.returncode == 0, f"{page.name}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"


@pytest.mark.timeout(30)
def test_bench_docs_runs_each_command_into_its_json(monkeypatch):
    """`make bench-docs` runs every listed command, writing the JSON its page reads,
    and stops at the first failure; the emulated ones ask for root."""
    calls = []

    def fake_run(argv, cwd, env):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1 if len(calls) == 2 else 0)

    monkeypatch.setattr(gen_bench_pages.os, "geteuid", lambda: 0)
    assert gen_bench_pages.run([], python="py", runner=fake_run) == 1
    first = gen_bench_pages.BENCHMARKS[0]
    assert calls[0] == ["py", "-m", "reducerd", "bench", *first.argv, "--json", str(first.data)]
    assert len(calls) == 2  # stopped at the failing second
    monkeypatch.setattr(gen_bench_pages.os, "geteuid", lambda: 1000)
    rooted = [b.name for b in gen_bench_pages.BENCHMARKS if b.root]
    assert gen_bench_pages.run(rooted[:1], python="py", runner=fake_run) == 2
    assert gen_bench_pages.run(["no-such-benchmark"], runner=fake_run) == 2

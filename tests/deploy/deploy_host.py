"""The host side of the deploy tier: what it needs, and the cached root filesystem.

The tier needs root, Debian's packages (systemd-container, debootstrap,
docker.io; installed with apt-get when missing) and Debian's mirror. Where
that is not at hand it fails, saying why, unless REDUCER_SKIP_DEPLOY_TESTS
names the part ("systemd", "docker", or both, comma-separated).

The root filesystem, a Debian bookworm made by debootstrap, is cached under
CACHE_DIR keyed by everything that goes into it (a new key replaces the old
one, so the cache holds one), built under a lock so that two runs on one
machine share it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_VARIABLE = "REDUCER_SKIP_DEPLOY_TESTS"
PARTS = ("systemd", "docker")
CACHE_DIR = Path(os.environ.get("REDUCER_DEPLOY_CACHE", "/var/cache/reducerd-deploy-tests"))

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# deploy/systemd/README.md and deploy/k8s/README.md give the same command.
DEBOOTSTRAP_ARGS = ("--variant=minbase",
                    "--include=systemd,systemd-sysv,dbus,python3,python3-venv")
# Host commands and the Debian packages that bring them.
HOST_PACKAGES = {"systemd-nspawn": "systemd-container", "debootstrap": "debootstrap",
                 "dockerd": "docker.io", "/usr/bin/docker": "docker.io"}
# What `pip install .` reads: the Dockerfile copies the same (deploy/k8s/Dockerfile).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "reducerd", "clients", "protos")


def skipped_parts(environ=os.environ) -> set[str]:
    names = {n.strip() for n in environ.get(SKIP_VARIABLE, "").split(",") if n.strip()}
    unknown = names - set(PARTS)
    if unknown:
        pytest.fail(f"{SKIP_VARIABLE}={environ[SKIP_VARIABLE]!r}: unknown part(s) "
                    f"{sorted(unknown)}; the parts are {', '.join(PARTS)}", pytrace=False)
    return names


def require(part: str) -> None:
    """Skip `part` if the environment asks to; fail, saying why, if it cannot run."""
    if part in skipped_parts():
        pytest.skip(f"the {part} deploy tests: skipped by {SKIP_VARIABLE}")
    if not sys.platform.startswith("linux"):
        pytest.fail(f"the {part} deploy tests need Linux (set {SKIP_VARIABLE}={part} "
                    f"to skip them)", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail(f"the {part} deploy tests need root: they boot a container and "
                    f"install packages (run as root, or set {SKIP_VARIABLE}={part})",
                    pytrace=False)


def terminate_with_parent() -> None:
    """A Popen preexec_fn: SIGTERM the child when this process dies, however it dies
    (a killed test run must not leave a booted machine or a dockerd behind)."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run(argv, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run argv; on failure, fail the test with its output."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv))} exited {result.returncode}:\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}", pytrace=False)
    return result


@contextmanager
def cache_lock():
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def install_host_packages() -> None:
    """apt-get install what is missing (once per machine: the packages stay)."""
    missing = sorted({package for command, package in HOST_PACKAGES.items()
                      if shutil.which(command) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        pytest.fail(f"missing {', '.join(missing)} and no apt-get to install them",
                    pytrace=False)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock_wait = ("-o", "DPkg::Lock::Timeout=300")
    with cache_lock():
        run(["apt-get", *lock_wait, "update", "-qq"], timeout=600, env=env)
        run(["apt-get", *lock_wait, "install", "-y", "-qq", *missing], timeout=900, env=env)


def rootfs_key() -> str:
    recipe = {"suite": SUITE, "mirror": MIRROR, "args": DEBOOTSTRAP_ARGS, "format": 1}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def cached_rootfs() -> Path:
    """The debootstrapped bookworm root filesystem, built on the first call per machine."""
    install_host_packages()
    key = rootfs_key()
    path = CACHE_DIR / f"rootfs-{key}"
    with cache_lock():
        if (path / "usr/bin/python3").exists():
            return path
        partial = CACHE_DIR / f"rootfs-{key}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        log = CACHE_DIR / "debootstrap.log"
        with open(log, "w") as out:
            code = subprocess.run(["debootstrap", *DEBOOTSTRAP_ARGS, SUITE, str(partial),
                                   MIRROR], stdout=out, stderr=subprocess.STDOUT,
                                  timeout=900).returncode
        if code != 0:
            tail = log.read_text()[-3000:]
            shutil.rmtree(partial, ignore_errors=True)
            pytest.fail(f"debootstrap {SUITE} from {MIRROR} exited {code} (is the mirror "
                        f"reachable?):\n{tail}", pytrace=False)
        # machine-id empty: systemd makes one per boot; no apt lists kept.
        (partial / "etc/machine-id").write_text("")
        partial.rename(path)
        for old in CACHE_DIR.glob("rootfs-*"):  # one cached root filesystem at a time
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    return path


def copy_sources(dest: Path) -> Path:
    """The files `pip install .` reads, without build outputs, into dest."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build")
    dest.mkdir(parents=True)
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)
    return dest


def build_wheels(workdir: Path) -> Path:
    """Wheels of reducerd (C extension compiled here) and its dependencies, for
    Python 3.11 on glibc like the machine's: pip inside the container has no way
    to verify the registry's certificate here, the host's pip has."""
    sources = copy_sources(workdir / "src")
    wheels = workdir / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels),
         str(sources)], timeout=600)
    build_requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"][
        "requires"]
    # The image builds reducerd itself: it needs the build backend too.
    run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels),
         *build_requires], timeout=600)
    return wheels

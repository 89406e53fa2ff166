"""A Docker engine for the image checks, and the pod's settings as `docker run` flags.

No container registry is reachable here: the base image is the cached
debootstrap root filesystem (`docker import`), passed to deploy/k8s/Dockerfile
as BASE_IMAGE. pip inside the build cannot verify the registry's certificate
either, so the build reads the wheels built on the host from a web server on
127.0.0.1 (the build runs on the host network; PIP_NO_INDEX, PIP_FIND_LINKS).

A running engine (docker info answers) is used as it is; otherwise dockerd is
started with its own socket, under a lock (one per machine), its images and
build cache kept under CACHE_DIR/docker for the next run, and stopped after.
That dockerd leaves the host's firewall and forwarding alone (the build uses
the host's network, the tests reach the containers through the bridge, which
needs neither), and its bridge goes with it.
"""

from __future__ import annotations

import fcntl
import functools
import http.server
import os
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from deploy_host import CACHE_DIR, ROOT, rootfs_key, terminate_with_parent

DOCKER = "/usr/bin/docker"  # Debian's client, the engine's version (docker.io)
RUN_DIR = Path("/run/reducerd-deploy-tests")
BASE_REPOSITORY = "reducerd-deploy-base"
# deploy/k8s/README.md gives the same command.
BUILD_ARGS = ("build", "-f", "deploy/k8s/Dockerfile")
BRIDGE = "docker0"  # dockerd's default bridge
# What the build cache may keep between runs (the compiler layer, mostly).
KEEP_BUILD_CACHE = "2GB"


class Engine:
    """`docker` against a running engine, or against a dockerd started here."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.env = {**os.environ, "DOCKER_BUILDKIT": "1"}
        self.dockerd: subprocess.Popen | None = None
        self.log = workdir / "dockerd.log"

    def __call__(self, *args: str, timeout: float = 120.0, check: bool = True,
                 **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run([DOCKER, *args], capture_output=True, text=True,
                                timeout=timeout, env=self.env, **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout[-4000:]}{result.stderr[-4000:]}")
        return result

    def _answers(self) -> bool:
        return self("info", "--format", "{{.ServerVersion}}", check=False,
                    timeout=30).returncode == 0

    def start(self) -> None:
        if self._answers():
            return
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        socket = RUN_DIR / "docker.sock"
        self.bridge_was_there = Path(f"/sys/class/net/{BRIDGE}").exists()
        with open(self.log, "w") as log:
            self.dockerd = subprocess.Popen(
                ["dockerd", "--data-root", str(CACHE_DIR / "docker"),
                 "--exec-root", str(RUN_DIR / "exec"), "--pidfile", str(RUN_DIR / "dockerd.pid"),
                 "--host", f"unix://{socket}", "--iptables=false", "--ip-forward=false"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=terminate_with_parent)
        self.env["DOCKER_HOST"] = f"unix://{socket}"
        deadline = time.monotonic() + 90
        while not self._answers():
            if self.dockerd.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"dockerd did not start (exit {self.dockerd.poll()}):\n"
                            f"{self.log.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.5)

    def stop(self) -> None:
        if self.dockerd is None:
            return
        self("builder", "prune", "--force", "--keep-storage", KEEP_BUILD_CACHE, check=False,
             timeout=300)
        self.dockerd.send_signal(signal.SIGTERM)
        try:
            self.dockerd.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait()
        # What a dockerd that did not shut down cleanly may leave: mounts (network
        # namespaces) under its exec root, and its bridge.
        with open("/proc/self/mountinfo") as mountinfo:
            points = [line.split()[4] for line in mountinfo]
        for point in sorted((p for p in points if p.startswith(f"{RUN_DIR}/")), reverse=True):
            subprocess.run(["umount", "--lazy", point], check=False, timeout=30)
        shutil.rmtree(RUN_DIR, ignore_errors=True)
        if not self.bridge_was_there and Path(f"/sys/class/net/{BRIDGE}").exists():
            subprocess.run(["ip", "link", "delete", BRIDGE], check=False, timeout=30)

    def base_image(self, rootfs: Path) -> str:
        """The root filesystem as an image, imported once per key."""
        tag = f"{BASE_REPOSITORY}:{rootfs_key()}"
        if self("image", "inspect", tag, check=False).returncode == 0:
            return tag
        stale = self("images", "--format", "{{.Repository}}:{{.Tag}}", BASE_REPOSITORY).stdout
        for old in stale.split():
            self("rmi", old, check=False)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            self("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                 "/usr/bin:/sbin:/bin", "-", tag, stdin=tar.stdout, timeout=300)
        finally:
            tar.stdout.close()
            tar.wait()
        return tag


@contextmanager
def engine_lock():
    """One engine per machine at a time: a second run waits for the first."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / "docker.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def wheel_server(wheels: Path, workdir: Path):
    """Serve the dependency wheels (not reducerd's: the image compiles its own) on
    127.0.0.1; yields the URL for PIP_FIND_LINKS."""
    index = workdir / "index"
    index.mkdir()
    for wheel in wheels.glob("*.whl"):
        if not wheel.name.startswith("reducerd-"):
            shutil.copy2(wheel, index)
    handler = functools.partial(_QuietHandler, directory=str(index))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


def build_image(engine: Engine, base: str, find_links: str, tag: str) -> str:
    """docker build with the repository as context; returns the build's output."""
    return engine(*BUILD_ARGS, "--progress", "plain", "--network", "host",
                  "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "PIP_NO_INDEX=1",
                  "--build-arg", f"PIP_FIND_LINKS={find_links}", "-t", tag, str(ROOT),
                  timeout=900).stderr


def _quantity(value: str) -> str:
    """A Kubernetes memory quantity (Mi, Gi) in docker's units (m, g)."""
    return value.replace("Gi", "g").replace("Mi", "m")


def pod_run_args(pod: dict, container: dict, config_dir: Path, secret_dir: Path) -> list[str]:
    """`docker run` flags for the pod's container: its user, read-only root, dropped
    capabilities, no privilege escalation, runtime-default seccomp (docker's own
    profile), limits, environment, volumes (ConfigMap and Secret as read-only
    directories, a memory emptyDir as a tmpfs) and grace period."""
    pod_context, context = pod["securityContext"], container["securityContext"]
    assert pod_context["seccompProfile"]["type"] == context["seccompProfile"]["type"] == (
        "RuntimeDefault")
    args = ["--user", f"{pod_context['runAsUser']}:{pod_context['runAsGroup']}",
            "--group-add", str(pod_context["fsGroup"]),
            "--stop-timeout", str(pod["terminationGracePeriodSeconds"])]
    if context["readOnlyRootFilesystem"]:
        args.append("--read-only")
    for capability in context["capabilities"]["drop"]:
        args += ["--cap-drop", capability]
    if context["allowPrivilegeEscalation"] is False:
        args += ["--security-opt", "no-new-privileges"]
    limits = container["resources"]["limits"]
    args += ["--cpus", str(limits["cpu"]), "--memory", _quantity(limits["memory"])]
    for variable in container.get("env", []):
        args += ["--env", f"{variable['name']}={variable['value']}"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            args += ["--volume", f"{config_dir}:{mount['mountPath']}:ro"]
        elif "secret" in volume:
            args += ["--volume", f"{secret_dir}:{mount['mountPath']}:ro"]
        elif volume.get("emptyDir", {}).get("medium") == "Memory":
            size = _quantity(volume["emptyDir"]["sizeLimit"])
            args += ["--tmpfs", f"{mount['mountPath']}:size={size}"]
        else:
            raise AssertionError(f"no docker equivalent here for volume {volume}")
    return args

"""The container image, built by deploy/k8s/Dockerfile and run with the pod's settings.

Scenarios: the image builds from the repository (a small context: the
dockerignore holds) on the debootstrapped bookworm as BASE_IMAGE; it has
reducer_wire._kernels and no compiler, runs as the StatefulSet's user and
EXPOSEs every container port, the data port 7100 among them. Two daemons run
with the pod's settings taken from statefulset.yaml (non-root, read-only root,
no capabilities, no privilege escalation, default seccomp, the limits, the
ConfigMap's TOML and the token Secret mounted read-only), each on an address
of its own as pods are; they answer health checks as the kubelet's gRPC probe
asks them, and the worker Job's own script, run by four host processes,
reduces through them over the data plane. `docker stop` (SIGTERM) drains and
exits 0 within the grace period.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml
from deploy_docker import Engine, build_image, engine_lock, pod_run_args, wheel_server
from deploy_host import ROOT, require
from deploy_machine import PROBE

pytestmark = pytest.mark.timeout(300)

K8S = ROOT / "deploy" / "k8s"
TOKEN = "deploy-image-token"
DAEMONS = 2


def manifest(name: str, kind: str) -> dict:
    return next(doc for doc in yaml.safe_load_all((K8S / name).read_text())
                if doc and doc["kind"] == kind)


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] + pod.get("initContainers", [])
                if c["name"] == name)


STATEFULSET = manifest("statefulset.yaml", "StatefulSet")
POD = STATEFULSET["spec"]["template"]["spec"]
DAEMON = container(POD, "reducerd")
JOB = manifest("worker-job.example.yaml", "Job")


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory):
    require("docker")
    rootfs, wheels = request.getfixturevalue("rootfs"), request.getfixturevalue("wheels")
    workdir = tmp_path_factory.mktemp("docker")
    with engine_lock():
        docker = Engine(workdir)
        docker.start()
        try:
            docker.base = docker.base_image(rootfs)
            docker.tag = f"reducerd-deploy-image:{os.getpid()}"
            with wheel_server(wheels, workdir) as find_links:
                docker.build_log = build_image(docker, docker.base, find_links, docker.tag)
            yield docker
        finally:
            docker("rmi", "--force", f"reducerd-deploy-image:{os.getpid()}", check=False)
            docker.stop()


@pytest.mark.timeout(1200)  # set-up on a bare machine: packages, debootstrap, a cold build
def test_the_image_has_the_extension_the_user_and_the_ports(engine):
    context = re.search(r"transferring context: ([\d.]+)([kM]?B)", engine.build_log)
    assert context, engine.build_log[-3000:]
    size_mb = float(context.group(1)) * {"B": 1e-6, "kB": 1e-3, "MB": 1}[context.group(2)]
    assert size_mb < 20, f"a {size_mb:.0f} MB build context: Dockerfile.dockerignore not read?"
    config = json.loads(engine("image", "inspect", "--format", "{{json .Config}}",
                               engine.tag).stdout)
    ports = {f"{p['containerPort']}/{p['protocol'].lower()}" for p in DAEMON["ports"]}
    assert set(config["ExposedPorts"]) == ports, config["ExposedPorts"]
    assert "7100/tcp" in config["ExposedPorts"]
    context = POD["securityContext"]
    assert config["User"] == f"{context['runAsUser']}:{context['runAsGroup']}"
    check = ("import reducer_wire._kernels as k, shutil, sys; "
             "print(k.__file__, sys.executable, shutil.which('gcc'))")
    found = engine("run", "--rm", "--entrypoint", "python", engine.tag, "-c", check).stdout
    kernels, python, gcc = found.split()
    assert kernels.startswith("/opt/reducerd/") and python == "/opt/reducerd/bin/python"
    assert gcc == "None", "a compiler in the runtime image"


def proc_status(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


@pytest.fixture
def pods(engine, tmp_path):
    """DAEMONS containers of the StatefulSet's pod, each with an address of its own."""
    config_dir, secret_dir = tmp_path / "config", tmp_path / "secret"
    config_dir.mkdir()
    secret_dir.mkdir()
    configmap = manifest("configmap.yaml", "ConfigMap")
    (config_dir / "reducerd.toml").write_text(configmap["data"]["reducerd.toml"])
    token_file = secret_dir / "token"
    token_file.write_text(TOKEN + "\n")
    secret = next(v["secret"] for v in POD["volumes"] if "secret" in v)
    os.chown(token_file, 0, POD["securityContext"]["fsGroup"])
    token_file.chmod(secret["defaultMode"])
    for path in (config_dir, secret_dir):
        path.chmod(0o755)
    args = pod_run_args(POD, DAEMON, config_dir, secret_dir)
    names = [f"reducerd-deploy-{os.getpid()}-{i}" for i in range(DAEMONS)]
    try:
        for name in names:
            engine("run", "--detach", "--name", name, *args, engine.tag, *DAEMON["args"])
        yield names
    finally:
        engine("rm", "--force", *names, check=False)


def inspect(engine, name: str, template: str) -> str:
    return engine("inspect", "--format", template, name).stdout.strip()


def test_daemons_with_the_pods_settings_reduce_the_jobs_workers(engine, pods):
    addresses = []
    for name in pods:
        status = proc_status(inspect(engine, name, "{{.State.Pid}}"))
        user = POD["securityContext"]["runAsUser"]
        assert status["Uid"].split() == [str(user)] * 4, status["Uid"]
        assert str(POD["securityContext"]["fsGroup"]) in status["Groups"].split()
        assert int(status["CapEff"], 16) == int(status["CapBnd"], 16) == 0, status
        assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2", status
        assert inspect(engine, name, "{{.HostConfig.ReadonlyRootfs}}") == "true"
        ip = inspect(engine, name, "{{.NetworkSettings.IPAddress}}")
        grpc_port = next(p["containerPort"] for p in DAEMON["ports"] if p["name"] == "grpc")
        addresses.append(f"{ip}:{grpc_port}")
    for address in addresses:  # as the kubelet's startup probe: health, no token
        subprocess.run([sys.executable, str(PROBE), "wait-serving", address, "30"],
                       check=True, timeout=60)
        answers = json.loads(subprocess.run(
            [sys.executable, str(PROBE), "status", address, TOKEN], capture_output=True,
            text=True, check=True, timeout=30).stdout)
        assert answers == {"without": "UNAUTHENTICATED", "with": "OK"}, answers

    job_pod = JOB["spec"]["template"]["spec"]
    script = container(job_pod, "worker")["command"]
    assert script[0] == "python"
    world_size = JOB["spec"]["completions"]
    env = {**os.environ, "REDUCER_ADDRESSES": ",".join(addresses),
           "REDUCER_WORLD_SIZE": str(world_size), "REDUCER_JOB": JOB["metadata"]["name"],
           "REDUCER_TOKEN": TOKEN, "REDUCER_TIMEOUT": "30",
           # The data plane or nothing (the Job's "auto" would fall back to gRPC).
           "REDUCER_DATA_PLANE": "tcp"}
    workers = [subprocess.Popen([sys.executable, *script[1:]],
                                env={**env, "REDUCER_RANK": str(rank)}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for rank in range(world_size)]
    try:
        outputs = [w.communicate(timeout=60)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    logs = "\n".join(engine("logs", name).stderr for name in pods)
    for rank, (w, out) in enumerate(zip(workers, outputs, strict=True)):
        assert w.returncode == 0, f"rank {rank}:\n{out}\n{logs}"
        assert f"rank {rank} of {world_size}: allreduce gave" in out, out
        assert "unreachable" not in out, out

    started = time.monotonic()
    engine("stop", *pods, timeout=POD["terminationGracePeriodSeconds"] + 30)
    assert time.monotonic() - started < POD["terminationGracePeriodSeconds"]
    for name in pods:
        assert inspect(engine, name, "{{.State.ExitCode}}") == "0", engine("logs", name).stderr
        log = engine("logs", name).stderr
        assert "draining" in log and "stopped" in log, log

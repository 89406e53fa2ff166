"""The Kubernetes manifests in deploy/k8s.

Scenarios: every manifest validates offline, strictly (unknown fields fail),
against the Kubernetes OpenAPI schemas bundled with kubernetes-validate, for
the oldest version the manifests need (1.27: native gRPC probes and the Job
name label are GA) and the newest bundled one; the kustomization lists exactly
the daemon manifests; the Service, StatefulSet and PodDisruptionBudget select
the same pods; the ConfigMap and Secret that the pods mount exist with the keys
they use, at the paths the daemon's arguments name; the daemon accepts the
StatefulSet's arguments with the ConfigMap's TOML (`--print-config`), whose
ports, drain grace and memory limit agree with the pod spec; the pods are
hardened; the worker Job lists every daemon once, in ordinal order, with its
rank from the completion index; the Job's own worker script, run against
daemons started with the ConfigMap's configuration and the token, reduces;
and the Dockerfile compiles the C extension in a build stage, copies what
setup.py needs (and the dockerignore lets through), runs as the pods' user
and EXPOSEs every container port.
"""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import DEPLOY
from support import running_daemons

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed (pip install "
                                  "kubernetes-validate: schemas bundled, no network)")
yaml = pytest.importorskip("yaml")  # a dependency of kubernetes-validate

K8S = DEPLOY / "k8s"
OLDEST_VERSION = "1.27"
EXAMPLES = {"secret.example.yaml", "worker-job.example.yaml"}
TOKEN = "k8s-test-token"
GiB = 1 << 30


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def one(kind: str, name: str | None = None) -> dict:
    """The single manifest of `kind` (named `name`) in deploy/k8s."""
    found = [doc for path in manifest_files() for doc in load_documents(path)
             if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {K8S}, found {len(found)}"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] + pod_spec.get("initContainers", [])
                if c["name"] == name)


def env_of(c: dict) -> dict:
    return {e["name"]: e for e in c["env"]}


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} not in the container's args {args}"
    return args[args.index(flag) + 1]


def mounted_path(pod_spec: dict, c: dict, source: str, name: str, key: str) -> str:
    """Where container `c` sees `key` of the ConfigMap or Secret `name`."""
    name_field = {"configMap": "name", "secret": "secretName"}[source]
    volume = next(v for v in pod_spec["volumes"]
                  if source in v and v[source][name_field] == name)
    items = {i["key"]: i["path"] for i in volume[source].get("items", [])} or {key: key}
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    return f"{mount['mountPath']}/{items[key]}"


def python(command: list[str]) -> list[str]:
    """A container's `python -c SCRIPT` command, run by this environment's interpreter."""
    assert command[0] == "python", command
    return [sys.executable, *command[1:]]


def configmap_toml() -> str:
    return one("ConfigMap", "reducerd-config")["data"]["reducerd.toml"]


def memory_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity).groups()
    return int(number) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30}[unit]


@pytest.mark.parametrize("version", [OLDEST_VERSION, kubernetes_validate.latest_version()])
def test_every_manifest_validates_against_the_openapi_schemas(version):
    validated = []
    for path in manifest_files():
        for doc in load_documents(path):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(map(str, exc.path))
                pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: "
                            f"{where}: {exc.message}")
            validated.append(doc["kind"])
    assert sorted(validated) == ["ConfigMap", "Job", "PodDisruptionBudget", "Secret",
                                 "Service", "StatefulSet"]


def test_kustomization_lists_the_daemon_manifests_and_not_the_examples():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in manifest_files() if p.name not in EXAMPLES)


def test_service_statefulset_and_budget_select_the_same_pods():
    service, sts = one("Service", "reducerd"), one("StatefulSet", "reducerd")
    pdb = one("PodDisruptionBudget")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None", "the Service must be headless"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    for selector in (service["spec"]["selector"], sts["spec"]["selector"]["matchLabels"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector and selector.items() <= pod_labels.items(), (selector, pod_labels)
    daemon = container(sts["spec"]["template"]["spec"], "reducerd")
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"], port


def test_mounted_configmap_and_secret_exist_at_the_paths_the_daemon_reads():
    sts = one("StatefulSet", "reducerd")
    pod = sts["spec"]["template"]["spec"]
    daemon = container(pod, "reducerd")
    assert "reducerd.toml" in one("ConfigMap", "reducerd-config")["data"]
    assert "token" in one("Secret", "reducerd-token")["stringData"]
    assert arg_value(daemon["args"], "--config") == "/etc/reducerd/reducerd.toml"
    assert mounted_path(pod, daemon, "configMap", "reducerd-config", "reducerd.toml") == (
        arg_value(daemon["args"], "--config"))
    assert mounted_path(pod, daemon, "secret", "reducerd-token", "token") == arg_value(
        daemon["args"], "--auth-token-file")
    token_volume = next(v for v in pod["volumes"] if "secret" in v)
    # Readable by the pod's group (fsGroup) only, not by everyone.
    assert token_volume["secret"]["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def test_the_daemon_accepts_the_configmap_with_the_statefulset_arguments(tmp_path):
    sts = one("StatefulSet", "reducerd")
    pod = sts["spec"]["template"]["spec"]
    daemon = container(pod, "reducerd")
    tomllib.loads(configmap_toml())  # a clear failure first if the TOML itself is broken
    # The container's own arguments, the mounted files replaced by copies here.
    config_file, token_file = tmp_path / "reducerd.toml", tmp_path / "token"
    config_file.write_text(configmap_toml())
    token_file.write_text(TOKEN + "\n")
    args = [str(config_file) if a == arg_value(daemon["args"], "--config") else
            str(token_file) if a == arg_value(daemon["args"], "--auth-token-file") else a
            for a in daemon["args"]]
    result = subprocess.run([sys.executable, "-m", "reducerd", *args, "--print-config"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    effective = tomllib.loads(result.stdout)

    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert int(effective["listen"].rpartition(":")[2]) == ports["grpc"]
    assert int(effective["metrics_listen"].rpartition(":")[2]) == ports["metrics"]
    assert int(effective["data_listen"].rpartition(":")[2]) == ports["data"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert daemon[probe]["grpc"]["port"] == ports["grpc"], probe
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert annotations["prometheus.io/path"] == "/metrics"
    # SIGTERM drains for drain_grace; the kubelet must not SIGKILL before it is over.
    assert pod["terminationGracePeriodSeconds"] > effective["drain_grace"]
    limits, requests = daemon["resources"]["limits"], daemon["resources"]["requests"]
    assert limits == requests, "requests = limits: the Guaranteed QoS class"
    assert memory_bytes(limits["memory"]) >= effective["max_inflight_bytes"] + GiB // 2


def test_pods_are_hardened():
    sts, job = one("StatefulSet", "reducerd"), one("Job")
    for pod in (sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            context = c["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, c["name"]
            assert context["allowPrivilegeEscalation"] is False, c["name"]
            assert context["capabilities"]["drop"] == ["ALL"], c["name"]
            assert "add" not in context["capabilities"], c["name"]
            assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]
    dockerfile = (K8S / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    context = sts["spec"]["template"]["spec"]["securityContext"]
    assert user and [int(user.group(1)), int(user.group(2))] == [
        context["runAsUser"], context["runAsGroup"]]


def test_the_dockerfile_compiles_the_extension_in_a_build_stage_and_exposes_every_port():
    """Offline; tests/deploy/test_deploy_image.py builds and runs the image."""
    dockerfile = (K8S / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)
    stages = re.split(r"(?m)^FROM ", dockerfile)[1:]
    assert [s.split("\n", 1)[0] for s in stages] == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    build, runtime = stages
    assert "gcc" in build and "gcc" not in runtime
    assert "import reducer_wire._kernels" in build, "the build must fail without the extension"
    assert "COPY --from=build" in runtime
    copied = {word for line in re.findall(r"(?m)^COPY (?!--)(.*)$", build)
              for word in line.split()[:-1]}
    # setup.py builds reducer_wire._kernels from protos/python/reducer_wire/_kernels.c.
    assert {"pyproject.toml", "setup.py", "README.md", "protos", "reducerd", "clients"} <= copied
    allowed = {line.strip("!/") for line in (K8S / "Dockerfile.dockerignore").read_text()
               .splitlines() if line.startswith("!")}
    assert copied <= allowed, f"copied but ignored: {copied - allowed}"
    sts = one("StatefulSet", "reducerd")
    ports = {p["containerPort"] for p in container(sts["spec"]["template"]["spec"],
                                                   "reducerd")["ports"]}
    exposed = re.search(r"(?m)^EXPOSE (.*)$", runtime).group(1).split()
    assert set(map(int, exposed)) == ports, (exposed, ports)


def test_worker_job_lists_every_daemon_once_in_ordinal_order():
    sts, service, job = one("StatefulSet", "reducerd"), one("Service", "reducerd"), one("Job")
    pod = job["spec"]["template"]["spec"]
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    expected = [f"reducerd-{i}.{service['metadata']['name']}.$(POD_NAMESPACE).svc:{grpc_port}"
                for i in range(sts["spec"]["replicas"])]
    assert job["spec"]["completionMode"] == "Indexed"
    for c in pod["containers"] + pod.get("initContainers", []):
        names = [e["name"] for e in c["env"]]
        env = env_of(c)
        addresses = env["REDUCER_ADDRESSES"]["value"].split(",")
        assert addresses == expected, c["name"]
        # Ordinal order: the same on every worker (equal to text order up to 10 daemons).
        assert addresses == sorted(addresses, key=lambda a: int(re.match(
            r"reducerd-(\d+)\.", a).group(1))), c["name"]
        # $(VAR) expands only from variables defined earlier in the list.
        assert names.index("POD_NAMESPACE") < names.index("REDUCER_ADDRESSES")
        assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.namespace")
        assert env["REDUCER_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.annotations['batch.kubernetes.io/job-completion-index']")
        assert int(env["REDUCER_WORLD_SIZE"]["value"]) == job["spec"]["completions"] == (
            job["spec"]["parallelism"])
        # A job token, in a Secret of the job's own, never the daemons' token.
        assert env["REDUCER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{job['metadata']['name']}-token", "key": "token"}
        assert c["image"] == container(sts["spec"]["template"]["spec"], "reducerd")["image"]


def test_the_job_scripts_run_against_daemons_with_the_configmap(tmp_path):
    job = one("Job")
    pod = job["spec"]["template"]["spec"]
    wait, worker = container(pod, "wait-for-reducers"), container(pod, "worker")
    config_file, token_file = tmp_path / "reducerd.toml", tmp_path / "token"
    config_file.write_text(configmap_toml())
    token_file.write_text(TOKEN + "\n")
    world_size = job["spec"]["completions"]
    # The configuration's fixed ports become free ones here (flags override the file).
    with running_daemons(2, "--config", str(config_file), "--auth-token-file",
                         str(token_file), "--metrics-listen", "127.0.0.1:0",
                         "--data-listen", "auto", log_dir=tmp_path) as daemons:
        env = {**os.environ, "REDUCER_ADDRESSES": ",".join(daemons.addresses),
               "REDUCER_WORLD_SIZE": str(world_size), "REDUCER_JOB": job["metadata"]["name"],
               "REDUCER_TOKEN": TOKEN, "REDUCER_TIMEOUT": "20"}
        subprocess.run(python(wait["command"]), env=env, check=True, timeout=20)
        workers = [subprocess.Popen(python(worker["command"]),
                                    env={**env, "REDUCER_RANK": str(rank)},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for rank in range(world_size)]
        outputs = []
        try:
            for rank, process in enumerate(workers):
                outputs.append(process.communicate(timeout=30)[0])
                assert process.returncode == 0, (f"rank {rank}:\n{outputs[-1]}\n"
                                                 f"{daemons.logs()}")
        finally:
            for process in workers:
                process.kill()
                process.wait()
    for rank, output in enumerate(outputs):
        assert f"rank {rank} of {world_size}: allreduce gave" in output, output

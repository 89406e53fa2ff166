"""The READMEs' recipes for checking a unit or an image are the ones the tests run.

Scenarios (offline): deploy/systemd/README.md gives the tier's debootstrap and
systemd-nspawn command lines and its install steps; deploy/k8s/README.md gives
its docker build line, and its `docker run` line has exactly the flags that
deploy_docker.pod_run_args derives from statefulset.yaml, with the
StatefulSet's arguments after the image.
"""

from __future__ import annotations

import re
import shlex

import yaml
from deploy_docker import BUILD_ARGS, pod_run_args
from deploy_host import DEBOOTSTRAP_ARGS, MIRROR, ROOT, SUITE
from deploy_machine import NSPAWN_ARGS
from test_deploy_systemd import INSTALL_STEPS, SERVICE_STEPS, instance_steps

DEPLOY = ROOT / "deploy"


def commands(readme: str) -> list[str]:
    """The README's indented command lines, continuation lines joined."""
    lines = [line.strip() for line in readme.splitlines() if line.startswith("    ")]
    joined = re.sub(r"\\\s*\n\s*", " ", "\n".join(lines)).splitlines()
    uncommented = (" ".join(re.sub(r"\s+# .*$", "", c).split()) for c in joined)
    return [c for c in uncommented if c and not c.startswith("#")]


def test_the_systemd_readme_boots_the_machine_as_the_tests_do():
    readme = (DEPLOY / "systemd" / "README.md").read_text()
    lines = commands(readme)
    debootstrap = f"debootstrap {' '.join(DEBOOTSTRAP_ARGS)} {SUITE} "
    assert any(c.startswith(debootstrap) and c.endswith(MIRROR) for c in lines), debootstrap
    nspawn = f"systemd-nspawn {' '.join(NSPAWN_ARGS)} -D "
    assert any(c.startswith(nspawn) for c in lines), nspawn
    # The tests' install steps are the README's (but for pip's source).
    steps = INSTALL_STEPS + SERVICE_STEPS + instance_steps(8)
    for step in commands(re.sub(r"(?m)^", "    ", steps)):
        if step.startswith(("cd ", "/opt/reducerd/bin/pip ")):
            continue
        assert step in lines, f"not in deploy/systemd/README.md: {step}"


def test_the_k8s_readme_builds_and_runs_the_image_as_the_tests_do():
    readme = (DEPLOY / "k8s" / "README.md").read_text()
    lines = commands(readme)
    assert any(f"docker {' '.join(BUILD_ARGS)} " in c for c in lines)
    sts = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "statefulset.yaml").read_text())
               if d and d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    daemon = next(c for c in pod["containers"] if c["name"] == "reducerd")
    run = shlex.split(next(c for c in lines if c.startswith("docker run -d --name ")))
    image = run.index("reducerd:check")
    documented = run[5:image]
    derived = pod_run_args(pod, daemon, "/var/tmp/pod/config", "/var/tmp/pod/secret")
    assert _pairs(documented) == _pairs(derived), (documented, derived)
    assert run[image + 1:] == daemon["args"]


def _pairs(args: list[str]) -> list[tuple[str, ...]]:
    """Flags with their values, in any order; --read-only takes none."""
    out, rest = [], list(args)
    while rest:
        flag = rest.pop(0)
        out.append((flag,) if flag == "--read-only" else (flag, rest.pop(0)))
    return sorted(out)

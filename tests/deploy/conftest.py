"""The deploy tier: the units under a booted systemd, the image under Docker.

Run by `make test-deploy` (part of `make test`), as root, alone: it boots a
container and starts dockerd. REDUCER_SKIP_DEPLOY_TESTS=systemd,docker skips
a part by name; anything else that stops it from running fails it. Each
part's module fixture calls deploy_host.require() before it asks for these
(session fixtures would otherwise be set up first, skipped part or not).
"""

from __future__ import annotations

import sys

import pytest
from deploy_host import build_wheels, cached_rootfs

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="session")
def rootfs():
    path = cached_rootfs()
    # The wheels are built by this interpreter (C extension, cpXY tags).
    if not (path / f"usr/bin/python{PYTHON}").exists():
        found = sorted(p.name for p in (path / "usr/bin").glob("python3.*"))
        pytest.fail(f"the tests' Python is {PYTHON}, the machine's {found}: wheels built "
                    f"here would not install there (run the tier with Python 3.11)",
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def wheels(tmp_path_factory):
    return build_wheels(tmp_path_factory.mktemp("wheels"))

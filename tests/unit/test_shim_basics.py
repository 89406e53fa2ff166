"""Every shim exports the basics of reducer_client.process, each bound to the right function.

The shims bind process.shim_basics by unpacking a tuple, so a name out of
order would silently make rank() answer size(): a client whose basics all
differ catches that. Each shim is tested where its framework is installed
(.venv: torch and tensorflow; .venv-mxnet: mxnet).
"""

from __future__ import annotations

import importlib

import pytest
from reducer_client.process import BASICS_NAMES

SHIMS = {"reducer_client.torch": "torch", "reducer_client.tensorflow": "tensorflow",
         "reducer_client.mxnet": "mxnet"}


class _Client:
    """A Reducer's basics only: rank 9 of 12 workers, 4 per host, so node 2 of 3."""

    rank, world_size, local_rank, local_size = 9, 12, 1, 4
    wire_dtype = "float32"

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _shim(name: str):
    pytest.importorskip(SHIMS[name])
    return importlib.import_module(name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", SHIMS)
def test_every_basic_is_exported_and_listed(name):
    shim = _shim(name)
    missing = [n for n in BASICS_NAMES if n not in shim.__all__ or not callable(getattr(shim, n))]
    assert missing == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", SHIMS)
def test_each_basic_answers_its_own_question(name):
    shim = _shim(name)
    client = _Client()
    assert shim.init(reducer=client) is client
    try:
        assert shim.is_initialized() and shim.client() is client
        assert (shim.rank(), shim.size(), shim.local_rank(), shim.local_size(),
                shim.cross_rank(), shim.cross_size(), shim.is_homogeneous()) == (
                    9, 12, 1, 4, 2, 3, True)
    finally:
        shim.shutdown()
    assert client.closed and not shim.is_initialized()

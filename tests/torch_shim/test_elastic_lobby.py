"""reducer_client.elastic.lobby against LocalGroup (ranks as threads): the
joiner's settings, the commit's host round on every rank, and what run does
with HostsUpdatedInterrupt where no worker can join. Real daemons and a
real joiner: tests/integration/test_elastic_add_worker.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.elastic import HostsUpdatedInterrupt  # noqa: E402
from reducer_client.elastic.lobby import (  # noqa: E402
    JOIN_TIMEOUT_S,
    HostWatch,
    join_requested,
    join_timeout_s,
)
from reducer_client.errors import ReducerError  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402


def test_join_settings_from_the_environment():
    assert not join_requested({})
    assert join_requested({"REDUCER_ELASTIC_JOIN": "1"})
    assert not join_requested({"REDUCER_ELASTIC_JOIN": "0"})
    with pytest.raises(ValueError, match="REDUCER_ELASTIC_JOIN='maybe'"):
        join_requested({"REDUCER_ELASTIC_JOIN": "maybe"})
    assert join_timeout_s({}) == JOIN_TIMEOUT_S
    assert join_timeout_s({"REDUCER_ELASTIC_JOIN_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="REDUCER_ELASTIC_JOIN_TIMEOUT"):
            join_timeout_s({"REDUCER_ELASTIC_JOIN_TIMEOUT": bad})


def test_host_round_on_every_rank_without_daemons_admits_no_one():
    """Each check is one round of every rank (rank 0 alone would wait forever)."""
    group = LocalGroup(3)

    def checks(rank: int) -> int:
        watch = HostWatch(group.client(rank), build=None, shim="t")
        for _ in range(3):
            watch.check()  # a LocalGroup has no daemons: nothing to admit
        watch.close()
        return rank
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(checks, range(3), timeout=30)) == [0, 1, 2]


def test_commit_outside_run_checks_nothing():
    state = rt.elastic.ObjectState(lambda obj, root: obj, batch=0)
    state.batch = 3
    state.commit()  # no watch installed: no round, no error
    assert state._saved_state == {"batch": 3}


def test_run_refuses_to_grow_a_job_without_daemons():
    rt.init(reducer=LocalGroup(1).client(0))
    try:
        @rt.elastic.run
        def train(state):
            raise HostsUpdatedInterrupt(1)
        with pytest.raises(ReducerError, match="join only a job of ReducerClients") as err:
            train(rt.elastic.ObjectState(rt.broadcast_object))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        rt.shutdown()

"""elastic.run: Horovod's elastic loop over reducerd, in each worker process.

    @rt.elastic.run
    def train(state):
        for state.batch in range(state.batch, batches):
            ...; opt.step()
            if state.batch % 10 == 0:
                state.commit()
    train(rt.elastic.TorchState(model, opt, batch=0))

On entry, and after every failure of a collective (a ReducerError: a rank
gone, a round that timed out, a daemon restart), the ranks start a new
incarnation (incarnation.py: fresh keys, so no earlier result can answer
them), then state.sync() copies rank 0's state to all and func runs again;
after a failure state.restore() first puts back the last commit and the
reset callbacks run after the reset. A worker that missed a round therefore
never goes on out of step: its call fails, and it resynchronises with the
others.

When a rank is gone, the new incarnation's agreement fails with the
daemon's round-timeout error naming it: the survivors drop the ranks it
names, renumber themselves in order (rank minus the missing ranks below
it), and go on at the smaller world size without restarting their
processes, if they are a majority of the old world size (else they stop
with an error: the missing ranks may be alive, and two halves must never
train apart under one job id; so a job of 2 cannot shrink). The client is
rebuilt from the settings init() used (or the environment, REDUCER_*);
node-local aggregation is off after a shrink.
A worker started with REDUCER_ELASTIC_JOIN=1 joins the running job instead
(lobby.py): it knocks on the daemons, rank 0 admits it at a commit, every
rank's commit() raises HostsUpdatedInterrupt, and all reset to the larger
world (node-local aggregation off, as after a shrink) without restoring:
the state is the commit just made, which sync() gives the new rank.
The daemon's --round-timeout must be shorter than the client's timeout, so
that the daemon's error (which names the missing ranks) arrives first.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

from reducer_client.api import Reducer
from reducer_client.elastic.incarnation import IncarnationReducer, agree, missing_ranks
from reducer_client.elastic.lobby import (
    HostsUpdatedInterrupt,
    HostWatch,
    join_requested,
    join_timeout_s,
    knock,
)
from reducer_client.elastic.state import State
from reducer_client.errors import ReducerError

__all__ = ["make_run", "reset", "record_settings", "MAX_RESETS"]

MAX_RESETS = 100
_log = logging.getLogger("reducer_client.elastic")

# What init() built the process-wide client from, per shim (record_settings).
# _settings_lock guards it (any thread calling init).
_settings: dict[str, dict[str, Any]] = {}
_settings_lock = threading.Lock()


def record_settings(shim: str, client_kwargs: dict[str, Any]) -> None:
    """Remember init()'s keyword arguments, to rebuild the client after a reset."""
    with _settings_lock:
        _settings[shim] = dict(client_kwargs)


def _build(shim: str, rank: int, world_size: int, shrunk: bool) -> Reducer:
    from reducer_client.client import ReducerClient  # grpc only when needed

    with _settings_lock:
        kwargs = dict(_settings.get(shim, {}))
    kwargs.update(rank=rank, world_size=world_size)
    if shrunk:
        kwargs.update(node_local=False)
    if "addresses" in kwargs:
        return ReducerClient(**{"job": "default", **kwargs})
    return ReducerClient.from_env(**kwargs)


def _incarnation(basics: Any, joining: bool = False) -> IncarnationReducer:
    """The process-wide client as an IncarnationReducer (installed on first use).

    The client init() made goes inside it as it is (a worker that joins a
    running job gets a fresh one, without node-local aggregation); the
    shim's objects made without reducer= look the process-wide client up at
    each call and follow. Under node-local aggregation a second client
    beside the first could not host the node (its socket is the first's).
    """
    from reducer_client.client import ReducerClient

    current = basics.client()
    if isinstance(current, IncarnationReducer):
        return current
    inner = current  # wrapped as it is (installing the facade does not close it)
    if isinstance(current, ReducerClient) and joining:
        # Closed first, as reset() does: under node-local aggregation its local
        # rank 0 holds the node's socket (a joining worker's has none).
        current.close()
        inner = _build(basics.shim, current.rank, current.world_size, shrunk=True)
    facade = IncarnationReducer(inner)
    basics.init(reducer=facade)
    return facade


def reset(basics: Any, facade: IncarnationReducer, failed: bool, added: int = 0,
          at: tuple[int, int] | None = None) -> None:
    """Start a new incarnation: a fresh client (after a failure or a change of
    world), agreed keys, without the ranks that are gone and with `added`
    new ranks after the others. at: (rank, world size) to start from instead
    of the facade's (a worker that just joined)."""
    from reducer_client.client import ReducerClient

    rank, world_size = at or (facade.rank, facade.world_size)
    world_size += added
    rebuild = isinstance(facade.inner, ReducerClient)
    shrunk = changed = bool(added) or at is not None
    failed = failed or changed
    if changed and not rebuild:
        raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{basics.shim}.elastic: workers join only a job of ReducerClients")
    inner = facade.inner
    while True:
        if failed and rebuild:
            inner.close()  # its open operations fail; the daemons drop its streams
            inner = _build(basics.shim, rank, world_size, shrunk)
            failed = False
        try:
            facade.reset(inner, agree(inner))
            return
        except ReducerError as exc:
            missing = missing_ranks(exc, world_size)
            if not missing or rank in missing or not rebuild:
                raise
            if 2 * (world_size - len(missing)) <= world_size:
                # Not a majority: the missing ranks may be alive and going on
                # without us; two jobs must never train apart under one id.
                raise ReducerError(grpc.StatusCode.ABORTED,
                                   f"{basics.shim}.elastic: rank {rank}: ranks {missing} of "
                                   f"{world_size} did not answer and the ranks left are not a "
                                   "majority: stopping rather than training apart") from exc
            _log.warning("%s: rank(s) %s of %d are gone; going on with %d",
                         basics.shim, missing, world_size, world_size - len(missing))
            rank -= sum(1 for m in missing if m < rank)
            world_size -= len(missing)
            failed = shrunk = True


def _join(basics: Any, facade: IncarnationReducer) -> None:
    """This process was added to a running job: knock until admitted, then
    start the job's new incarnation with the others (lobby.py)."""
    facade.inner.close()  # init's client: the rank and world size are rank 0's to give
    rank, world_size = knock(lambda r, n: _build(basics.shim, r, n, shrunk=True),
                             join_timeout_s(), basics.shim)
    _log.warning("%s: admitted as rank %d of %d", basics.shim, rank, world_size)
    reset(basics, facade, failed=False, at=(rank, world_size))


def _watch(basics: Any, facade: IncarnationReducer, state: State) -> HostWatch:
    """The host watch of this incarnation, installed on state for commit()."""
    if state._host_watch is not None:
        state._host_watch.close()
    state._host_watch = HostWatch(facade, lambda r, n: _build(basics.shim, r, n, shrunk=True),
                            basics.shim)
    return state._host_watch


def make_run(basics: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Horovod's elastic.run for the shim whose basics these are."""
    def run(func: Callable[..., Any]) -> Callable[..., Any]:
        """Run func(state, ...) until it returns, resetting after failures (module doc)."""
        @functools.wraps(func)
        def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
            joining = join_requested()
            facade = _incarnation(basics, joining)
            if joining:
                _join(basics, facade)
            else:
                reset(basics, facade, failed=False)
            try:
                for _ in range(MAX_RESETS):
                    _watch(basics, facade, state)
                    try:
                        state.sync()
                        return func(state, *args, **kwargs)
                    except HostsUpdatedInterrupt as update:
                        # Every rank raised it at the same commit: nothing to restore.
                        reset(basics, facade, failed=False, added=update.added)
                        state.on_reset()
                    except ReducerError as exc:
                        if exc.code in (grpc.StatusCode.INVALID_ARGUMENT,
                                        grpc.StatusCode.UNAUTHENTICATED,
                                        grpc.StatusCode.PERMISSION_DENIED):
                            raise  # a bug or a configuration: a reset would fail the same way
                        _log.warning("%s: %s; back to the last commit", basics.shim, exc)
                        state.restore()
                        reset(basics, facade, failed=True)
                        state.on_reset()
            finally:
                if state._host_watch is not None:
                    state._host_watch.close()
                    state._host_watch = None
            raise ReducerError(grpc.StatusCode.ABORTED,
                               f"{basics.shim}.elastic.run: {MAX_RESETS} resets, giving up")
        return wrapper
    return run

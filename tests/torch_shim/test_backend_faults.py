"""Faults under init_process_group("reducer"): a clear error on every rank, never a hang.

Each scenario's workers time their failing call; run_workers' own timeout
catches a hang. SLACK_S: how much later than the bound (the daemons' round
timeout or the group's timeout) an error may surface on two shared cores
(the watchdog's tick, the worker processes, the daemons).
"""

from __future__ import annotations

import datetime
import re
import signal
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from backend_workers import init_worker, torchrun_env  # noqa: E402
from support import run_workers, start_daemon  # noqa: E402

pytestmark = pytest.mark.timeout(200)

SLACK_S = 4.0


def _timed(action) -> dict:
    start = time.monotonic()
    try:
        action()
    except Exception as exc:
        code = getattr(exc, "code", None)
        return {"error": type(exc).__name__, "code": code.name if code else "",
                "message": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def mismatch_worker(rank: int, world: int, env: dict[str, str], check_calls: bool) -> dict:
    """Rank 1 all_reduces one element more; then every rank makes a good call."""
    init_worker(rank, world, env)
    import reducer_client.torch  # noqa: F401
    from reducer_client.torch.backend import ReducerOptions

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=20),
                            pg_options=ReducerOptions(check_calls=check_calls))
    try:
        out = {"bad": _timed(lambda: dist.all_reduce(torch.ones(100 + rank)))}
        good = torch.full((4,), rank + 1.0)
        dist.all_reduce(good)
        out["good"] = good.tolist()
        return out
    finally:
        dist.destroy_process_group()


# Unchecked (the default) the lengths meet at the daemons (or, both workers on
# this host, at the node's coordinator; REDUCER_NODE_LOCAL=0: at the daemon),
# checked in the control round first, which names each rank's shape.
@pytest.mark.parametrize("check_calls, node_local", [(False, "1"), (False, "0"), (True, "1")],
                         ids=["unchecked-node-local", "unchecked", "checked"])
def test_a_mismatched_shape_fails_every_rank_naming_them(daemons, check_calls, node_local):
    with daemons(1, round_timeout=30) as d:
        env = {**torchrun_env(d.addresses), "REDUCER_NODE_LOCAL": node_local}
        results = run_workers(mismatch_worker, 2, (env, check_calls), timeout=90)
    for rank, out in enumerate(results):
        bad = out["bad"]
        assert bad["error"] == "ReducerError" and bad["code"] == "INVALID_ARGUMENT", bad
        if check_calls:
            assert "rank 0: (100,)" in bad["message"] and "rank 1: (101,)" in bad["message"]
        else:  # the call named, and both lengths
            assert bad["message"].startswith(f"all_reduce of ({100 + rank},) float32"), bad
            assert re.search(r"rank \d.* 10[01] .*10[01]", bad["message"]), bad
        assert bad["seconds"] < 5, bad  # one round trip, not a timeout
        assert out["good"] == [3.0] * 4  # the group goes on


def silent_worker(rank: int, world: int, env: dict[str, str], group_timeout_s: float,
                  done: str) -> dict:
    """Rank 1 stays up but never makes the all_reduce (nor the barrier) the others
    make; it leaves once rank 0 has its errors (a rank that exits is told apart at
    once: its client says goodbye)."""
    init_worker(rank, world, env)
    import reducer_client.torch  # noqa: F401

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        if rank == 1:
            deadline = time.monotonic() + 90
            while not Path(done).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return {"silent": True}
        out = {"all_reduce": _timed(lambda: dist.all_reduce(torch.ones(1000))),
               "barrier": _timed(dist.barrier)}
        Path(done).touch()
        return out
    finally:
        dist.destroy_process_group()


# Node-local aggregation (both workers on this host) waits for a local rank in
# the node's coordinator, which the group's timeout bounds; without it the
# daemons' round timeout does.
@pytest.mark.parametrize("round_timeout, group_timeout, node_local",
                         [(2.0, 60.0, "0"), (60.0, 2.0, "1")],
                         ids=["round-timeout", "group-timeout"])
def test_a_rank_that_never_calls_fails_the_others_within_the_timeout(daemons, tmp_path,
                                                                      round_timeout,
                                                                      group_timeout,
                                                                      node_local):
    """Scenario: rank 1 skips a collective. The others fail within the daemons' round
    timeout, or within init_process_group's timeout where that is shorter (it is
    the client's timeout for each operation)."""
    with daemons(1, round_timeout=round_timeout) as d:
        results = run_workers(silent_worker, 2, (torchrun_env(d.addresses,
                                                                   REDUCER_NODE_LOCAL=node_local),
                                                      group_timeout,
                                                      str(tmp_path / "done")),
                              timeout=120)
    bound = min(round_timeout, group_timeout)
    for name in ("all_reduce", "barrier"):
        out = results[0][name]
        print(f"{name}: {out}")
        assert out["error"] == "ReducerError", out
        assert out["code"] in ("DEADLINE_EXCEEDED", "ABORTED", "UNAVAILABLE"), out
        assert out["seconds"] <= bound + SLACK_S, out
        assert out["seconds"] >= bound * 0.5, out  # it waited for the rank, then gave up


def killed_daemon_worker(rank: int, world: int, env: dict[str, str], progress: str) -> dict:
    """Train DDP (no hook) until the daemon is killed; report the failing step."""
    init_worker(rank, world, env)
    import reducer_client.torch  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_shim_models import batch, loss_of, make_model

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=5))
    try:
        model = DDP(make_model("mlp"))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(i: int) -> None:
            x, y = batch("mlp", i % 10, rank)
            opt.zero_grad()
            loss_of("mlp", model(x), y).backward()
            opt.step()
        for i in range(3):
            step(i)
        (Path(progress) / f"rank{rank}").touch()
        while not (Path(progress) / "killed").exists():
            time.sleep(0.05)
        return {"ddp": _timed(lambda: step(3)),
                "all_reduce": _timed(lambda: dist.all_reduce(torch.ones(10)))}
    finally:
        dist.destroy_process_group()


def test_a_daemon_killed_during_training_fails_every_rank(daemons, tmp_path):
    """Scenario: after 3 DDP steps the only daemon is SIGKILLed. DDP's next backward
    raises (a RuntimeError quoting the ReducerError), and so does all_reduce,
    within the group's timeout, on every rank."""
    progress = tmp_path / "progress"
    progress.mkdir()
    with daemons(1, round_timeout=30) as d:
        def kill() -> None:
            while len(list(progress.iterdir())) < 2:
                time.sleep(0.05)
            d.processes[0].stop(signal.SIGKILL)
            (progress / "killed").touch()
        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        results = run_workers(killed_daemon_worker, 2,
                              (torchrun_env(d.addresses), str(progress)), timeout=120)
        killer.join(5)
    for out in results:
        print(out)
        assert out["ddp"]["error"] == "RuntimeError" and "ReducerError" in out["ddp"]["message"]
        assert out["all_reduce"]["error"] == "ReducerError", out
        assert out["all_reduce"]["code"] == "UNAVAILABLE", out
        assert d.addresses[0] in out["all_reduce"]["message"]
        for entry in ("ddp", "all_reduce"):
            assert out[entry]["seconds"] <= 5 + SLACK_S, out


def token_worker(rank: int, world: int, env: dict[str, str]) -> dict:
    init_worker(rank, world, env)
    import reducer_client.torch  # noqa: F401

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=10))
    try:
        return _timed(lambda: dist.all_reduce(torch.ones(10)))
    finally:
        dist.destroy_process_group()


def test_a_token_for_another_job_is_refused_on_every_rank(tmp_path):
    """Scenario: REDUCER_TOKEN is the token of job "other", REDUCER_JOB is not "other"."""
    from reducerd.service.access import job_token

    token_file = tmp_path / "token"
    token_file.write_text("daemon-token")
    daemon = start_daemon("--auth-token-file", str(token_file), log_dir=tmp_path)
    try:
        env = torchrun_env([daemon.address],
                           REDUCER_TOKEN=job_token("daemon-token", "other"))
        results = run_workers(token_worker, 2, (env,), timeout=90)
    finally:
        daemon.stop()
    for out in results:
        assert out["error"] == "ReducerError" and out["code"] == "PERMISSION_DENIED", out
        assert repr(env["REDUCER_JOB"]) in out["message"], out
        assert out["seconds"] < 10, out


def test_check_calls_option_follows_torch_distributed_debug(monkeypatch):
    from reducer_client.torch.backend import ReducerOptions

    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    assert not ReducerOptions().checks_calls()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert ReducerOptions().checks_calls()
    assert not ReducerOptions(check_calls=False).checks_calls()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    assert not ReducerOptions().checks_calls()
    assert ReducerOptions(check_calls=True).checks_calls()
    with pytest.raises(TypeError, match="check_calls"):
        ReducerOptions(check_calls="yes")

"""SIGHUP reloads the token and the reloadable settings; no round is dropped.

Scenario: an operator rotates the daemon token (writes the new one into
--auth-token-file, `systemctl reload`) while a job trains. Before, SIGHUP
killed the daemon outright (no drain, every open round lost). Now the job's
rounds carry on exactly, the new token authorizes at once, the old one (and
its job tokens) for --token-grace seconds more and then no longer, and the
log says what changed.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import numpy as np
import pytest
from probes import assert_alive, get_status, good_job, token_daemon, wait_until
from reducer_client import ReducerClient

from reducerd.service.access import job_token

OLD, NEW = "old-token-0123456789", "new-token-9876543210"
GRACE_S = 4.0


def _train(address: str, token: str, rounds: int, results: dict, errors: list) -> None:
    """Two ranks, `rounds` allreduces each, about 0.05 s apart (across the reload)."""
    def rank_main(rank: int) -> None:
        try:
            with ReducerClient([address], job="train", rank=rank, world_size=2,
                               wire_dtype="float32", timeout=20, token=token,
                               node_local=False) as client:
                for r in range(rounds):
                    values = np.full(1 << 16, 10 * rank + r, dtype=np.float32)
                    results[(rank, r)] = client.allreduce(values, key="w")
                    time.sleep(0.05)
        except BaseException as exc:  # reported by the test, with its rank
            errors.append((rank, exc))

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def test_sighup_rotates_the_token_under_traffic_and_honours_the_old_one_for_its_grace(
        tmp_path):
    daemon = token_daemon(OLD, "--token-grace", str(GRACE_S), log_dir=tmp_path)
    try:
        rounds, results, errors = 60, {}, []
        trainer = threading.Thread(target=_train,
                                   args=(daemon.address, OLD, rounds, results, errors))
        trainer.start()
        assert wait_until(lambda: len(results) >= 10, 20), "the job did not get going"
        (tmp_path / "token").write_text(NEW + "\n")
        daemon.process.send_signal(signal.SIGHUP)
        rotated_at = time.monotonic()
        assert wait_until(lambda: "SIGHUP: token rotated" in daemon.log(), 5), daemon.log()
        assert_alive(daemon)
        # Within the grace: the new token, the old one and the old one's job token.
        assert get_status(daemon.address, NEW, brief=True).data_port
        assert get_status(daemon.address, OLD, brief=True).data_port
        assert get_status(daemon.address, job_token(OLD, "train"), brief=True).data_port
        good_job([daemon.address], job="fresh", token=job_token(NEW, "fresh"))
        trainer.join(90)
        assert not errors, errors
        assert len(results) == 2 * rounds, "rounds were dropped"
        for (_rank, r), total in results.items():
            np.testing.assert_array_equal(total, np.full(1 << 16, 10 + 2 * r, np.float32))
        # After the grace: the old token and its job tokens no longer authorize.
        time.sleep(max(0.0, rotated_at + GRACE_S + 0.5 - time.monotonic()))
        for stale in (OLD, job_token(OLD, "train")):
            with pytest.raises(grpc.RpcError) as refused:
                get_status(daemon.address, stale, brief=True)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good_job([daemon.address], job="after", token=NEW)
        assert_alive(daemon)
        assert OLD not in daemon.log() and NEW not in daemon.log()  # tokens are never logged
    finally:
        daemon.stop()


def test_sighup_applies_reloadable_settings_and_names_the_rest(tmp_path):
    """A --config file edited under a serving daemon: stalled_after is applied at
    SIGHUP, round_timeout is named as needing a restart, a broken file changes nothing."""
    config = tmp_path / "reducerd.toml"
    config.write_text("stalled_after = 5.0\nround_timeout = 60.0\n")
    daemon = token_daemon(OLD, "--config", str(config), log_dir=tmp_path)
    try:
        config.write_text("stalled_after = 2.5\nround_timeout = 30.0\n")
        daemon.process.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "SIGHUP: stalled_after_s 5.0 -> 2.5" in daemon.log(), 5), \
            daemon.log()
        assert "applied at a restart only: round_timeout_s" in daemon.log()
        reply = get_status(daemon.address, OLD, brief=True)
        assert (reply.stalled_after_s, reply.round_timeout_s) == (2.5, 60.0)
        config.write_text("stalled_after = -1\n")
        daemon.process.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "SIGHUP: nothing reloaded" in daemon.log(), 5), daemon.log()
        assert get_status(daemon.address, OLD, brief=True).stalled_after_s == 2.5
        good_job([daemon.address], token=OLD)
        assert_alive(daemon)
    finally:
        daemon.stop()

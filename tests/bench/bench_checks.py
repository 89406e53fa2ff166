"""Shared checks of the bench tests' JSON (not a test module)."""

from __future__ import annotations

import importlib.util

import pytest

from reducerd.bench.launch import default_mxnet_python

TIME_KEYS = {"median", "min", "max"}
RESULT_KEYS = {"system", "size_bytes", "time_s", "algbw_GBps", "busbw_GBps"}
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MXNET_ENV = default_mxnet_python().exists()
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def check_results(data: dict, systems: list[str], sizes: list[int],
                  extra_keys: set[str] = frozenset()) -> None:
    """Exactly the contract's keys, one result per (system, size), sane figures."""
    assert {(r["system"], r["size_bytes"]) for r in data["results"]} == \
        {(s, n) for s in systems for n in sizes}
    assert len(data["results"]) == len(systems) * len(sizes)
    for r in data["results"]:
        paired = {"paired_core"} if r["system"] == "reducerd-ddp-hook" else set()
        assert set(r) == RESULT_KEYS | extra_keys | paired, r
        if paired:  # the core beside the hook in the same iterations
            core, ratio = r["paired_core"]["time_s"], r["paired_core"]["ratio"]
            assert 0 < core["min"] <= core["median"] <= core["max"]
            assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
            assert ratio["min"] <= r["time_s"]["max"] / core["min"]
            assert ratio["max"] >= r["time_s"]["min"] / core["max"]
        assert set(r["time_s"]) == TIME_KEYS
        t = r["time_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / t["median"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * data["config"]["busbw_factor"])

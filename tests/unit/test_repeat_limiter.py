"""RepeatLimiter and short_name: the log's bounds on a tenant's names and rates."""

from __future__ import annotations

import logging

from reducerd.ops.logs import NAME_LOG_CHARS, RepeatLimiter, short_name


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _limiter(caplog, **kwargs):
    clock = _Clock()
    caplog.set_level(logging.INFO, logger="test.repeats")
    return RepeatLimiter(logging.getLogger("test.repeats"), period_s=10.0, clock=clock,
                         **kwargs), clock


def test_short_names_are_cut_and_escaped():
    assert short_name("job-1") == "'job-1'"
    long = short_name("k" * 1000)
    assert long == f"{'k' * NAME_LOG_CHARS!r}... (1000 characters)"
    assert "\n" not in short_name("a\nforged line")


def test_repeats_of_a_kind_are_counted_and_summed_up_when_the_period_ends(caplog):
    limiter, clock = _limiter(caplog)
    for _ in range(500):
        limiter.log(logging.WARNING, ("job", "RESOURCE_EXHAUSTED"), "refused")
    limiter.log(logging.WARNING, ("other", "RESOURCE_EXHAUSTED"), "refused other")
    assert [r.getMessage() for r in caplog.records] == ["refused", "refused other"]
    clock.now += 10.0
    limiter.flush()
    assert caplog.records[-1].getMessage() == ("499 more like this in the last 10 s: "
                                               "refused")
    assert caplog.records[-1].levelno == logging.WARNING
    assert len(caplog.records) == 3  # the other kind had no repeats
    limiter.log(logging.WARNING, ("job", "RESOURCE_EXHAUSTED"), "refused")
    assert len(caplog.records) == 4  # a new period: its first line again


def test_new_kinds_beyond_the_lines_of_a_period_are_counted_in_one_line(caplog):
    limiter, clock = _limiter(caplog, max_kinds=8, max_lines=5)
    for i in range(1000):
        limiter.log(logging.INFO, ("job", i), f"refused {i}")
    assert len(caplog.records) == 5 + 0  # 5 first lines; evictions had no repeats
    clock.now += 10.0
    limiter.flush()
    assert caplog.records[-1].getMessage().startswith("995 more refusals of other kinds")
    assert len(limiter._kinds) <= 8

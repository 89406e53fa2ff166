"""reducerd.ops.units: the one grammar of rates, delays and sizes that bench and plan read."""

from __future__ import annotations

import pytest

from reducerd.bench import units as bench_units
from reducerd.ops.units import parse_bytes, parse_rate, parse_time
from reducerd.plan import units as plan_units

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("text", "bytes_per_s"), [
    ("200mbit", 25e6), ("1gbit", 125e6), ("100gbit", 12.5e9), ("1tbit", 125e9),
    ("1kibit", 1024 / 8), ("1gibit", 2**30 / 8), ("10mbps", 10e6), ("12.5gbps", 12.5e9),
    ("1000000", 125e3), ("100Gbit/s", 12.5e9), ("25 Gbit/s", 3.125e9), (" 1GBIT ", 125e6)])
def test_rates(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s, rel=1e-12)


@pytest.mark.parametrize("text", ["", "fast", "0gbit", "-1gbit", "100gbit/h", "100/s",
                                  "1xbit", "gbit", "1.gbit"])
def test_rates_refused_name_the_text_and_the_syntax(text):
    with pytest.raises(ValueError, match=rf"rate {text!r}: .*tc's syntax"):
        parse_rate(text)


@pytest.mark.parametrize("text", ["100Gbit/s", "25 gbit", "10mbps/s"])
def test_tc_only_refuses_what_tc_cannot_read(text):
    parse_rate(text)  # the planner reads them
    with pytest.raises(ValueError, match="tc's syntax"):
        parse_rate(text, tc_only=True)
    with pytest.raises(ValueError, match="tc's syntax"):
        bench_units.parse_rate(text)  # bench hands its rate to tc as written


@pytest.mark.parametrize(("text", "seconds"), [
    ("20us", 20e-6), ("1.5ms", 1.5e-3), ("0.1s", 0.1), ("2sec", 2.0), ("3msec", 3e-3),
    ("4usec", 4e-6), ("500ns", 500e-9), ("0", 0.0), ("2 ms", 2e-3)])
def test_times(text, seconds):
    assert parse_time(text) == pytest.approx(seconds, rel=1e-12)


def test_times_refused_name_the_quantity():
    with pytest.raises(ValueError, match=r"time '-1ms': expected"):
        parse_time("-1ms")
    with pytest.raises(ValueError, match=r"delay 'fast': expected"):
        bench_units.parse_time("fast")


@pytest.mark.parametrize(("text", "nbytes"), [
    ("4096", 4096), ("4096B", 4096), ("1K", 1024), ("64M", 64 << 20), ("64MiB", 64 << 20),
    ("1G", 1 << 30), ("1T", 1 << 40), ("1KB", 1000), ("64MB", 64_000_000),
    ("1.3GB", 1.3e9), ("1.5K", 1536), ("3e3", 3000), ("2 kib", 2048)])
def test_sizes_binary_unless_decimal_bytes(text, nbytes):
    assert parse_bytes(text) == pytest.approx(nbytes, rel=1e-12)


@pytest.mark.parametrize("text", ["", "1Q", "-4K", "K", "1KiiB", "1 2K"])
def test_sizes_refused_name_the_text(text):
    with pytest.raises(ValueError, match=rf"size {text!r}: expected a number"):
        parse_bytes(text)


def test_bench_sizes_are_whole_bytes_of_the_same_grammar():
    assert bench_units.parse_size("64MB") == 64_000_000
    assert bench_units.parse_sizes("1KB,1.5K") == [1000, 1536]
    with pytest.raises(ValueError, match="whole number of bytes"):
        bench_units.parse_size("1.3G")


def test_plan_and_bench_read_one_grammar():
    assert plan_units.parse_rate is parse_rate and plan_units.parse_time is parse_time
    for text in ("200mbit", "1gibit", "10mbps"):
        assert bench_units.parse_rate(text) == plan_units.parse_rate(text)
    # A model given by its float32 gradient's size: the same bytes as bench's sizes.
    assert plan_units.parse_params("64MB") == bench_units.parse_size("64MB") // 4
    assert plan_units.parse_params("64M") == bench_units.parse_size("64M") // 4

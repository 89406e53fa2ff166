"""`reducerd plan`: the capacity model's arithmetic against hand-derived cases,
its parsers, its command line and JSON, and its place as a leaf of the daemon.

Hand derivations use a model of 1,000,000 parameters: M = 2,000,000 bytes of
float16 gradient. e is the payload's share of a link at MTU 9000:
(9000 - 52) / (9000 + 38) = 8948 / 9038.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from reducerd.plan import capacity
from reducerd.plan.capacity import (
    ClusterSpec,
    daemons_needed,
    default_chunk_bytes,
    efficiency,
    layout_chunk_bytes,
    plan_reducerd,
    plan_ring,
)
from reducerd.plan.cli import main, plan_from_argv
from reducerd.plan.models import MODELS, resolve_model
from reducerd.plan.units import parse_params, parse_rate, parse_time

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
E = 8948 / 9038
M = 2_000_000  # float16 bytes of a 1M-parameter model
GBPS = 1e9


def spec(nodes=4, gpus=1, daemons=None, link=GBPS, daemon_link=None, rate=1e12, cores=1,
         **kw) -> ClusterSpec:
    return ClusterSpec(params=1_000_000, wire_bytes_per_param=2, nodes=nodes, gpus_per_node=gpus,
                       link_Bps=link, daemon_link_Bps=daemon_link or link,
                       daemon_rate_Bps_per_core=rate, daemon_cores=cores, daemons=daemons, **kw)


# -- bytes per link ---------------------------------------------------------

# (N, D) -> each daemon link's bytes each way, N M / D, written out.
DAEMON_LINK_BYTES = {(2, 1): 4e6, (2, 2): 2e6, (2, 4): 1e6, (4, 1): 8e6, (4, 2): 4e6,
                     (4, 4): 2e6, (8, 1): 16e6, (8, 2): 8e6, (8, 4): 4e6}
# (N, G) -> a ring's bytes per node link each way, 2 (K-1)/K M with K = N G.
RING_LINK_BYTES = {(2, 1): 2e6, (4, 1): 3e6, (8, 1): 3.5e6,
                   (2, 8): 3.75e6, (4, 8): 3.875e6, (8, 8): 3.9375e6}


@pytest.mark.parametrize("gpus", [1, 8])
@pytest.mark.parametrize(("nodes", "daemons"), sorted(DAEMON_LINK_BYTES))
def test_reducerd_bytes_per_link(nodes, daemons, gpus):
    """A node sends the model once whatever G (node-local aggregation); each
    daemon link carries its share of every node's model."""
    plan = plan_reducerd(spec(nodes, gpus, daemons))
    assert plan.worker_link_bytes == M
    assert plan.daemon_link_bytes == pytest.approx(DAEMON_LINK_BYTES[nodes, daemons])
    assert plan.daemon_input_bytes == plan.daemon_link_bytes
    assert plan.daemons == daemons


@pytest.mark.parametrize(("nodes", "gpus"), sorted(RING_LINK_BYTES))
def test_ring_bytes_per_link(nodes, gpus):
    ring = plan_ring(spec(nodes, gpus))
    assert ring.ranks == nodes * gpus
    assert ring.worker_link_bytes == pytest.approx(RING_LINK_BYTES[nodes, gpus])
    assert ring.time_s == pytest.approx(RING_LINK_BYTES[nodes, gpus] / (GBPS * E))


def test_ring_inside_one_node_uses_no_link_and_latency_counts_per_step():
    assert plan_ring(spec(nodes=1, gpus=8)).worker_link_bytes == 0
    ring = plan_ring(spec(nodes=2, gpus=8, latency_s=10e-6))
    assert ring.latency_s == pytest.approx(2 * 15 * 10e-6)  # 2 (K - 1) steps, K = 16
    assert ring.time_s == pytest.approx(3.75e6 / (GBPS * E) + 300e-6)


# -- daemons needed ---------------------------------------------------------

def _keeps_up(plan) -> bool:
    return max(plan.daemon_link_s, plan.daemon_cpu_wall_s) <= plan.worker_link_s * (1 + 1e-12)


@pytest.mark.parametrize(("daemon_link", "rate", "cores", "needed"), [
    (GBPS, 1e12, 1, 8),  # equal links: one daemon per node
    (2 * GBPS, 1e12, 1, 4),  # faster daemon links: fewer
    (4 * GBPS, 1e12, 1, 2),
    (0.5 * GBPS, 1e12, 1, 16),
    (GBPS, 0.5 * GBPS * E, 16, 8),  # CPU to spare: the link bounds
])
def test_daemons_needed_to_keep_worker_links_full(daemon_link, rate, cores, needed):
    s = spec(nodes=8, daemon_link=daemon_link, rate=rate, cores=cores)
    assert daemons_needed(s) == needed
    plan = plan_reducerd(s)
    assert plan.daemons == needed  # --daemons not given: as many as needed
    assert plan.daemon_link_s <= plan.worker_link_s * (1 + 1e-12)
    assert plan.daemon_cpu_wall_s <= plan.worker_link_s * (1 + 1e-12)
    fewer = plan_reducerd(ClusterSpec(**{**s.__dict__, "daemons": needed - 1}))
    assert fewer.bottleneck in ("daemon link", "daemon CPU")
    assert max(fewer.daemon_link_s, fewer.daemon_cpu_wall_s) > plan.worker_link_s


@pytest.mark.parametrize(("daemon_link", "cores", "bytes_alone"), [
    (GBPS, 1, 16),  # a core sums half a link's payload: CPU bound
    (GBPS, 4, 8),  # four cores per daemon: the bytes alone would let the link bound
    (4 * GBPS, 4, 4),
])
def test_cpu_bound_daemons_needed_count_each_chunks_fixed_cost(daemon_link, cores, bytes_alone):
    """A core sums half a link's payload; each chunk a daemon takes also costs it
    reducer_wire.layout.CHUNK_COST_BYTES of work (w = 1 + K / C), so more
    daemons are needed than the bytes alone (w = 1) would ask, and the count
    is the fewest that keep up (every smaller one checked)."""
    from reducer_wire.layout import CHUNK_COST_BYTES

    s = spec(nodes=8, daemon_link=daemon_link, rate=0.5 * GBPS * E, cores=cores)
    needed = daemons_needed(s)
    plan = plan_reducerd(s)
    assert plan.daemons == needed > bytes_alone
    assert _keeps_up(plan)
    assert not any(_keeps_up(plan_reducerd(ClusterSpec(**{**s.__dict__, "daemons": d})))
                   for d in range(1, needed))
    assert plan.daemon_work_per_byte == pytest.approx(1 + CHUNK_COST_BYTES / plan.chunk_bytes)
    assert plan.daemon_cpu_s == pytest.approx(8 * M / needed * plan.daemon_work_per_byte
                                              / (0.5 * GBPS * E))


def test_bottleneck_and_time_per_step_worked_example():
    """N = D = 4 at 200 Mbit/s (25e6 bytes/s), 16 MiB of float32 (8 MiB float16):
    chunks of 8 MiB / 128 = 64 KiB; time = 8 MiB / (25e6 e) + 64 KiB (4 + 3) / 25e6:
    the first chunk through a link that carries 4 at once, then the last
    chunk's 4 flows into one daemon link landing 3 chunks apart."""
    s = ClusterSpec(params=4 << 20, wire_bytes_per_param=2, nodes=4, gpus_per_node=1,
                    link_Bps=25e6, daemon_link_Bps=25e6, daemon_rate_Bps_per_core=1.2e9,
                    daemons=4)
    plan = plan_reducerd(s)
    assert plan.chunk_bytes == 64 << 10
    assert plan.bottleneck == "worker link"
    assert plan.pipeline_s == pytest.approx((64 << 10) * 7 / 25e6)
    assert plan.time_s == pytest.approx((8 << 20) / (25e6 * E) + (64 << 10) * 7 / 25e6)
    two = plan_reducerd(ClusterSpec(**{**s.__dict__, "daemons": 2}))
    assert two.bottleneck == "daemon link"  # each daemon link carries 2 models
    assert two.daemon_link_s == pytest.approx(2 * (8 << 20) / (25e6 * E))
    # Chunks of 8 MiB / 64; the fill passes the daemon's 4 workers, the drain 3: (4 + 3) C / 25e6.
    assert two.pipeline_s == pytest.approx((4 + 3) * (128 << 10) / 25e6)
    # More daemons than workers: the worker's link, which sends to all 8 at
    # once, sets the fill; the drain is still the daemon's 4 flows.
    eight = plan_reducerd(ClusterSpec(**{**s.__dict__, "daemons": 8}))
    assert eight.pipeline_s == pytest.approx((8 + 3) * eight.chunk_bytes / 25e6)
    assert two.time_s == pytest.approx(two.daemon_link_s + two.pipeline_s)
    slow = plan_reducerd(ClusterSpec(**{**s.__dict__, "daemon_rate_Bps_per_core": 10e6}))
    assert slow.bottleneck == "daemon CPU"
    # Each 64 KiB chunk also costs the work of 128 KiB: w = 3.
    assert slow.daemon_work_per_byte == 3
    assert slow.daemon_cpu_s == pytest.approx(3 * (8 << 20) / 10e6)


def test_bert_large_cluster_needs_256_daemon_links_of_14_cores():
    """The issue's figure: 256 nodes x 672 MB at 1.2 GB per CPU-second is about
    145 CPU-seconds of summing the bytes per step; the chunks' fixed costs
    (375 kB chunks, each costing the work of 128 KiB more) make it 1.35x that,
    14 cores per 100 Gbit/s daemon link instead of 11."""
    plan = plan_from_argv(["--preset", "bert-large-256"])
    ours = plan["reducerd"]
    assert plan["inputs"]["model_bytes"] == 672_452_216
    # sqrt(128 KiB x M / 256 / 2) = 414,898 bytes at most: 1,621 chunks, 7 per daemon.
    assert ours["chunk_bytes"] == pytest.approx(672_452_216 / (7 * 256))
    w = 1 + (128 << 10) / ours["chunk_bytes"]
    assert ours["daemon_work_per_byte"] == pytest.approx(w) and 1.34 < w < 1.36
    assert ours["daemons"] == 256 and plan["inputs"]["daemon_cores"] == 14  # ceil(10.3 w)
    assert ours["total_cpu_s"] == pytest.approx(256 * 672_452_216 * w / 1.2e9)
    assert ours["cores_to_fill_links"] == pytest.approx(256 * 12.5e9 * E * w / 1.2e9)
    assert plan["ring"]["worker_link_bytes"] == pytest.approx(2 * 2047 / 2048 * 672_452_216)
    # One core per daemon: 2,641 daemons for the bytes alone, but their chunks
    # would be 64 KiB or less (w >= 3): the fewest that keep up are far more.
    one_core = plan_from_argv(["--preset", "bert-large-256", "--daemon-cores", "1"])
    daemons = one_core["reducerd"]["daemons"]
    assert daemons > 3 * 2641
    for fewer in (2641, 5000, 7923, daemons - 1):
        below = plan_from_argv(["--preset", "bert-large-256", "--daemon-cores", "1",
                                "--daemons", str(fewer)])["reducerd"]
        assert below["bottleneck"] != "worker link", fewer


def test_the_planners_chunks_are_the_layout_rules():
    from reducer_wire.layout import chunk_cost_bytes, pipelined_chunk_bytes, plan_chunks

    for model_bytes in (2, 1000, 64 << 10, 100_000, 1 << 20, 3 << 20, 1 << 24, 672_452_216):
        for daemons in (1, 2, 4, 256):
            chunk = default_chunk_bytes(model_bytes, daemons)
            assert chunk == pipelined_chunk_bytes(model_bytes, daemons)
            assert default_chunk_bytes(model_bytes, daemons, 25e6) == pipelined_chunk_bytes(
                model_bytes, daemons, cost_bytes=chunk_cost_bytes(25e6))
            for limit in (chunk, 4096, 1 << 20):
                count = len(plan_chunks(model_bytes // 2, 2, daemons, limit))
                assert layout_chunk_bytes(model_bytes, daemons, limit) == pytest.approx(
                    model_bytes / count)


def test_the_planners_int8_chunks_are_the_layout_rules():
    """int8's chunks hold whole blocks of 128 elements, 132 bytes with their scale;
    the clients are given the planned link rate (1 GB/s: less than a daemon sums)."""
    from reducer_wire import dtypes
    from reducer_wire.layout import KeyLayout, plan_wire_chunks

    int8 = dtypes.WIRE_DTYPES["int8"]
    for params in (1000, 70_000, 25_557_032, 1 << 24):
        for daemons in (1, 3, 4):
            plan = plan_from_argv(["--model", f"{params} params", "--workers", "4",
                                   "--link", "1gbps", "--wire-dtype", "int8",
                                   "--daemons", str(daemons)])
            chunks = plan_wire_chunks(params, int8, daemons, default_chunk_bytes(
                plan["inputs"]["model_bytes"], daemons, 1e9))
            assert chunks == KeyLayout.for_link(daemons, None, 1e9).plan(params, int8)
            mean = dtypes.wire_nbytes(int8, params) / len(chunks)
            assert plan["reducerd"]["chunk_bytes"] == pytest.approx(mean, rel=1e-3)


def test_efficiency():
    assert efficiency(0.3, 0.1) == pytest.approx(0.75)
    assert efficiency(0.3, 0.1, overlap=0.5) == 1.0
    assert efficiency(0.3, 0.1, overlap=0.2) == pytest.approx(0.3 / 0.34)


# -- parsers ----------------------------------------------------------------

@pytest.mark.parametrize(("text", "bytes_per_s"), [
    ("100gbit", 12.5e9), ("100Gbit/s", 12.5e9), ("200mbit", 25e6), ("10gbps", 10e9),
    ("1000", 125.0), ("1gibit", 2**30 / 8), ("25 Gbit/s", 3.125e9)])
def test_parse_rate(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["", "fast", "0gbit", "-1gbit", "100gbit/h", "100/s"])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError, match="tc's syntax"):
        parse_rate(text)


@pytest.mark.parametrize(("text", "params"), [
    ("340M params", 340_000_000), ("25.6Mparams", 25_600_000), ("1.5B params", 1_500_000_000),
    ("3.4e8 params", 340_000_000), ("1.3G", 348_966_093), ("64MiB", 16 << 20),
    ("1.3GB", 325_000_000), ("4096", 1024)])
def test_parse_params(text, params):
    assert parse_params(text) == params


def test_parse_params_and_time_refuse():
    assert parse_params("bert-large") is None
    with pytest.raises(ValueError, match="at least one parameter"):
        parse_params("2")
    assert parse_time("20us") == pytest.approx(20e-6) and parse_time("0") == 0
    with pytest.raises(ValueError, match="expected"):
        parse_time("-1ms")


def test_models_by_name_and_bert_large_from_its_shapes():
    assert resolve_model("BERT_Large").params == MODELS["bert-large"]
    assert resolve_model("resnet50").params == 25_557_032
    assert resolve_model("340M params").params == 340_000_000
    with pytest.raises(ValueError, match="not a known name"):
        resolve_model("llama-9000")
    h, ffn, vocab, layers = 1024, 4096, 30522, 24
    embeddings = (vocab + 512 + 2) * h + 2 * h
    layer = 3 * (h * h + h) + (h * h + h) + 2 * h + (h * ffn + ffn) + (ffn * h + h) + 2 * h
    pooler = h * h + h
    heads = (h * h + h) + 2 * h + vocab + (2 * h + 2)  # MLM transform + tied decoder bias, NSP
    assert embeddings + layers * layer + pooler == 335_141_888
    assert embeddings + layers * layer + pooler + heads == MODELS["bert-large"]


# -- command line -----------------------------------------------------------

BASE = ["--model", "1M params", "--workers", "4", "--gpus-per-node", "8", "--link", "1gbps"]


@pytest.mark.parametrize(("extra", "flag"), [
    (["--workers", "0"], "--workers"), (["--link", "fast"], "--link"),
    (["--daemon-link", "0gbit"], "--daemon-link"), (["--model", "llama-9000"], "--model"),
    (["--daemons", "0"], "--daemons"), (["--gpus-per-node", "0"], "--gpus-per-node"),
    (["--daemon-rate", "0"], "--daemon-rate"), (["--daemon-cores", "many"], "--daemon-cores"),
    (["--daemon-cores", "0"], "--daemon-cores"), (["--latency", "soon"], "--latency"),
    (["--overlap", "1.5"], "--overlap"), (["--compute-time", "0"], "--compute-time"),
    (["--chunk-bytes", "1"], "--chunk-bytes"), (["--mtu", "100"], "--mtu"),
    # Non-finite or overflowing figures: a usage error, not a traceback or NaN in the JSON.
    (["--model", "1e400 params"], "--model"), (["--model", "1e400"], "--model"),
    (["--compute-time", "inf"], "--compute-time"), (["--daemon-rate", "1e-320"], "--daemon-rate"),
    # int8's layout cuts whole blocks of 128 elements (132 bytes with the scale).
    (["--wire-dtype", "int8", "--chunk-bytes", "131"], "--chunk-bytes")])
def test_bad_inputs_exit_2_naming_the_flag(extra, flag, capsys):
    assert main(BASE + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("reducerd plan: error: ") and flag in err


def test_missing_required_flags(capsys):
    assert main(["--model", "resnet50", "--workers", "4"]) == 2
    assert "--link required" in capsys.readouterr().err


def test_output_and_json_carry_the_same_figures(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*BASE, "--daemons", "2", "--daemon-cores", "2", "--compute-time", "0.01",
                 "--steps", "100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan == plan_from_argv([*BASE, "--daemons", "2", "--daemon-cores", "2",
                                   "--compute-time", "0.01", "--steps", "100",
                                   "--json", str(out)])
    assert plan["inputs"]["ranks"] == 32 and plan["reducerd"]["daemons"] == 2
    assert plan["reducerd"]["daemon_link_bytes"] == 4e6  # 4 nodes x 2 MB / 2
    assert plan["reducerd"]["bottleneck"] == "daemon link"
    for needle in ("2 MB on each worker link, 4 MB on each daemon link",
                   "daemon link 4.04 ms (bound)", "ring over 32 ranks: 3.875 MB",
                   f"wrote {out}"):
        assert needle in text
    training = plan["training"]
    assert training["reducerd"]["step_time_s"] == pytest.approx(
        0.01 + plan["reducerd"]["time_s"])
    assert training["ring"]["minutes_to_train"] == pytest.approx(
        100 * (0.01 + plan["ring"]["time_s"]) / 60)


def test_preset_prints_the_original_beside_the_projection():
    run = subprocess.run([sys.executable, "-m", "reducerd", "plan", "--preset",
                          "bert-large-256"], capture_output=True, text=True, timeout=30,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "672.5 MB of float16 gradient per step" in run.stdout
    assert "reducerd: 256 daemon(s)" in run.stdout
    assert "the original reported: 62 minutes to train, 85% scaling efficiency" in run.stdout
    assert "minutes for 8,599 steps" in run.stdout


def test_the_planner_is_a_leaf():
    """Only the command line imports reducerd.plan; it imports no client and no bench."""
    daemon = ROOT / "reducerd"
    for path in daemon.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        inside = path.is_relative_to(daemon / "plan")
        if not inside and path.name != "__main__.py":
            assert not any(n.startswith("reducerd.plan") for n in names), path
        if inside:
            assert not any(n.startswith(("reducer_client", "reducerd.bench")) for n in names)
    assert capacity.MIN_CHUNK_BYTES == 64 << 10


@pytest.mark.parametrize(("dtype", "model_bytes"), [
    ("float32", 4_000_000), ("bfloat16", 2_000_000), ("fp8_e4m3", 1_000_000),
    ("int8", 1_000_000 + 4 * 7813)])  # a float32 scale per block of 128 elements
def test_wire_dtypes_size_the_model(dtype, model_bytes):
    plan = plan_from_argv([*BASE, "--wire-dtype", dtype])
    assert plan["inputs"]["model_bytes"] == model_bytes
    assert plan["reducerd"]["worker_link_bytes"] == model_bytes

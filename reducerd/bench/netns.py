"""An emulated cluster: one network namespace per host, a bridge, shaped links.

Layout (run id R = the bench's pid, so concurrent runs never collide):

    rbench-R-sw      the switch: bridge br0 and the switch end of every veth
    rbench-R-n<k>    worker node k: eth0 = 198.18.0.<k+1>/15
    rbench-R-d<i>    daemon host i: eth0 = 198.18.1.<i+1>/15

Each host's link is shaped to RATE in both directions with tbf: on eth0 inside
the host (what it sends) and on its veth end in the switch (what it receives),
with an optional netem delay in each direction. Links carry one frame per
packet (gso_max_segs 1), so the interface counters count headers per frame as
a NIC does, with a data-centre MTU (9000 by default, as on AWS). Nothing is created in the
caller's own namespace, so deleting the namespaces removes everything; the
processes still inside one are killed first. Namespaces whose run id is no
longer a live process are leftovers of a killed run and removed at start.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Host", "Cluster", "NetnsError", "check_available", "cleanup_leftovers",
           "read_counters", "loopback_host", "PREFIX"]

PREFIX = "rbench-"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-")


class NetnsError(RuntimeError):
    """The emulated cluster cannot be built (not root, no iproute2, a tc error...)."""


@dataclass(frozen=True)
class Host:
    """Where a process runs: a namespace (None: this one) and its address."""

    name: str
    netns: str | None
    address: str
    iface: str | None  # the link whose counters we read; None on loopback

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        if self.netns is None:
            return list(argv)
        return ["ip", "netns", "exec", self.netns, *argv]


def loopback_host(name: str) -> Host:
    return Host(name, None, "127.0.0.1", None)


def read_counters(iface: str) -> tuple[int, int]:
    """(received, sent) bytes of `iface` in the calling process's namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise NetnsError(f"no interface {iface!r} in this network namespace")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def check_available() -> None:
    """Raise NetnsError saying what is missing for --emulate-cluster."""
    if os.geteuid() != 0:
        raise NetnsError("--emulate-cluster needs root (it creates network namespaces and "
                         "shapes links with tc); run it as root, or drop --emulate-cluster")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"--emulate-cluster needs {' and '.join(missing)} from iproute2 "
                         "(apt-get install iproute2)")


def _list_namespaces() -> list[str]:
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _remove_namespace(name: str) -> None:
    """Kill what runs inside, then delete (its veths and qdiscs go with it)."""
    pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", name], check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers() -> list[str]:
    """Remove namespaces of earlier runs whose bench process is gone; return their names."""
    removed = []
    for name in _list_namespaces():
        match = _NAME_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _remove_namespace(name)
            removed.append(name)
    return removed


def _tbf_params(rate_bytes_per_s: float) -> list[str]:
    # burst: 1 ms at line rate (at least 16 KiB, more than one jumbo GSO
    # segment gets split by tbf anyway); queue: 100 ms at line rate (at least
    # 1 MiB) so that incast from several senders queues instead of dropping.
    burst = max(16 << 10, int(rate_bytes_per_s / 1000))
    limit = max(1 << 20, int(rate_bytes_per_s / 10))
    return ["burst", str(burst), "limit", str(limit)]


class Cluster:
    """Namespaces for `nodes` worker nodes and `daemons` daemon hosts; see the module doc."""

    def __init__(self, rate: str, rate_bytes_per_s: float, nodes: int, daemons: int,
                 delay_s: float = 0.0, mtu: int = 9000) -> None:
        self.rate, self.rate_bytes_per_s, self.delay_s = rate, rate_bytes_per_s, delay_s
        self.mtu = mtu
        self.run_id = os.getpid()
        self.switch = f"{PREFIX}{self.run_id}-sw"
        self.nodes = [self._host(f"n{k}", f"198.18.0.{k + 1}") for k in range(nodes)]
        self.daemons = [self._host(f"d{i}", f"198.18.1.{i + 1}") for i in range(daemons)]
        self._created: list[str] = []

    def _host(self, short: str, address: str) -> Host:
        return Host(short, f"{PREFIX}{self.run_id}-{short}", address, "eth0")

    def create(self) -> None:
        """Build everything; on any failure remove what was built and raise NetnsError."""
        try:
            self._add_namespace(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for host in self.nodes + self.daemons:
                self._add_host(host)
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Remove every namespace of this cluster (idempotent)."""
        for name in reversed(self._created):
            _remove_namespace(name)
        self._created.clear()

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        # No IPv6 autoconfiguration chatter on the counted links.
        _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w",
              "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
             check=False)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _add_host(self, host: Host) -> None:
        assert host.netns is not None
        self._add_namespace(host.netns)
        _run(["ip", "-n", self.switch, "link", "add", host.name, "type", "veth",
              "peer", "name", "eth0", "netns", host.netns])
        _run(["ip", "-n", self.switch, "link", "set", host.name, "master", "br0", "up"])
        _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/15", "dev", "eth0"])
        # One skb per frame, as a NIC counts its bytes: without this a veth
        # counts a 64 KiB GSO packet with a single set of headers.
        for netns, dev in ((host.netns, "eth0"), (self.switch, host.name)):
            _run(["ip", "-n", netns, "link", "set", dev, "mtu", str(self.mtu),
                  "gso_max_segs", "1"])
        _run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
        self._shape(host.netns, "eth0")  # what the host sends
        self._shape(self.switch, host.name)  # what the host receives

    def _shape(self, netns: str, dev: str) -> None:
        _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
              "rate", self.rate, *_tbf_params(self.rate_bytes_per_s)])
        if self.delay_s > 0:
            done = _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "parent", "1:1",
                         "handle", "10:", "netem", "delay", f"{self.delay_s * 1e6:.0f}us",
                         "limit", "100000"], check=False)
            if done.returncode != 0:
                hint = (" (this kernel has no sch_netem: run without --emulate-delay)"
                        if "unknown" in done.stderr.lower() else "")
                raise NetnsError(f"netem delay on {dev}: {done.stderr.strip()}{hint}")

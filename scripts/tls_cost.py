"""What TLS costs on the data plane: the same allreduces through a plaintext
daemon and a TLS daemon (mutual TLS optional), over the TCP data plane.

    .venv/bin/python scripts/tls_cost.py --workers 4 --sizes 1M,16M,64M --rounds 20

Certificates are made here (cryptography: a CA, a server certificate for
127.0.0.1, a client one). Per size and daemon: the median seconds of one
allreduce over the ranks' slowest, the bus bandwidth (2 (N-1)/N bytes / s,
as nccl-tests), and the daemon's CPU seconds per GB of input (/proc). Run it
on a quiet machine: on a shared one the figures mean little.

reducerd bench has no TLS option (yet); this script is the measurement that
issue 16 asks for, kept apart so that the bench stays as it is.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from reducerd.bench.procs import cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))


def _pki(directory: Path) -> dict[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(common):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def sign(subject, key, issuer, issuer_key, ca=False, ip=None):
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(name(subject))
                   .issuer_name(name(issuer)).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True))
        if ip:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), False)
        return builder.sign(issuer_key, hashes.SHA256())

    files = {}

    def write(label, key, cert):
        key_path, cert_path = directory / f"{label}.key", directory / f"{label}.pem"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[label + "_key"], files[label + "_cert"] = str(key_path), str(cert_path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    write("ca", ca_key, sign("ca", ca_key, "ca", ca_key, ca=True))
    for label, ip in (("server", "127.0.0.1"), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(label, key, sign(label, key, "ca", ca_key, ip=ip))
    return files


def _worker(rank, world_size, address, tls_files, sizes, rounds, results):
    from reducer_client import ReducerClient
    from reducer_client.tls import TLSConfig

    tls = (TLSConfig(ca_file=tls_files["ca_cert"], cert_file=tls_files.get("client_cert"),
                     key_file=tls_files.get("client_key")) if tls_files else None)
    times = {}
    with ReducerClient([address], job="tls-cost", rank=rank, world_size=world_size,
                       wire_dtype="float32", timeout=120, tls=tls, data_plane="tcp",
                       node_local=False) as client:
        for size in sizes:
            array = np.ones(size, np.float32)
            for _ in range(2):  # warm-up: connections, buffers
                client.allreduce(array, key=f"s{size}", out=array)
            seconds = []
            for _ in range(rounds):
                start = time.perf_counter()
                client.allreduce(array, key=f"s{size}", out=array)
                seconds.append(time.perf_counter() - start)
            times[size] = seconds
        assert client.transports == ["tcp"], client.transports
    results.put((rank, times))


def _measure(label, daemon, tls_files, workers, sizes, rounds):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cpu_before = cpu_seconds(daemon.process.pid)
    procs = [ctx.Process(target=_worker, args=(r, workers, daemon.address, tls_files, sizes,
                                              rounds, results)) for r in range(workers)]
    for p in procs:
        p.start()
    per_rank = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    cpu_s = cpu_seconds(daemon.process.pid) - cpu_before
    input_gb = sum(4 * s * (rounds + 2) * workers for s in sizes) / 1e9
    rows = []
    for size in sizes:
        slowest = [max(per_rank[r][size][i] for r in per_rank) for i in range(rounds)]
        median_s = statistics.median(slowest)
        bus_gbps = 2 * (workers - 1) / workers * 4 * size / median_s / 1e9 if workers > 1 \
            else 4 * size / median_s / 1e9
        rows.append((label, size, median_s, bus_gbps))
    return rows, cpu_s / input_gb


def main(argv: list[str] | None = None) -> int:
    from support import start_daemon

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sizes", default="1M,16M", help="float32 elements: 1K, 1M, ...")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mutual", action="store_true", help="mutual TLS for the TLS daemon")
    args = parser.parse_args(argv)
    units = {"K": 1 << 10, "M": 1 << 20}
    sizes = [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
             for s in args.sizes.split(",")]
    directory = Path(tempfile.mkdtemp(prefix="tls-cost-"))
    pki = _pki(directory)
    tls_args = ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"]]
    client_files = {"ca_cert": pki["ca_cert"]}
    if args.mutual:
        tls_args += ["--tls-client-ca", pki["ca_cert"]]
        client_files.update(client_cert=pki["client_cert"], client_key=pki["client_key"])
    print(f"{args.workers} workers, rounds {args.rounds}, CPUs {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| daemon | elements | median s | bus GB/s | daemon CPU s per GB in |")
    print("|---|---:|---:|---:|---:|")
    baseline = {}
    for label, daemon_args, files in (("plaintext", [], None),
                                      ("TLS" + (" (mutual)" if args.mutual else ""),
                                       tls_args, client_files)):
        daemon = start_daemon(*daemon_args, "--round-timeout", "120", log_dir=directory)
        try:
            rows, cpu_per_gb = _measure(label, daemon, files, args.workers, sizes,
                                        args.rounds)
        finally:
            daemon.stop()
        for name, size, median_s, bus in rows:
            ratio = f" ({median_s / baseline[size]:.2f}x)" if size in baseline else ""
            baseline.setdefault(size, median_s)
            print(f"| {name} | {size} | {median_s:.4f}{ratio} | {bus:.2f} | {cpu_per_gb:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

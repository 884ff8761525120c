"""Put / get bandwidth of the Redis tier beside raw redis-py and redis-benchmark, on one server, in one run.

Starts its own ``redis-server`` on a free loopback port, then for 1, 4 and 32 MiB records measures, interleaved
(the order of the clients rotates every round) and ``--reps`` times (medians reported):

* ``kvtier``: ``RedisTier.put`` / ``RedisTier.get`` of a batch of records (payload bytes counted);
* ``redis-py``: one pipelined SET / GET of the same batch with redis-py (hiredis parser when installed);
* ``redis-benchmark``: the C client, ``-t set,get -d SIZE -P 2 -c CONNECTIONS``, its own request rate;
* ``LMCache resp://`` and ``LMCache redis://``: LMCache 0.5.6's remote backend with its native C++ client and with
  its redis-py connector, a batch of records of the same size put and read back through LMCache's CPU memory
  (``benchmarks/lmcache_peer.py``), when LMCache is installed (``--lmcache``; without it these rows are left out,
  with a note saying how to install it).

Every client's bytes but ``redis-benchmark``'s (it sends its own) are checked once before the timed rounds. Every
buffer is touched before it is timed (on this VM freed memory goes back to the host after ~2 s and touching it again
runs at ~0.5 GB/s). Prints a table and writes ``benchmarks/results/redis_bandwidth.json`` and ``.png``. ``--quick``
(CI) runs in well under a minute.

    .venv/bin/python benchmarks/redis_bandwidth.py [--quick] [--reps 3] [--mib 256] [--connections 4]
        [--lmcache DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvtier from this checkout

import torch  # noqa: E402

from benchmarks import lmcache_peer  # noqa: E402
from benchmarks.script_run import missing, run_checked  # noqa: E402
from kvtier.config import RedisTierConfig  # noqa: E402
from kvtier.ops.argtypes import positive_int  # noqa: E402
from kvtier.ops.cli import KvtierParser  # noqa: E402
from kvtier.tiers.redis.tier import RedisTier  # noqa: E402

MIB = 1 << 20
RESULTS = ROOT / "benchmarks" / "results"
CLIENTS = ["kvtier", "redis-py", "redis-benchmark"]
PEERS = {"LMCache resp://": "resp", "LMCache redis://": "redis"}  # row name: LMCache's URL scheme


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this benchmark (also used by a ``kvtier bench`` wrapper)."""
    parser.add_argument("--quick", action="store_true", help="small batches, CI-sized (< 60 s)")
    parser.add_argument("--reps", type=positive_int, default=3, help="rounds per client (medians reported)")
    parser.add_argument("--mib", type=positive_int, default=256, help="MiB moved per batch and size")
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[1, 4, 32], help="record sizes in MiB")
    parser.add_argument("--connections", type=positive_int, default=4,
                        help="parallel connections (kvtier, redis-benchmark)")
    parser.add_argument("--lmcache", type=Path, default=None,
                        help="folder LMCache 0.5.6 was installed into with pip --target (default: .peers/lmcache "
                             "when present; without LMCache its rows are left out)")
    parser.add_argument("--out", type=Path, default=RESULTS / "redis_bandwidth.json")
    parser.add_argument("--no-plot", action="store_true")


def _touched(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


class Meter:
    """Wall time plus CPU seconds of this process, its children (redis-benchmark) and the server."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def _now(self) -> tuple[float, float, float]:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(f"/proc/{self.server_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return time.perf_counter(), me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, server

    def __enter__(self) -> Meter:
        self.start = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = self._now()

    def sample(self, nbytes: int, gbps: float | None = None) -> dict[str, float]:
        """GB/s (wall, unless the client reported its own) and CPU seconds per GB of client and server."""
        wall, client, server = (b - a for a, b in zip(self.start, self.end, strict=True))
        gb = nbytes / 1e9
        return {"gbps": gbps if gbps is not None else gb / wall, "client_cpu_s_per_gb": client / gb,
                "server_cpu_s_per_gb": server / gb}


Sample = dict[str, float]


async def _kvtier_round(tier: RedisTier, items: list[tuple[bytes, torch.Tensor]], pid: int,
                        check: bool = False) -> dict[str, Sample]:
    payload = sum(t.nbytes for _, t in items)
    with Meter(pid) as put:
        ok = await tier.put(items)
    with Meter(pid) as get:
        got = await tier.get([k for k, _ in items])
    if not all(ok) or any(g is None for g in got):
        raise RuntimeError(f"kvtier round lost records: {tier.stats()}")
    if check and not all(torch.equal(g.view(torch.uint8).reshape(-1), t)  # type: ignore[union-attr]
                         for g, (_, t) in zip(got, items, strict=True)):
        raise RuntimeError("kvtier read other bytes than it wrote")
    del got  # the buffers go back to the tier's pool, as in an engine that consumes what it reads
    return {"put": put.sample(payload), "get": get.sample(payload)}


def _redispy_round(client: Any, names: list[bytes], values: list[bytes], pid: int,
                   check: bool = False) -> dict[str, Sample]:
    payload = sum(len(v) for v in values)
    with Meter(pid) as put:
        pipe = client.pipeline(transaction=False)
        for name, value in zip(names, values, strict=True):
            pipe.set(name, value)
        pipe.execute()
    with Meter(pid) as get:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        got = pipe.execute()
    if any(g is None for g in got) or (check and got != values):
        raise RuntimeError("redis-py round lost records or read other bytes")
    return {"put": put.sample(payload), "get": get.sample(payload)}


def _lmcache_round(peer: lmcache_peer.LmcachePeer, staged: list[Any], tensors: list[torch.Tensor], pid: int,
                   check: bool = False) -> dict[str, Sample]:
    """LMCache's put of the staged records (until it reports each written), then its get of every record."""
    payload = sum(t.nbytes for t in tensors)
    with Meter(pid) as put:
        peer.put(staged)
    if check and not peer.stored(len(staged)):  # a resp:// get of an absent key would hang
        raise RuntimeError("LMCache reported records written that it does not hold")
    peer.release()  # the previous round's records back to LMCache's allocator, outside the timing
    with Meter(pid) as get:
        got = peer.get()
    if check and not all(torch.equal(g, t) for g, t in zip(got, tensors, strict=True)):
        raise RuntimeError("LMCache read other bytes than it wrote")
    return {"put": put.sample(payload), "get": get.sample(payload)}


def _redis_benchmark_round(port: int, size: int, n: int, connections: int, pid: int) -> dict[str, Sample]:
    exe = shutil.which("redis-benchmark") or "redis-benchmark"
    out: dict[str, Sample] = {}
    for op, test in (("put", "set"), ("get", "get")):
        cmd = [exe, "-h", "127.0.0.1", "-p", str(port), "-t", test, "-d", str(size), "-n", str(n), "-P", "2",
               "-c", str(connections), "-r", str(n), "--csv"]
        with Meter(pid) as meter:
            csv = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
        rps = float(csv.splitlines()[1].split(",")[1].strip('"'))
        out[op] = meter.sample(n * size, gbps=rps * size / 1e9)
    return out


async def _measure_size(srv: Any, tier: RedisTier, client: Any, size: int, args: argparse.Namespace,
                        ) -> dict[str, dict[str, list[Sample]]]:
    n = max(4 if args.quick else 8, args.mib * MIB // size)
    tensors = [_touched(size, i) for i in range(n)]
    items = [(bytes([0xAB]) * 16 + i.to_bytes(16, "big"), t) for i, t in enumerate(tensors)]
    names = [b"rp:%d:%d" % (size, i) for i in range(n)]
    values = [t.numpy().tobytes() for t in tensors]
    pid = srv.proc.pid
    peers: dict[str, lmcache_peer.LmcachePeer] = {}
    staged: dict[str, list[Any]] = {}
    try:
        for name, scheme in PEERS.items() if args.peers else ():
            peers[name] = lmcache_peer.LmcachePeer(size, n, url=f"{scheme}://127.0.0.1:{srv.port}",
                                                   name=f"bench-{scheme}")
            staged[name] = peers[name].stage(tensors)
        rounds: dict[str, Any] = {
            "kvtier": lambda check=False: _kvtier_round(tier, items, pid, check),
            "redis-py": lambda check=False: _redispy_round(client, names, values, pid, check),
            "redis-benchmark": lambda check=False: _redis_benchmark_round(srv.port, size, n, args.connections, pid),
            **{name: (lambda check=False, p=peer, s=staged[name]: _lmcache_round(p, s, tensors, pid, check))
               for name, peer in peers.items()}}
        for one in rounds.values():  # warm-up (connections, buffer pools, server memory); every client's bytes
            await _awaited(one(check=True))
        runs: dict[str, dict[str, list[Sample]]] = {c: {"put": [], "get": []} for c in rounds}
        order = list(rounds)
        for rep in range(args.reps):
            for name in order[rep % len(order):] + order[:rep % len(order)]:  # interleaved, in a rotating order
                out = await _awaited(rounds[name]())
                for op in ("put", "get"):
                    runs[name][op].append(out[op])
    finally:
        for name, peer in peers.items():
            peer.release(staged.get(name, []))
            peer.close()
    srv.cli("FLUSHALL")
    return runs


async def _awaited(result: Any) -> Any:
    return await result if asyncio.iscoroutine(result) else result


def _medians(runs: dict[str, dict[str, list[Sample]]]) -> dict[str, dict[str, Sample]]:
    """Per client and op: the median of each figure, plus the bandwidth the CPU cost allows when client and
    server each have a core of their own (1 / the larger of the two CPU costs): a figure that a busy shared
    machine does not distort."""
    out: dict[str, dict[str, Sample]] = {}
    for client, ops in runs.items():
        out[client] = {}
        for op, samples in ops.items():
            med = {f: round(statistics.median(s[f] for s in samples), 3) for f in samples[0]}
            med["cpu_bound_gbps"] = round(1 / max(med["client_cpu_s_per_gb"], med["server_cpu_s_per_gb"], 1e-3), 2)
            out[client][op] = med
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; return (and save) the results."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    from kvtier.bench.redis_servers import RedisServer  # free port, no persistence, killed at exit

    if args.quick:
        args.mib, args.reps = min(args.mib, 32), max(args.reps, 3)
    clients = len(CLIENTS) + (len(PEERS) if args.peers else 0)
    maxmem = f"{max(1024, (1 + clients) * args.mib + 3 * max(args.sizes) * 16)}mb"
    results: dict[str, Any] = {"sizes_mib": args.sizes, "median": {}, "runs": {}}
    with RedisServer(maxmemory=maxmem) as srv:
        section = RedisTierConfig(name="redis", capacity=1 << 40, url=srv.url, timeout=5.0,
                                  connections=args.connections)
        tier = RedisTier(section)
        await tier.start()
        client = redis.Redis(host="127.0.0.1", port=srv.port)
        try:
            for size in args.sizes:
                runs = await _measure_size(srv, tier, client, size * MIB, args)
                results["runs"][str(size)] = runs
                results["median"][str(size)] = _medians(runs)
        finally:
            client.close()
            await tier.close()
    results["meta"] = {"reps": args.reps, "mib_per_batch": args.mib, "connections": args.connections,
                       "hiredis": HIREDIS_AVAILABLE, "redis_server": _server_version(),
                       "python": platform.python_version(),
                       "machine": f"{platform.machine()}, {_cpus()} CPUs", "load_average_at_end": os.getloadavg(),
                       "lmcache": lmcache_peer.VERSION if args.peers else None}
    _print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not args.no_plot:
        _plot(results, args.out.with_suffix(".png"))
    return results


def _server_version() -> str:
    exe = shutil.which("redis-server") or "redis-server"
    return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()[2]


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def _print_table(results: dict[str, Any]) -> None:
    print("GB/s: measured median | CPU s/GB client+server | GB/s the CPU cost allows with a core each")
    print(f"{'size':>6} {'client':<17} {'put':>6} {'get':>6} | {'put cpu':>11} {'get cpu':>11} | "
          f"{'put':>6} {'get':>6}")
    for size, clients in results["median"].items():
        for client, ops in clients.items():
            p, g = ops["put"], ops["get"]
            print(f"{size + ' MiB':>6} {client:<17} {p['gbps']:>6.2f} {g['gbps']:>6.2f} | "
                  f"{p['client_cpu_s_per_gb']:>5.2f}+{p['server_cpu_s_per_gb']:<5.2f} "
                  f"{g['client_cpu_s_per_gb']:>5.2f}+{g['server_cpu_s_per_gb']:<5.2f} | "
                  f"{p['cpu_bound_gbps']:>6.2f} {g['cpu_bound_gbps']:>6.2f}")


def _plot(results: dict[str, Any], path: Path) -> None:
    from kvtier.bench.output import figure

    sizes = list(results["median"])
    clients = list(results["median"][sizes[0]])
    width = 0.8 / len(clients)
    centres = [i + 0.4 - width / 2 for i in range(len(sizes))]
    with figure(path, 2, 2, figsize=(11, 7), sharey=True) as (_, axes):
        for row, (field, label) in enumerate((("gbps", "measured"), ("cpu_bound_gbps", "CPU-bound, a core each"))):
            for ax, op in zip(axes[row], ("put", "get"), strict=True):
                for j, client in enumerate(clients):
                    vals = [results["median"][s][client][op][field] for s in sizes]
                    ax.bar([i + j * width for i in range(len(sizes))], vals, width, label=client)
                ax.set_xticks(centres, [f"{s} MiB" for s in sizes])
                ax.set_title(f"{op}, {label} (median of {results['meta']['reps']})")
                ax.set_ylabel("GB/s")
        axes[0][0].legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0; 1 when the run failed (the server did not start, a client lost records); 2 for a bad option
    or a missing dependency; 130 on Ctrl-C. Every error is one line."""
    parser = KvtierParser(prog="benchmarks/redis_bandwidth.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    need = missing(("redis-server", "redis-benchmark"), "the benchmark starts its own server on a free port",
                   args.out)
    args.peers = False
    if need is None:
        args.peers, need = lmcache_peer.wanted(args.lmcache, "redis_bandwidth")
    return run_checked("redis_bandwidth", need, lambda: _run_and_name(args))


def _run_and_name(args: argparse.Namespace) -> int:
    asyncio.run(run(args))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

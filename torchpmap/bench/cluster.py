"""A simulated cluster: the data-parallel step across 2 or 3 "hosts" joined by a slow link.

Each host is a Linux network namespace with one veth interface; the other ends sit on a
bridge in the root namespace, so every host reaches every other through its own
interface. Each interface's egress is rate-limited with ``tc qdisc ... tbf``, as a NIC
caps what a host sends. One process runs in each namespace, with gloo bound to that
interface (``GLOO_SOCKET_IFNAME``) and the rendezvous store at host 0's address. The
processes then run :func:`torchpmap.bench.ddp.run_ddp_comparison`'s columns interleaved:

* ``compute``: the step on the host's shard with no exchange (the network's floor);
* ``allreduce``: one all-reduce of the gradients' size alone (the exchange's cost when
  nothing hides it), and ``pmean``: torchpmap's pmean of the same, alone;
* ``ddp``: ``DistributedDataParallel``, which all-reduces gradient buckets while the
  backward still runs;
* ``torchpmap`` and ``torchpmap.jit``: ``torchpmap.training.data_parallel_step``, eager
  (its all-reduce started bucket by bucket during the backward, as DDP's) and compiled;
* ``torchpmap.by_hand``: the step written as ``pmap`` with ``pmean(grad(...))``, whose
  exchange starts after the backward (against ``torchpmap``: what the overlap gains);
* ``torchpmap.fsdp``: ``data_parallel_step(..., shard_params=True)`` (ZeRO-3: each host
  holds half of the parameters, gradients and optimizer state; each linear layer
  gathers its weights as it runs and again for its backward, not prefetched, the
  gradients reduce-scattered layer by layer), and ``fsdp2``: PyTorch's
  ``fully_shard`` on each linear layer and the model (gathered layer by layer, prefetched).

Then a tensor-parallel MLP step (:mod:`torchpmap.bench.tensor_parallel`), its hidden layer
split over the hosts: ``torchpmap.tp`` (shard_map on a torch ``DeviceMesh``, the gradient
taken inside), ``dtensor.tp`` (``parallelize_module`` with ``ColwiseParallel`` and
``RowwiseParallel``) and ``single`` (the whole model on each host, no exchange).

It needs root and iproute2 (``ip``, ``tc``); without them it says why and does nothing.
Everything it creates is named ``tp<pid>...`` and removed on exit, also after an error.
The hosts share this machine's cores, so with 3 hosts on 2 cores the compute of one
host slows the others: read the ratios, and the ``compute`` column, with that in mind.

Run it: ``make bench-cluster`` or ``python -m torchpmap.bench.cluster --hosts 2 3
--rates 1gbit 300mbit``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
from collections.abc import Sequence
from typing import Any

import torch

from torchpmap.bench.ddp import COLUMNS, run_ddp_comparison
from torchpmap.bench.launch import Host
from torchpmap.bench.tensor_parallel import run_tp_comparison

#: The model of the issue that asked for this: compute and exchange of the same order at 1 Gbit/s.
SIZES = (1024, 1024, 10)
BATCH_PER_HOST = 256


def why_unavailable() -> str | None:
    """None when this machine can build a simulated cluster, else the reason."""
    if os.name != "posix" or platform.system() != "Linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces, veth pairs and tc rate limits); run it as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found)"
    probe = f"tp{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclasses.dataclass
class SimulatedCluster:
    """``hosts`` network namespaces on one bridge, each sending at most ``rate`` (tc's
    syntax: ``1gbit``, ``300mbit``). A context manager: built on entry, removed on exit."""

    hosts: int
    rate: str
    prefix: str = dataclasses.field(default_factory=lambda: f"tp{os.getpid() % 100000}")

    def namespace(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def interface(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def address(self, i: int) -> str:
        return f"10.231.0.{i + 1}"

    def host(self, rank: int) -> Host:
        """Where rank ``rank`` runs: in its namespace, gloo on its interface, one process per host."""
        return Host(
            command=("ip", "netns", "exec", self.namespace(rank)),
            env={
                "GLOO_SOCKET_IFNAME": self.interface(rank),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "GROUP_RANK": str(rank),
            },
        )

    def __enter__(self) -> SimulatedCluster:
        try:
            self._build()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    def _build(self) -> None:
        bridge = f"{self.prefix}br"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i in range(self.hosts):
            ns, inside, outside = self.namespace(i), self.interface(i), f"{self.prefix}p{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inside, "root", "tbf",
                  "rate", self.rate, "burst", _burst(self.rate), "latency", "100ms"])

    def _remove(self) -> None:
        for i in range(self.hosts):  # deleting a namespace deletes its veth pair
            subprocess.run(["ip", "netns", "del", self.namespace(i)], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.prefix}br"], capture_output=True)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: Sequence[str]) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"simulated cluster: `{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _burst(rate: str) -> str:
    """tbf's bucket: 4 ms at the rate, at least 256 KiB (a veth passes 64 KiB GSO packets,
    which a smaller bucket would drop)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    value = rate.lower()
    for suffix, scale in units.items():
        if value.endswith(suffix):
            bits = float(value[: -len(suffix)]) * scale
            return f"{max(256 * 1024, int(bits / 8 * 0.004))}b"
    raise ValueError(f"simulated cluster: a rate like '1gbit' or '300mbit', got {rate!r}")


def measure(hosts: int, rate: str, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    """One cell of the table: every column of ``COLUMNS`` on ``hosts`` hosts at ``rate``."""
    with SimulatedCluster(hosts, rate) as cluster:
        result = run_ddp_comparison(
            hosts, steps, warmup=warmup, batch_per_process=BATCH_PER_HOST, timeout=timeout,
            columns=COLUMNS, sizes=SIZES, hosts=cluster.host, master_addr=cluster.address(0),
        )
    columns = result["columns"]
    compute, exchange = columns["compute"]["ms"], columns["allreduce"]["ms"]
    sharded, fsdp2 = columns["torchpmap.fsdp"]["all_ms"], columns["fsdp2"]["all_ms"]
    result.update(
        hosts=hosts,
        rate=rate,
        exchange_share=exchange / (compute + exchange),
        sharded_to_fsdp2=statistics.median(a / b for a, b in zip(sharded, fsdp2)),
    )
    return result


def measure_tp(hosts: int, rate: str, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    """One row of the tensor-parallel table: its columns on ``hosts`` hosts at ``rate``."""
    with SimulatedCluster(hosts, rate) as cluster:
        result = run_tp_comparison(
            hosts, steps, warmup=warmup, timeout=timeout, hosts=cluster.host, master_addr=cluster.address(0)
        )
    result.update(hosts=hosts, rate=rate)
    return result


def tp_table(results: Sequence[dict[str, Any]]) -> str:
    """The tensor-parallel results as a Markdown table."""
    lines = [
        "| hosts | link | torchpmap shard_map TP | DTensor TP | one host, whole model | shard_map / DTensor "
        "| one host / DTensor | largest parameter difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["columns"]
        lines.append(
            f"| {r['hosts']} | {r['rate']} | {c['torchpmap.tp']['ms']:.1f} ms | {c['dtensor.tp']['ms']:.1f} ms | "
            f"{c['single']['ms']:.1f} ms | {c['torchpmap.tp']['ratio_to_dtensor']:.2f} | "
            f"{c['single']['ratio_to_dtensor']:.2f} | {r['max_param_diff']:.1e} |"
        )
    return "\n".join(lines)


def table(results: Sequence[dict[str, Any]]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| hosts | link | compute alone | all-reduce alone | pmean alone | exchange share | DDP | torchpmap eager "
        "| jit=True | by hand | eager / DDP | jit / DDP | by hand / DDP | sharded (FSDP) | FSDP2 | sharded / DDP "
        "| sharded / FSDP2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["columns"]
        ms = lambda name: f"{c[name]['ms']:.1f} ms"  # noqa: E731, B023 - used in this iteration only
        lines.append(
            f"| {r['hosts']} | {r['rate']} | {ms('compute')} | {ms('allreduce')} | {ms('pmean')} | "
            f"{r['exchange_share']:.0%} | "
            f"{ms('ddp')} | {ms('torchpmap')} | {ms('torchpmap.jit')} | {ms('torchpmap.by_hand')} | "
            f"{c['torchpmap']['ratio_to_ddp']:.2f} | {c['torchpmap.jit']['ratio_to_ddp']:.2f} | "
            f"{c['torchpmap.by_hand']['ratio_to_ddp']:.2f} | {ms('torchpmap.fsdp')} | {ms('fsdp2')} | "
            f"{c['torchpmap.fsdp']['ratio_to_ddp']:.2f} | {r['sharded_to_fsdp2']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the data-parallel step on a simulated cluster (network namespaces)")
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "300mbit"])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default="bench-results/cluster.json")
    parser.add_argument("--no-tp", action="store_true", help="leave out the tensor-parallel rows")
    parser.add_argument("--no-dp", action="store_true", help="leave out the data-parallel rows")
    args = parser.parse_args(argv)
    reason = why_unavailable()
    if reason is not None:
        print(f"bench-cluster skipped: {reason}")
        return 0
    results: list[dict[str, Any]] = []
    tp_results: list[dict[str, Any]] = []
    for hosts in args.hosts:
        for rate in args.rates:
            if not args.no_dp:
                print(f"[cluster] data parallel, {hosts} hosts at {rate} ...", flush=True)
                results.append(measure(hosts, rate, args.steps, args.warmup, args.timeout))
                print(table(results[-1:]).splitlines()[-1], flush=True)
            if not args.no_tp:
                print(f"[cluster] tensor parallel, {hosts} hosts at {rate} ...", flush=True)
                tp_results.append(measure_tp(hosts, rate, args.steps, args.warmup, args.timeout))
                print(tp_table(tp_results[-1:]).splitlines()[-1], flush=True)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "model": results[0]["model"] if results else None,
        "tp_model": tp_results[0]["model"] if tp_results else None,
        "batch_per_host": BATCH_PER_HOST,
        "steps": args.steps,
    }
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results, "tensor_parallel": tp_results}, f, indent=1)
    if results:
        print()
        print(table(results))
        print(f"\n{meta['model']}, {BATCH_PER_HOST} samples per host; medians of {args.steps} steps")
    if tp_results:
        print()
        print(tp_table(tp_results))
        print(f"\n{meta['tp_model']}, the same {tp_results[0]['batch']} samples on every host; medians of "
              f"{args.steps} steps")
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

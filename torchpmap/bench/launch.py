"""Starts a few local processes the way ``torchrun`` would, without its agent.

For tests and benchmarks on one machine: every process gets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``, so that :func:`torchpmap.distributed.initialize` joins them. Unlike
torchrun, nothing kills the others when one fails, which is what the fault tests need
(torchrun's agent would stop the survivors before they report). A :class:`Host` per rank
places each process elsewhere (the simulated cluster of ``torchpmap.bench.cluster`` runs
each in its own network namespace).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence


@dataclasses.dataclass
class Finished:
    """One process' end: its exit code (None if it was killed at the deadline) and output."""

    rank: int
    returncode: int | None
    output: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class Host:
    """Where one rank runs: a command its Python is started under (e.g. ``ip netns exec
    NAME``) and environment variables for it (they override the launcher's)."""

    command: Sequence[str] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    argv: Sequence[str],
    nproc: int,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    master_port: int | None = None,
    master_addr: str = "127.0.0.1",
    hosts: Callable[[int], Host] | None = None,
) -> list[Finished]:
    """Runs ``python *argv`` in ``nproc`` processes and waits for all of them.

    Processes still running after ``timeout`` seconds are killed (only those started
    here); their ``returncode`` is None. Output (stdout and stderr) is collected per
    process. ``master_port`` (default: a free port) is where they meet: give the port of
    a store that is already up, with ``TORCHELASTIC_USE_AGENT_STORE=True`` in ``env``, to
    run them as workers of torchrun's agent store would. ``hosts(rank)`` says where each
    rank runs (default: here), and ``master_addr`` where rank 0's store listens.
    """
    port = str(master_port if master_port is not None else free_port())
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does with several processes per node
    base.update(env or {})
    started = time.monotonic()
    procs, logs = [], []
    try:
        for rank in range(nproc):
            log = tempfile.TemporaryFile(mode="w+")
            child_env = dict(
                base,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0",
                MASTER_ADDR=master_addr,
                MASTER_PORT=port,
            )
            host = hosts(rank) if hosts is not None else Host()
            child_env.update(host.env)
            command = [*host.command, sys.executable, *argv]
            procs.append(subprocess.Popen(command, env=child_env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
        ended: dict[int, float] = {}
        deadline = started + timeout
        while len(ended) < nproc and time.monotonic() < deadline:
            for rank, p in enumerate(procs):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = time.monotonic() - started
            time.sleep(0.05)
        results = []
        for rank, (p, log) in enumerate(zip(procs, logs)):
            if rank not in ended:
                p.kill()
                p.wait()
            log.seek(0)
            results.append(
                Finished(rank, p.returncode if rank in ended else None, log.read(), ended.get(rank, timeout))
            )
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()

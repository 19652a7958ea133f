"""What reaches the rendezvous store, and what torchpmap keeps from it (docs/multiprocess.md,
"Who can reach the store").

* Job tokens: every process group keeps its records under ``torchpmap/<token>/``, a token
  rank 0 draws anew for each group, so that records an earlier job left in a store that
  outlived it, or records written under a prefix anyone can guess, fail nothing.
* Binding: rank 0's server listens on the address ``MASTER_ADDR`` names, not on every
  interface, where it can.
"""
from __future__ import annotations

import datetime
import errno
import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from torchpmap._state import process_group as pg
from torchpmap._state import store as _store
from torchpmap.bench.launch import Finished, free_port, launch

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

PROGRAMS = Path(__file__).parent / "_store_programs.py"


def _run(scenario: str, tmp_path: Path, **options: Any) -> tuple[list[Finished], dict[int, dict]]:
    out = tmp_path / scenario
    out.mkdir()
    finished = launch([str(PROGRAMS), scenario, str(out)], 2, timeout=120, **options)
    results = {f.rank: json.loads((out / f"rank{f.rank}.json").read_text()) for f in finished
               if (out / f"rank{f.rank}.json").exists()}
    return finished, results


def _logs(finished: list[Finished]) -> str:
    return "\n".join(f"--- rank {f.rank} (rc={f.returncode})\n{f.output[-3000:]}" for f in finished)


# --------------------------------------------------------------------------- job tokens


@pytest.mark.slow
def test_each_initialize_draws_a_new_token_that_every_rank_shares(tmp_path):
    finished, results = _run("tokens", tmp_path)
    assert [f.returncode for f in finished] == [0, 0], _logs(finished)
    first, second = results[0]["tokens"]
    assert results[1]["tokens"] == [first, second]  # the ranks agree, group by group
    assert first != second  # initialize after shutdown: a token of its own
    assert all(len(t) == 16 and int(t, 16) >= 0 for t in (first, second))
    assert results[0]["psum"] == results[1]["psum"] == 2.0  # and the second group works


@pytest.mark.slow
def test_records_left_in_the_store_by_an_earlier_job_do_not_fail_the_next(tmp_path):
    # A store that outlives the jobs using it, as torchrun's agent store does: the
    # processes are its clients (TORCHELASTIC_USE_AGENT_STORE=True).
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    agent = {"env": {"TORCHELASTIC_USE_AGENT_STORE": "True"}, "master_port": port}

    finished, results = _run("fail", tmp_path, **agent)
    assert "rank_failed" in results[0] and "raised" in results[1], _logs(finished)
    assert any(key.startswith("torchpmap/") and key.endswith("/failure/1") for key in store.list_keys())

    # torch's own keys of the first group (gloo's addresses) would mislead the second
    # group's torch itself, so a store is only ever reused under a fresh prefix for them;
    # torchpmap's records stay, and so do records anyone could have written where a
    # prefix is easy to guess (the restart count and generation torchpmap used to key by).
    for key in store.list_keys():
        if not key.startswith("torchpmap/"):
            store.delete_key(key)
    forged = json.dumps({"ranks": [0], "reason": "forged", "reporter": 0, "kind": "failure"})
    for prefix in ("torchpmap/0/1/", "torchpmap/0/1//", "torchpmap/", "torchpmap//", ""):
        store.set(f"{prefix}failure/0", forged)
        store.add(f"{prefix}failures", 1)

    finished, results = _run("ok", tmp_path, **agent)
    assert [f.returncode for f in finished] == [0, 0], _logs(finished)
    assert results == {0: {"psum": 2.0}, 1: {"psum": 2.0}}


def test_a_group_torchpmap_did_not_initialize_agrees_on_its_token_through_the_store():
    store = dist.HashStore()
    first = pg._store_token(store, generation=1)
    assert pg._store_token(store, generation=1) == first  # what every other rank reads
    assert pg._store_token(store, generation=2) != first  # the next group draws its own
    assert len(first) == 16


def test_agree_on_token_draws_a_new_token_each_time():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tokens = {pg.agree_on_token("gloo") for _ in range(3)}
    finally:
        dist.destroy_process_group()
    assert len(tokens) == 3 and all(len(t) == 16 for t in tokens)


# --------------------------------------------------------------------------- binding


def _listening_addresses(port: int) -> set[str]:
    """The local addresses on which something listens on TCP ``port`` (Linux' /proc/net)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add("*" if int(address, 16) == 0 else address if len(address) == width else "?")
    return found


@pytest.fixture
def fresh_store(monkeypatch):
    """Runs :func:`torchpmap._state.store.rendezvous` as rank 0 of a one-process job on a free port."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads the listening sockets from Linux' /proc/net/tcp")
    monkeypatch.setattr(_store, "_kept", None)
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv(_store.LISTEN_ALL_VARIABLE, raising=False)
    yield port
    _store._kept = None  # closes the server


def test_rank_0_serves_the_store_on_master_addr_only(fresh_store):
    store, use = _store.rendezvous(0, 1, datetime.timedelta(seconds=10))
    assert _listening_addresses(fresh_store) == {"0100007F"}  # 127.0.0.1, not every interface
    assert _store.listening() == f"127.0.0.1:{fresh_store} only"
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert _store.rendezvous(0, 1, datetime.timedelta(seconds=10)) == (store, use + 1)  # kept for the next group


def test_listen_all_keeps_torchs_every_interface_server(fresh_store, monkeypatch):
    monkeypatch.setenv(_store.LISTEN_ALL_VARIABLE, "1")
    _store.rendezvous(0, 1, datetime.timedelta(seconds=10))
    assert _listening_addresses(fresh_store) == {"*"}


def test_listen_socket_binds_where_master_addr_points():
    sock = _store.listen_socket("127.0.0.1", 0, single_node=False)  # every rank must be here
    assert sock is not None
    with sock:
        assert sock.getsockname()[0] == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "198.51.100.7"])
def test_listen_socket_falls_back_to_every_interface(host):
    # every interface asked for; an address of another host (a service address, a NAT)
    assert _store.listen_socket(host, 0, single_node=False) is None


def test_a_name_that_does_not_resolve_here_falls_back_to_every_interface(monkeypatch):
    def resolve(host: str, port: int, **kwargs: Any) -> list:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(_store.socket, "getaddrinfo", resolve)
    assert _store.listen_socket("node0", 0, single_node=False) is None


def test_a_host_name_that_means_loopback_only_here_is_not_bound_in_a_multi_node_run(monkeypatch):
    # Debian maps the machine's own name to 127.0.1.1; the other nodes resolve it to a real address
    def resolve(host: str, port: int, **kwargs: Any) -> list:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", port))]

    monkeypatch.setattr(_store.socket, "getaddrinfo", resolve)
    assert _store.listen_socket("node0", 0, single_node=False) is None
    if sys.platform.startswith("linux"):  # all of 127/8 is this host's on Linux
        sock = _store.listen_socket("node0", 0, single_node=True)
        assert sock is not None
        sock.close()


def test_a_port_in_use_is_an_error_that_says_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="port is in use") as info:
            _store.listen_socket("127.0.0.1", taken.getsockname()[1], single_node=True)
    assert info.value.__cause__.errno == errno.EADDRINUSE

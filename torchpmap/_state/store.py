"""The rendezvous store that :func:`torchpmap.distributed.initialize` creates.

torch.distributed's processes meet in a key-value store (a ``TCPStore``) that rank 0
serves on ``MASTER_ADDR:MASTER_PORT`` and the other ranks reach over TCP. The store has
no authentication: anyone who can open a connection to its port can read, write and
delete every key (``list_keys`` lists them). This module creates that store the way
``dist.rendezvous("env://")`` does, with two differences:

* **Where rank 0's server listens.** torch's server binds the port on every interface
  (``*:PORT``), whatever ``MASTER_ADDR`` says. ``TCPStore`` also accepts a socket already
  bound (its public ``master_listen_fd`` argument), so rank 0 binds the port on the
  address ``MASTER_ADDR`` names and hands the socket over: with ``MASTER_ADDR=127.0.0.1``
  other hosts cannot connect at all. When that address is not one of this host's (a
  Kubernetes service address, a NAT), or when it cannot be sure every rank will reach it
  there (a host name that resolves to loopback here, in a run over several nodes), it
  falls back to torch's every-interface server and says so in the log.
  ``TORCHPMAP_STORE_LISTEN_ALL=1`` asks for torch's behaviour outright. Under torchrun the
  store belongs to torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE=True``): every rank is
  a client and the agent decides where it listens (on every interface).
* **One store per process.** A second ``initialize()`` after ``shutdown()`` reuses the
  store of the first (the same server in rank 0, the same connections elsewhere), and the
  new process group keeps its keys under a prefix of its own (:func:`group_prefix`).
  Creating a fresh server instead races the other ranks, which may connect to the old one
  just before it closes, and reusing it without a prefix makes the new group read the old
  group's keys (both hang).

Example (what rank 0 would do for ``MASTER_ADDR=127.0.0.1``; a free port, one process)::

    >>> from torchpmap._state import store as _store
    >>> sock = _store.listen_socket("127.0.0.1", 0, single_node=True)
    >>> sock.getsockname()[0]
    '127.0.0.1'
    >>> sock.close()
    >>> _store.group_prefix(1), _store.group_prefix(2)
    ('default_pg', 'default_pg/torchpmap-2')
"""
from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import os
import socket
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from torchpmap._state.config import _boolean, env_value
from torchpmap._state.log import logger

#: Seconds between the first two tries of a rank waiting for rank 0's server to listen
#: (doubling up to :data:`_MAX_PAUSE`).
_FIRST_PAUSE, _MAX_PAUSE = 0.001, 0.05
#: Environment variable: 1 keeps torch's every-interface server (see the module docstring).
LISTEN_ALL_VARIABLE = "TORCHPMAP_STORE_LISTEN_ALL"


@dataclasses.dataclass
class _Kept:
    """The store of this process, with what it was made for and how often it was used."""

    store: Any
    key: tuple[str, int, int, int, bool]  # (host, port, rank, world size, agent store)
    uses: int
    listening: str


_kept: _Kept | None = None
_lock = threading.Lock()


def group_prefix(use: int) -> str:
    """The prefix of the ``use``-th process group made on this process' store.

    The first is torch's own (``default_pg``, what ``init_process_group`` uses for the
    store it makes); later ones add the count, so that no key of an earlier group (a
    finished group's addresses, its barrier counters) is read by the new one. Every
    process calls ``initialize``/``shutdown`` in step, so the counts agree.
    """
    return "default_pg" if use == 1 else f"default_pg/torchpmap-{use}"


def rendezvous(rank: int, world_size: int, timeout: datetime.timedelta) -> tuple[Any, int]:
    """The store for a process group of ``world_size`` ranks, and how many groups (this
    one included) this process has made on it.

    Reads ``MASTER_ADDR`` and ``MASTER_PORT``. Rank 0 serves the store (unless torchrun's
    agent does); the others connect to it, waiting up to ``timeout``.
    """
    global _kept
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    listen_all = env_value(LISTEN_ALL_VARIABLE, _boolean, "one of 1/0, true/false, yes/no, on/off", False)
    key = (host, port, rank, world_size, agent)
    with _lock:
        if _kept is None or _kept.key != key or not _answers(_kept.store):
            _kept = None  # drops the old store (and closes its server) before a new one binds the port
            store, listening = _create(host, port, rank, world_size, timeout, agent=agent, listen_all=listen_all)
            _kept = _Kept(store, key, 0, listening)
            logger.info("rendezvous store %s:%d: %s", host, port, listening)
        _kept.uses += 1
        _kept.store.set_timeout(timeout)
        return _kept.store, _kept.uses


def listening() -> str:
    """Where this process' store listens (``"127.0.0.1:29500 only"``, ``"every interface"``,
    ``"not here: ..."``); empty before :func:`rendezvous`."""
    return _kept.listening if _kept is not None else ""


def _answers(store: Any) -> bool:
    """Whether ``store`` still reaches its server (a rank 0 that exited takes it along)."""
    try:
        store.check(["torchpmap/ping"])
    except RuntimeError:  # torch's DistNetworkError and DistStoreError
        return False
    return True


def _create(
    host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta, *, agent: bool, listen_all: bool
) -> tuple[Any, str]:
    """A new ``TCPStore`` as ``dist.rendezvous("env://")`` makes it, and where it listens."""
    if not 0 <= port < 2**16:
        raise ValueError(f"initialize: MASTER_PORT must be a port number 0..65535, got {port}")
    common: dict[str, Any] = {"host_name": host, "port": port, "world_size": world_size, "timeout": timeout}
    if agent:  # torchrun's agent serves the store: every rank is a client
        return dist.TCPStore(is_master=False, **common), "not here: torchrun's agent serves it (on every interface)"
    use_libuv = os.environ.get("USE_LIBUV", "0" if sys.platform == "win32" else "1") == "1"
    common.update(multi_tenant=True, use_libuv=use_libuv)  # as torch's env:// rendezvous
    if rank != 0:
        common["timeout"] = _await_server(host, port, timeout)  # what is left of it to connect
        return dist.TCPStore(is_master=False, **common), "not here: rank 0 serves it"
    sock = None if listen_all else listen_socket(host, port, single_node=_single_node(world_size))
    if sock is None:
        return dist.TCPStore(is_master=True, **common), "every interface (torch's default)"
    where = sock.getsockname()[0]
    try:
        store = dist.TCPStore(is_master=True, master_listen_fd=sock.fileno(), **common)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the socket now and closes it when it goes
    return store, f"{where}:{port} only"


def _await_server(host: str, port: int, timeout: datetime.timedelta) -> datetime.timedelta:
    """Returns once rank 0's server accepts connections (or on any error but a refusal,
    or after ``timeout``: the store's own connection then reports it), with what is left
    of ``timeout`` (at least a second).

    Ranks start together and rank 0 does a little more before it listens (it binds the
    socket itself); a store client refused once backs off for 0.3 to 0.7 s before it
    tries again, which would double the start-up of a small job. Polling every few
    milliseconds at first costs one extra, empty connection per rank.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    pause = _FIRST_PAUSE
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic())).close()
            break
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE)
        except OSError:
            break
    return datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))


def _single_node(world_size: int) -> bool:
    """Whether every rank runs on this host, as torchrun's ``LOCAL_WORLD_SIZE`` says."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return local.isdigit() and int(local) >= world_size


def listen_socket(host: str, port: int, *, single_node: bool) -> socket.socket | None:
    """A socket listening on ``port`` of the address ``host`` names, for rank 0's server;
    None when the server should listen on every interface instead (torch's default).

    None when ``host`` does not resolve, names every interface (``0.0.0.0``, ``::``), is
    not an address of this host, or resolves to a loopback address here although it is
    neither a loopback address itself nor ``localhost`` while ranks may run on other
    hosts (Debian maps the machine's own name to ``127.0.1.1``: binding there would shut
    the other nodes out). Raises ``RuntimeError`` when the port is taken.
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError, IndexError):
        logger.warning("rendezvous store: %s does not resolve here; listening on every interface", host)
        return None
    ip = ipaddress.ip_address(str(address[0]).split("%")[0])
    if ip.is_unspecified:
        return None
    if ip.is_loopback and not single_node and not _names_loopback(host):
        logger.warning(
            "rendezvous store: MASTER_ADDR=%s is this host's loopback address %s here, but other hosts may take part; "
            "listening on every interface", host, ip,
        )
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as torch's server: a restart may reuse the port at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()  # the store's server listens again, with its own backlog
        return sock
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise RuntimeError(
                f"initialize: rank 0 cannot serve the rendezvous store on {host}:{port}: the port is in use "
                "(another job, or an earlier run that has not exited yet). Pick another MASTER_PORT."
            ) from error
        logger.warning(
            "rendezvous store: cannot listen on %s (%s) only (%s); listening on every interface. Set %s=1 to "
            "silence this, and keep the port out of reach of other hosts (see docs/multiprocess.md)",
            host, ip, error.strerror or error, LISTEN_ALL_VARIABLE,
        )
        return None


def _names_loopback(host: str) -> bool:
    """Whether ``host`` itself says loopback (``127.0.0.1``, ``::1``, ``localhost``), so that
    every rank connecting to it must run on this host."""
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False

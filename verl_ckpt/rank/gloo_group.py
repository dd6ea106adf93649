"""A private gloo group over some ranks of the world, for step 1's agreement (rank/agreement.py).

Every `CheckpointManager` of a save group of two or more ranks agrees on each save over a
gloo group of its own. Made with `torch.distributed.new_group`, each such group brought its
own gloo device: a socket event-loop thread that wakes every few milliseconds, plus two
worker threads, kept for the life of the process (torch cannot destroy and remake a group
of the same ranks safely: the name it derives would be reused with the old group's closed
addresses in the store). Measured: 40 groups in each of two processes, 7.1% of a core idle
and 126 threads; made here, 0.9% and 46 threads (0.65% with none).

Here every group of the process shares the same gloo device (one event loop for all
their sockets) and has one worker thread, which sleeps until the agreement issues a collective.
Each group's rendezvous keys in the world's store are made unique by a counter that each
rank keeps in that store, per member set: every member opens its managers in the same
order (the agreement's own premise), so the n-th group a rank opens over the same members
is the n-th of every other member, and a world made again (a new store) counts from one.

The group is a gloo backend object, not registered with torch.distributed: its collectives
are called on it directly (`allgather`, `monitored_barrier`), and nothing else (the trainer,
megatron-core, torch's `destroy_process_group`) ever sees or uses it.

Only torch's private pieces here: `_get_default_store` and the gloo backend's options.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import socket
import threading
from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo
from torch.distributed.distributed_c10d import _get_default_store

from verl_ckpt.protocol.errors import CheckpointError

__all__ = ["StoreUnreachable", "listen_address", "open_private_group", "reserve_group_key"]

_KEY_PREFIX = "verl_ckpt/agreement"

_device_lock = threading.Lock()
_shared_devices: list[Any] | None = None


class StoreUnreachable(RuntimeError):
    """The world's store (torch.distributed's default store) did not answer; the message is
    one line naming it."""


def reserve_group_key(members: tuple[int, ...]) -> str:
    """The store prefix of this rank's next private group over `members` (global ranks).

    Called in the order the managers are opened (not on their threads, which may run in
    another order): the n-th call of every member for the same members gives the same key.
    Raises StoreUnreachable when the store does not answer (its host process is gone, or
    the store's own timeout passed).
    """
    # Hashed, as torch names its groups: a save group of thousands of ranks keeps short keys.
    members_id = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:16]
    store = _get_default_store()
    try:
        count = store.add(f"{_KEY_PREFIX}/{members_id}/opened_by/{dist.get_rank()}", 1)
    except RuntimeError as exc:  # torch's DistError family (some messages run on for lines)
        lines = str(exc).strip().splitlines()
        raise StoreUnreachable(
            f"torch.distributed's store at {_address(store)} did not answer: "
            f"{type(exc).__name__}: {lines[0] if lines else ''}"
        ) from None
    return f"{_KEY_PREFIX}/{members_id}/{count}"


def _address(store: Any) -> str:
    """host:port of a TCP store (under any prefix stores), else the store's kind."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None else type(store).__name__


def open_private_group(members: tuple[int, ...], key: str, timeout_s: float) -> Any:
    """Connect this rank to the other `members` under the store prefix `key` (from
    reserve_group_key); waits up to `timeout_s` for them all (RuntimeError past it)."""
    options = ProcessGroupGloo._Options()
    options._devices = _devices()
    # The agreement issues one collective at a time, from one thread.
    options._threads = 1
    options._timeout = timedelta(seconds=timeout_s)
    store = PrefixStore(key, _get_default_store())
    return ProcessGroupGloo(store, members.index(dist.get_rank()), len(members), options)


def _devices() -> list[Any]:
    """The process's gloo devices for private groups, made at first use, kept for the life
    of the process (each one's thread is the event loop of every private group's sockets).
    One per interface GLOO_SOCKET_IFNAME lists, as torch makes them; else one listening on
    `listen_address()`, never on the address the host name resolves to (torch's default),
    which may be a public interface, or none that the peers can reach."""
    global _shared_devices
    with _device_lock:
        if _shared_devices is None:
            interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
            if len(interfaces) > 1:  # torch's own test of the variable
                _shared_devices = [
                    ProcessGroupGloo.create_device(interface=name) for name in interfaces.split(",")
                ]
            else:
                _shared_devices = [ProcessGroupGloo.create_device(hostname=listen_address())]
        return _shared_devices


def listen_address() -> str:
    """Where this process's private groups listen: 127.0.0.1 when every rank of the world is
    on this node (the world's store is on loopback, which no other node can reach, or
    torchrun says LOCAL_WORLD_SIZE == WORLD_SIZE); otherwise the trainer's interface: the
    address Ray gives this node, else the local address of the route to the world's store."""
    host = _store_host(_get_default_store())
    world = os.environ.get("WORLD_SIZE")
    if (host is not None and _is_loopback(host)) or (
        world is not None and os.environ.get("LOCAL_WORLD_SIZE") == world
    ):
        return "127.0.0.1"
    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    if host is not None:
        with contextlib.suppress(OSError):
            # A UDP "connect" sends nothing: it only picks the route, and with it our address.
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))
                return probe.getsockname()[0]
    raise CheckpointError(
        "cannot tell which interface the private gloo groups should listen on (no Ray, and "
        "torch.distributed's store is not a TCP store): set GLOO_SOCKET_IFNAME"
    )


def _store_host(store: Any) -> str | None:
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return getattr(store, "host", None)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

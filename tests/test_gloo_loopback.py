"""The private gloo groups of the agreement (verl_ckpt/rank/gloo_group.py) listen on loopback
when the whole world is on one node (issue 45, item 7): before, they listened on the address
the host name resolves to, which may be a public interface.

Two real processes form a gloo world over a TCP store on 127.0.0.1 (as the recipe's roles
do), open a private group and run a collective on it; each reports the listening sockets it
opened meanwhile, read from /proc/net/tcp{,6} for its own socket descriptors.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, free_port

CHILD = r"""
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist

def listening():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.add((table, fields[1]))
    return found

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
from verl_ckpt.rank.gloo_group import listen_address, open_private_group, reserve_group_key
before = listening()
group = open_private_group((0, 1), reserve_group_key((0, 1)), 60.0)
out = [torch.zeros(1), torch.zeros(1)]
group.allgather([out], [torch.ones(1) * rank]).wait()
opened = sorted(listening() - before)
print("RESULT " + json.dumps({"address": listen_address(), "opened": opened}), flush=True)
dist.barrier()
"""


def _ipv4(hex_address: str) -> str:
    """/proc/net/tcp's local address (little-endian hex) as dotted IPv4."""
    host = hex_address.split(":")[0]
    if len(host) == 32:  # tcp6: an IPv4-mapped address keeps IPv4 in its last 4 bytes
        if not host.startswith("0000000000000000FFFF0000"):
            return f"ipv6:{host}"
        host = host[24:]
    return ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0))


def _public_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # picks a route; sends nothing
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def _can_rename_host() -> bool:
    probe = ["unshare", "--uts", "hostname", "probe.invalid"]
    return shutil.which("unshare") is not None and subprocess.run(probe).returncode == 0


@pytest.mark.parametrize("hostname", ["as it is", "a public address"])
def test_private_groups_of_a_one_node_world_listen_on_loopback_only(hostname):
    """`a public address`: each rank runs in a UTS namespace of its own whose host name is
    this machine's non-loopback address, as on a node whose host name resolves to its public
    interface. Before, torch's default device listened there (this case failed); where the
    host name resolves to loopback, as on this machine, the first case passed already."""
    public = _public_address()
    if hostname != "as it is" and (public is None or not _can_rename_host()):
        pytest.skip("needs a non-loopback address and unshare --uts (root)")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    command = [sys.executable, "-c", CHILD]
    if hostname != "as it is":
        rename = f'hostname {public} && exec "$@"'
        command = ["unshare", "--uts", "sh", "-c", rename, "sh", *command]
    procs = [
        subprocess.Popen(
            [*command, str(rank), str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, err[-3000:]
        results.append(json.loads(lines[0].removeprefix("RESULT ")))
    for result in results:
        assert result["address"] == "127.0.0.1"
        assert result["opened"], "no listening socket seen: the test no longer sees gloo's"
        addresses = {_ipv4(address) for _, address in result["opened"]}
        assert addresses == {"127.0.0.1"}, result


def test_a_world_across_nodes_listens_on_the_address_ray_gives_the_node(monkeypatch):
    """Not on one node (the world's store is on another machine): the trainer's interface,
    as Ray knows it, not the address the host name resolves to."""
    import ray

    from verl_ckpt.rank import gloo_group

    class RemoteStore:
        host, port = "10.20.30.40", 29500

    monkeypatch.setattr(gloo_group, "_get_default_store", lambda: RemoteStore())
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.20.30.41")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert gloo_group.listen_address() == "10.20.30.41"
    # torchrun's word that every rank is local is enough.
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert gloo_group.listen_address() == "127.0.0.1"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.0.2"])
def test_a_world_whose_store_is_on_loopback_is_one_node(monkeypatch, host):
    from verl_ckpt.rank import gloo_group

    class LocalStore:
        port = 29500

    LocalStore.host = host
    monkeypatch.setattr(gloo_group, "_get_default_store", lambda: LocalStore())
    assert gloo_group.listen_address() == "127.0.0.1"

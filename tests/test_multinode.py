"""Many machines: ranks on two Ray nodes (two `ray start` nodes on loopback). Commits work
across nodes when the root is one shared filesystem; when a node sees another filesystem
at the same path (its own mount namespace with a tmpfs over the root: a real unshared
disk), start-up fails clearly, naming the node."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT, free_port
from tests.helpers import kill_all

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))


def start_node(args: list[str], root: Path | None, env: dict) -> None:
    command = [RAY, "start", *args]
    if root is not None:
        # This node gets a private mount namespace in which the root is an empty tmpfs.
        inner = f"mount -t tmpfs tmpfs {shlex.quote(str(root))} && exec {shlex.join(command)}"
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c", inner]
    subprocess.run(command, check=True, env=env, capture_output=True, timeout=120)


def stop_cluster(gcs_port: int) -> None:
    """Kill the processes of this cluster only: Ray's processes naming its GCS port."""
    kill_all(cluster_processes(gcs_port))


def cluster_processes(gcs_port: int) -> list[psutil.Process]:
    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "ray" in cmdline and (
            f":{gcs_port} " in f"{cmdline} " or f"--gcs_server_port={gcs_port}" in cmdline
        ):
            mine.append(proc)
    return mine


def test_stopping_a_cluster_skips_a_process_that_exited_since_it_was_listed():
    """Found by CI (stop 62): a Ray process of the cluster exited between the listing and
    its kill, and the fixture's teardown raised psutil.NoSuchProcess (its PID reused),
    erroring a test that had passed. A process of this test stands in for it."""
    port = free_port()
    script = "import sys, time; time.sleep(float(sys.argv[1]))"
    child = subprocess.Popen([sys.executable, "-c", script, "60", "ray", f"127.0.0.2:{port}"])
    listed = cluster_processes(port)
    assert [proc.pid for proc in listed] == [child.pid]
    child.kill()
    child.wait(timeout=30)  # exited and reaped: no such process any more
    kill_all(listed)


@pytest.fixture
def two_nodes(tmp_path, request):
    root = tmp_path / "ckpt"
    root.mkdir()
    port = free_port()
    # Two nodes on two loopback addresses. Multi-node Ray needs clusters enabled, and then
    # rewrites 127.0.0.1 (only that spelling) to the machine's reachable IP: 127.0.0.2 and
    # 127.0.0.3 are loopback too and are kept as they are.
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
    }
    # A temp dir of its own: `ray start` records "the current cluster" there, where a plain
    # ray.init() elsewhere on the machine would otherwise find and join it.
    temp_dir = tempfile.mkdtemp(prefix="vcray", dir="/tmp")
    head = [
        "--head",
        f"--port={port}",
        "--node-ip-address=127.0.0.2",
        "--include-dashboard=false",
        f"--temp-dir={temp_dir}",
    ]
    other = [f"--address=127.0.0.2:{port}", "--node-ip-address=127.0.0.3"]
    common = ["--num-cpus=1", "--disable-usage-stats"]
    try:
        start_node([*head, '--resources={"node_a": 1}', *common], None, env)
        unshared = root if request.param == "unshared" else None
        start_node([*other, '--resources={"node_b": 1}', *common], unshared, env)
        yield f"127.0.0.2:{port}", root, env
    finally:
        stop_cluster(port)
        shutil.rmtree(temp_dir, ignore_errors=True)


def run_job(address: str, root: Path, env: dict, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.multinode_job", address, str(root), *extra],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize("two_nodes", ["unshared"], indirect=True)
def test_root_not_shared_by_every_node_fails_clearly(two_nodes):
    address, root, env = two_nodes
    outcome = run_job(address, root, env)
    assert len(set(outcome["nodes"])) == 2, outcome
    # Only the rank on node_b (the node with its own disk at the root's path) fails.
    failed = outcome.get("open_errors", {})
    assert list(failed) == ["1"], outcome
    assert "actor rank 1 on node" in failed["1"], outcome
    assert "must be one filesystem shared by every node" in failed["1"], outcome
    assert not (root / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize("two_nodes", ["shared"], indirect=True)
def test_I1_commit_across_two_nodes_whose_ranks_upload_their_own_files(two_nodes, s3_server):
    """A step of ranks on two nodes commits (the tracker names it), and, with the remote tier
    on (a real S3 endpoint on loopback), each rank uploads its own files from its own node
    (the finalizer records who reported what from where): step 1 commits in the remote tier
    with every file verified. (One job for both: a two-node cluster takes half a minute.)"""
    from verl_ckpt.store.commit_record import find_commit_record
    from verl_ckpt.store.fsspec_store import FsspecStore
    from verl_ckpt.store.verification import check_step_files

    address, root, env = two_nodes
    remote = {
        "url": f"s3://{s3_server.new_bucket()}/run",
        "storage_options": s3_server.storage_options(),
    }
    started = time.monotonic()
    outcome = run_job(address, root, env, json.dumps(remote))
    assert len(set(outcome["nodes"])) == 2, outcome
    assert outcome.get("error") is None and outcome["tracker"] == 1, outcome
    assert time.monotonic() - started < 300
    uploads = outcome["remote"]
    assert uploads["status"] == "committed" and uploads["tracker"] == 1, uploads
    assert uploads["uploaders"] == {"actor rank 0": "127.0.0.2", "actor rank 1": "127.0.0.3"}
    store = FsspecStore(remote["url"], remote["storage_options"])
    record = find_commit_record(store, 1)
    assert check_step_files(store, 1, record.files, record.checksum_algorithm, 4, 60).errors == []

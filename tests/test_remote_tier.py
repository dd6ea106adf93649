"""The remote tier against a real S3 endpoint on loopback (moto's server, through s3fs), with
real Megatron ranks in Ray actors, the real finalizer and real files. Each test names the
invariant it checks for the remote tier (I1: the remote tracker names only a step whose
every file and commit record are there; I3: remote retention after a remote commit only).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray
import torch

from tests.conftest import ROLES
from tests.helpers import close_all, every_rank, open_all, save_everyone
from tests.test_faults import lone_rank  # noqa: F401 - a fixture
from tests.test_finalizer import DRIVER_ONLY, save_driver_step
from verl_ckpt import CheckpointCoordinator, CommitTimeoutError, read_tracker, step_dir
from verl_ckpt.commit.finalizer import CheckpointFinalizer
from verl_ckpt.protocol import RPC_SLACK_S
from verl_ckpt.protocol.faults import ENV_VAR, ONCE_ENV_VAR
from verl_ckpt.remote.finalizer_tier import RemoteTier
from verl_ckpt.store.commit_record import find_commit_record, read_commit_record
from verl_ckpt.store.fsspec_store import FsspecStore
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, list_step_dirs
from verl_ckpt.store.verification import check_step_files


def remote_config(tmp_path, server, bucket, **overrides):
    remote = {"url": f"s3://{bucket}/run", "storage_options": server.storage_options()}
    remote.update(overrides.pop("remote", {}))
    return {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 60.0, "remote": remote} | overrides


def store_of(cfg) -> FsspecStore:
    return FsspecStore(cfg["remote"]["url"], cfg["remote"]["storage_options"])


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s"
        time.sleep(0.05)


def test_I1_I3_ranks_upload_their_own_files_then_the_finalizer_commits_remotely(
    ranks, s3_server, tmp_path
):
    """Three committed steps go to the remote tier: every rank uploads its own files, the
    finalizer the rest, then the record, then the tracker; remote retention keeps 2
    (independent of max_ckpt_to_keep=1 locally); every remote object matches the record."""
    cfg = remote_config(tmp_path, s3_server, s3_server.new_bucket(), max_ckpt_to_keep=1)
    cfg["remote"]["keep"] = 2
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    for step in (1, 2, 3):
        save_everyone(ranks, coordinator, step)
        coordinator.wait_for_commit(step)
    ray.get([w.wait.remote() for w in every_rank(ranks)])
    summary = coordinator.wait_for_uploads()
    assert summary["step"] == 3 and summary["status"] == "committed", summary
    assert summary["tracker"] == 3
    uploaders = coordinator.remote_status(3)["uploaders"]
    assert sorted(uploaders) == ["actor rank 0", "actor rank 1", "critic rank 0"], uploaders
    store = store_of(cfg)
    assert read_tracker(store) == 3
    listing = store.listing()
    assert listing.committed() == [2, 3] and listing.uncommitted() == []
    local = read_commit_record(step_dir(cfg["root_dir"], 3))
    remote = find_commit_record(store, 3)
    assert remote.files == local.files and remote.participants == local.participants
    checked = check_step_files(store, 3, remote.files, remote.checksum_algorithm, 4, 60)
    assert checked.errors == [] and len(checked.done) == len(local.files)
    # Step 2 was protected from local retention while it was being uploaded; once its
    # upload ended, retention ran again.
    wait_for(lambda: sorted(list_step_dirs(cfg["root_dir"])) == [3], 30, "local step 2 not deleted")
    close_all(ranks, coordinator)


def test_remote_every_skips_steps_and_the_last_committed_step_is_uploaded_whole_at_the_end(
    ranks, s3_server, tmp_path
):
    """remote.every=2: step 1 is uploaded by the ranks, step 2 is skipped; at the end of the
    run wait_for_uploads() uploads step 2 whole (the finalizer alone), so that a finished run
    has its last committed step in the remote tier."""
    cfg = remote_config(tmp_path, s3_server, s3_server.new_bucket(), remote={"every": 2})
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    for step in (1, 2):
        save_everyone(ranks, coordinator, step)
        coordinator.wait_for_commit(step)
    ray.get([w.wait.remote() for w in every_rank(ranks)])
    store = store_of(cfg)
    wait_for(
        lambda: coordinator.remote_status(1)["status"] == "committed", 60, "step 1 not uploaded"
    )
    assert coordinator.remote_status(2)["status"] == "skipped"
    assert store.listing().committed() == [1]
    summary = coordinator.wait_for_uploads()
    assert summary["step"] == 2 and summary["status"] == "committed", summary
    assert summary["uploaders"] == {} and read_tracker(store) == 2
    assert store.listing().committed() == [1, 2]
    close_all(ranks, coordinator)


# ---- the verl-ckpt tool on a remote tier URL ---------------------------------------------


@pytest.fixture(scope="module")
def uploaded(ranks, s3_server, tmp_path_factory):
    """Steps 1 and 2 committed locally and in the remote tier (tests must not change it:
    those that damage it use `copied`)."""
    tmp_path = tmp_path_factory.mktemp("uploaded")
    cfg = remote_config(tmp_path, s3_server, s3_server.new_bucket())
    coordinator = CheckpointCoordinator(cfg, ROLES)
    try:
        open_all(ranks, cfg)
        for step in (1, 2):
            save_everyone(ranks, coordinator, step)
            coordinator.wait_for_commit(step)
        saved = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
        ray.get([w.wait.remote() for w in every_rank(ranks)])
        assert coordinator.wait_for_uploads()["status"] == "committed"
    finally:
        close_all(ranks, coordinator)
    return {**cfg, "saved_state_of_step_2": saved}


def cli(capsys, *argv) -> tuple[int, str, str]:
    from verl_ckpt.cli.main import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def copy_of_the_tier(uploaded, s3_server, suffix: str) -> tuple:
    """A copy of the uploaded tier under another prefix (the module's tier stays intact):
    the S3 filesystem and the copy's path."""
    fs = s3_server.filesystem()
    source = uploaded["remote"]["url"].removeprefix("s3://")
    copy = source + suffix
    for path in fs.find(source):
        fs.copy(path, copy + path[len(source) :])
    return fs, copy


def options_json(cfg) -> str:
    import json

    return json.dumps(cfg["remote"]["storage_options"])


def test_cli_ls_verify_inspect_a_remote_tier(uploaded, capsys):
    url, options = uploaded["remote"]["url"], options_json(uploaded)
    code, out, _ = cli(capsys, "ls", url, "--storage-options", options)
    assert code == 0 and f"root: {url}" in out and "tracker: step 2" in out, out
    assert "actor:2,critic:1,driver:1" in out and "committed" in out
    code, out, _ = cli(capsys, "verify", url, "--storage-options", options)
    local = read_commit_record(step_dir(uploaded["root_dir"], 2))
    assert code == 0 and out.startswith(f"OK step 2: {len(local.files)} files"), out
    code, out, _ = cli(capsys, "inspect", url, "--step", "1", "--storage-options", options)
    assert code == 0 and "role actor" in out and "embedding.word_embeddings.weight" in out, out
    code, _, err = cli(capsys, "verify", url, "--step", "7", "--storage-options", options)
    assert code == 2 and "global_step_7 does not exist" in err, err


def test_I1_a_remote_object_changed_after_upload_is_named_by_verify(
    uploaded, s3_server, capsys, tmp_path
):
    """A remote object overwritten after its upload (same size, other bytes): `verl-ckpt
    verify URL` (run as a user runs it, storage options from the AWS_* variables) exits 1
    naming the object; the untouched step still verifies; `pull` refuses the damaged step
    and leaves no step behind in the local root."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    url = uploaded["remote"]["url"]
    fs = s3_server.filesystem()
    bucket_path = url.removeprefix("s3://")
    victim = f"{bucket_path}/global_step_1/driver_state.pt"
    original = fs.cat_file(victim)
    fs.pipe_file(victim, bytes(b ^ 0xFF for b in original))
    try:
        env = {**__import__("os").environ, **s3_server.env(), "PYTHONPATH": str(REPO_ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "verl_ckpt.cli.main", "verify", url, "--step", "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"{url}/global_step_1/driver_state.pt: checksum" in done.stdout, done.stdout
        options = options_json(uploaded)
        assert cli(capsys, "verify", url, "--step", "2", "--storage-options", options)[0] == 0
        dest = tmp_path / "pulled"
        code, _, err = cli(capsys, "pull", url, "--step", "1", dest, "--storage-options", options)
        assert code == 1 and "driver_state.pt: checksum" in err, err
        assert list_step_dirs(dest) == {}
    finally:
        fs.pipe_file(victim, original)


def test_cli_pull_fetches_a_committed_step_that_loads_like_a_local_one(
    uploaded, ranks, capsys, tmp_path
):
    """`verl-ckpt pull URL --step 2 ROOT` into an empty root: the step is committed there
    (record last, every file verified) and the ranks load it; the next start of a job on
    that root rolls the tracker forward to it."""
    from verl_ckpt.startup.prepare import prepare_start

    dest = tmp_path / "pulled"
    url, options = uploaded["remote"]["url"], options_json(uploaded)
    code, out, _ = cli(capsys, "pull", url, "--step", "2", dest, "--storage-options", options)
    assert code == 0 and f"pulled step 2 from {url} into {step_dir(dest, 2)}" in out, out
    code, out, _ = cli(capsys, "verify", dest, "--step", "2")
    assert code == 0, out
    plan = prepare_start({"root_dir": str(dest)})
    try:
        assert plan.resume_dir == step_dir(dest, 2) and read_tracker(dest) == 2
    finally:
        plan.release()
    cfg = {"root_dir": str(dest), "timeout_s": 60.0, "verify_checksums_on_load": True}
    coordinator = CheckpointCoordinator(cfg, ROLES)
    try:
        open_all(ranks, cfg)
        ray.get([w.train.remote(1) for w in every_rank(ranks)])  # move away from step 2
        ray.get([w.load.remote(str(step_dir(dest, 2))) for w in every_rank(ranks)])
        loaded = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
        for got, want in zip(loaded, uploaded["saved_state_of_step_2"]):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        close_all(ranks, coordinator)


def test_I3_cli_prune_a_remote_tier_removes_records_first_and_keeps_the_tracker(
    uploaded, s3_server, capsys, tmp_path
):
    """prune --dry-run lists, prune --keep 1 deletes step 1 (never the tracker's target)."""
    fs, copy = copy_of_the_tier(uploaded, s3_server, "_copy")
    url, options = f"s3://{copy}", options_json(uploaded)
    code, out, _ = cli(
        capsys, "prune", url, "--keep", "1", "--dry-run", "--storage-options", options
    )
    assert code == 0 and "would delete step 1" in out, out
    assert store_of(
        {"remote": {"url": url, "storage_options": uploaded["remote"]["storage_options"]}}
    ).listing().committed() == [1, 2]
    code, out, _ = cli(capsys, "prune", url, "--keep", "1", "--storage-options", options)
    assert code == 0 and "deleted step 1" in out and "kept committed steps: [2]" in out, out
    assert sorted(fs.ls(copy, detail=False)) == [
        f"{copy}/global_step_2",
        f"{copy}/latest_checkpointed_iteration.txt",
    ]


def test_I3_cli_rollback_a_remote_tier_deletes_the_newer_steps_then_moves_the_tracker(
    uploaded, s3_server, capsys
):
    """`rollback URL --to 1 --delete` on S3: step 2 goes (its record first, then its
    objects), the remote tracker names step 1, which stays whole and verifies."""
    fs, copy = copy_of_the_tier(uploaded, s3_server, "_rolled_back")
    url, options = f"s3://{copy}", options_json(uploaded)
    code, out, err = cli(
        capsys, "rollback", url, "--to", "1", "--delete", "--storage-options", options
    )
    assert (code, err) == (0, "") and "deleted step 2" in out, out + err
    assert out.splitlines()[-1] == "tracker: 2 -> 1", out
    assert sorted(fs.ls(copy, detail=False)) == [
        f"{copy}/global_step_1",
        f"{copy}/latest_checkpointed_iteration.txt",
    ]
    assert cli(capsys, "verify", url, "--storage-options", options)[0] == 0


def test_cli_rejects_a_url_rollback_without_delete_and_a_path_for_pull(capsys, tmp_path):
    code, out, err = cli(capsys, "rollback", "s3://bucket/run", "--to", "1")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert "rollback of a remote tier URL (s3://bucket/run) needs --delete" in err, err
    code, _, err = cli(capsys, "pull", str(tmp_path), "--step", "1", str(tmp_path / "x"))
    assert code == 2 and "pull needs a remote tier URL" in err, err


# ---- faults --------------------------------------------------------------------------------


@pytest.mark.slow
def test_I1_s3_server_stopped_mid_upload_local_commits_go_on_and_the_next_upload_catches_up(
    ranks, own_s3_server, tmp_path
):
    """The S3 server is stopped for real (SIGSTOP: it holds its connections and state but
    answers nothing) while step 2 is being uploaded: the other ranks' files of step 2 are up,
    actor rank 0's are not. Local commits go on (steps 2 and 3 commit, the tracker moves,
    training is not held up); both uploads fail and the remote tracker still names step 1;
    what step 2 left remotely has no commit record. After SIGCONT the next upload (step 4)
    commits remotely, verified, and remote retention removes the leftover of step 2."""
    server = own_s3_server
    # The uploads' deadline is checkpoint.timeout_s: 15 s fails them sooner than the default
    # of these tests (60 s), for the same outcome.
    cfg = remote_config(
        tmp_path, server, server.new_bucket(), remote={"max_in_flight": 2}, timeout_s=15.0
    )
    # A stopped server fails a call after the read timeout (s3fs retries it a few times).
    cfg["remote"]["storage_options"] = server.storage_options(read_timeout_s=1.0)
    store = store_of(cfg)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    assert coordinator.wait_for_uploads()["tracker"] == 1

    # Actor rank 0 pauses before uploading its files of the next step; the marker says when.
    marker = tmp_path / "upload_paused"
    actor0 = ranks["actor"][0]
    ray.get(actor0.set_env.remote(ONCE_ENV_VAR, str(marker)))
    ray.get(actor0.set_env.remote(ENV_VAR, "upload:actor:0=sleep=3"))
    try:
        save_everyone(ranks, coordinator, 2)
        coordinator.wait_for_commit(2)
        wait_for(marker.exists, 60, "actor rank 0 did not reach its upload of step 2")
        # The other ranks' uploads of step 2 are under way or done: let them end, then stop.
        wait_for(
            lambda: (
                sorted(coordinator.remote_status(2)["uploaders"])
                == ["actor rank 1", "critic rank 0"]
            ),
            60,
            "the other ranks did not report their uploads of step 2",
        )
        server.pause()
        started = time.monotonic()
        save_everyone(ranks, coordinator, 3)
        coordinator.wait_for_commit(3)
        assert time.monotonic() - started < 20, "a local commit waited for the remote tier"
        assert read_tracker(cfg["root_dir"]) == 3
        for step in (2, 3):
            wait_for(
                lambda step=step: coordinator.remote_status(step)["status"] == "failed",
                180,
                f"the upload of step {step} did not fail while the server was stopped",
            )
    finally:
        server.resume()
        ray.get(actor0.set_env.remote(ENV_VAR, None))
    assert read_tracker(store) == 1
    leftover = store.listing().steps[2]
    assert COMMIT_RECORD_FILENAME not in leftover and leftover, leftover
    assert find_commit_record(store, 2) is None

    save_everyone(ranks, coordinator, 4)
    coordinator.wait_for_commit(4)
    summary = coordinator.wait_for_uploads()
    assert summary["step"] == 4 and summary["status"] == "committed", summary
    assert read_tracker(store) == 4
    record = find_commit_record(store, 4)
    assert check_step_files(store, 4, record.files, record.checksum_algorithm, 4, 60).errors == []
    listing = store.listing()
    assert listing.committed() == [1, 4] and listing.uncommitted() == [], listing
    close_all(ranks, coordinator)


def test_I3_local_retention_keeps_a_step_until_its_upload_ended(
    lone_rank,  # noqa: F811 - the fixture
    s3_server,
    tmp_path,
):
    """Regression: with a Hugging Face export queue beside the remote tier, local retention
    after a commit protected the steps being exported but no longer the steps being uploaded:
    max_ckpt_to_keep=1 deleted step 1 while its rank was still uploading it, and its upload
    failed. The rank's upload of step 1 is slowed (the fault hook: no real store can be made
    slow at will) while step 2 commits: step 1 stays on disk until its upload committed
    remotely, and only then goes."""
    cfg = remote_config(
        tmp_path, s3_server, s3_server.new_bucket(), max_ckpt_to_keep=1, remote={"max_in_flight": 2}
    )
    coordinator = CheckpointCoordinator(cfg, {"victim": 1})
    marker = tmp_path / "upload_slowed"
    try:
        ray.get(lone_rank.open_manager.remote(cfg))
        ray.get(lone_rank.set_env.remote(ONCE_ENV_VAR, str(marker)))
        ray.get(lone_rank.set_env.remote(ENV_VAR, "upload:victim=sleep=5"))
        for step in (1, 2):
            ray.get(lone_rank.save.remote(step))
            coordinator.save_driver_state(step, {"step": step})
            coordinator.wait_for_commit(step)
            if step == 1:
                wait_for(marker.exists, 60, "the rank did not reach its upload of step 1")
        assert 1 in list_step_dirs(cfg["root_dir"]), "step 1 deleted while being uploaded"
        wait_for(
            lambda: coordinator.remote_status(1)["status"] in ("committed", "failed"),
            60,
            "the upload of step 1 did not end",
        )
        assert coordinator.remote_status(1)["status"] == "committed", coordinator.remote_status(1)
        assert coordinator.wait_for_uploads()["tracker"] == 2
        wait_for(
            lambda: sorted(list_step_dirs(cfg["root_dir"])) == [2], 30, "local step 1 not deleted"
        )
    finally:
        ray.get(lone_rank.set_env.remote(ENV_VAR, None))
        ray.get(lone_rank.close.remote(5.0))
        coordinator.close()


def test_I5_a_save_waits_beyond_max_in_flight_uploads_then_names_step_and_url(
    lone_rank,  # noqa: F811 - the fixture
    s3_server,
    tmp_path,
):
    """A rank's upload that never ends (its thread hung: the fault hook, as no real store can
    be made to hang a thread forever at will): the local commit of the step is not held up;
    with remote.max_in_flight=1 the rank's next save() waits for that upload until it would
    have ended by itself (its deadline, its report's slack: RPC_SLACK_S), then fails naming
    the step and the URL; close() ends at its deadline."""
    cfg = remote_config(tmp_path, s3_server, s3_server.new_bucket(), timeout_s=4.0)
    coordinator = CheckpointCoordinator(cfg, {"victim": 1})
    try:
        ray.get(lone_rank.open_manager.remote(cfg))
        ray.get(lone_rank.set_env.remote(ENV_VAR, "upload:victim=hang"))
        ray.get(lone_rank.save.remote(1))
        coordinator.save_driver_state(1, {"step": 1})
        assert coordinator.wait_for_commit(1)["tracker"] == 1
        started = time.monotonic()
        still_running = r"upload of step 1 to s3://\S+/run is still running"
        with pytest.raises(ray.exceptions.RayTaskError, match=still_running):
            ray.get(lone_rank.save.remote(2))
        assert time.monotonic() - started < 4.0 + RPC_SLACK_S + 30
    finally:
        ray.get(lone_rank.set_env.remote(ENV_VAR, None))
        ray.get(lone_rank.close.remote(5.0))
        coordinator.close()


@pytest.mark.slow
def test_I5_a_save_behind_an_upload_cut_off_at_its_deadline_goes_on(ranks, own_s3_server, tmp_path):
    """Found by review: with remote.max_in_flight=1 (the default), the next save waited for
    the previous step's upload until exactly that upload's own deadline, and gave up at the
    instant the upload ended by itself (its copy cut off at the deadline, then its report):
    with S3 stalled, save() raised "still running" although an outage of the remote tier
    stops no training (docs/remote-tier.md). The server is stopped for real (SIGSTOP)."""
    server = own_s3_server
    cfg = remote_config(
        tmp_path, server, server.new_bucket(), remote={"max_in_flight": 1}, timeout_s=10.0
    )
    cfg["remote"]["storage_options"] = server.storage_options(read_timeout_s=1.0)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    assert coordinator.wait_for_uploads()["tracker"] == 1
    server.pause()
    try:
        save_everyone(ranks, coordinator, 2)
        coordinator.wait_for_commit(2)
        save_everyone(ranks, coordinator, 3)  # behind step 2's uploads, which fail
        coordinator.wait_for_commit(3)
    finally:
        server.resume()
    assert read_tracker(cfg["root_dir"]) == 3
    close_all(ranks, coordinator)


def test_I5_the_finalizers_calls_to_the_remote_tier_end_at_its_deadline(own_s3_server, tmp_path):
    """The finalizer's remote commit and retention call its store (listings, the record,
    the tracker), one remote commit at a time. With the S3 server stopped for real (SIGSTOP:
    it holds its connections and answers nothing), such a call lasted as long as the storage
    options let s3fs retry (here 30 s reads, retried: minutes; with default options far
    longer), holding every later upload, whose steps local retention must keep meanwhile.
    Now each call ends at the remote tier's deadline, naming the tier."""
    server = own_s3_server
    url = f"s3://{server.new_bucket()}/ckpt"
    settings = {"url": url, "storage_options": server.storage_options(), "timeout_s": 2.0}
    tier = RemoteTier(settings, tmp_path / "ckpt", {"driver": 1}, lambda step: None)
    outcome: dict = {}

    def list_the_tier() -> None:
        try:
            tier._store.listing()  # what the remote commit and retention call first
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc

    server.pause()
    try:
        call = threading.Thread(target=list_the_tier, daemon=True)
        call.start()
        call.join(30)
    finally:
        server.resume()
    assert not call.is_alive(), "the listing did not end within 30 s"
    error = outcome.get("error")
    assert isinstance(error, CommitTimeoutError) and url in str(error), error


def test_I3_an_upload_that_no_commit_of_the_run_waited_for_deletes_no_local_step(
    s3_server, tmp_path
):
    """Retention runs only after a new commit (I3). Local retention runs again when an upload
    ends only to finish the retention of a commit of this run, which had to leave steps
    being uploaded. Regression: a run that committed nothing (it failed, or stopped before its
    first save) still uploaded the newest committed step at its end (wait_for_uploads), and
    that upload's end ran local retention with the run's max_ckpt_to_keep=1: steps 1 and 2,
    saved by an earlier run with no limit, were deleted. The finalizers run in-process; the
    driver is the only participant."""
    root = tmp_path / "ckpt"
    url = f"s3://{s3_server.new_bucket()}/run"
    remote = {"url": url, "storage_options": s3_server.storage_options(), "timeout_s": 60.0}

    async def run() -> dict:
        earlier = CheckpointFinalizer(str(root), DRIVER_ONLY, max_ckpt_to_keep=None)
        for step in (1, 2, 3):
            await save_driver_step(earlier, step)
        await earlier.drain(30.0)
        # This run keeps 1 step, has a remote tier where step 3 is not yet, commits nothing.
        finalizer = CheckpointFinalizer(str(root), DRIVER_ONLY, max_ckpt_to_keep=1, remote=remote)
        summary = await finalizer.drain_uploads(60.0)
        # Whatever the upload's end started (a retention) has ended.
        await finalizer.drain(30.0)
        return summary

    summary = asyncio.run(run())
    assert summary["step"] == 3 and summary["status"] == "committed", summary
    assert sorted(list_step_dirs(root)) == [1, 2, 3]
    assert read_tracker(str(root)) == 3


def test_a_run_that_commits_nothing_reports_the_step_already_in_the_remote_tier_as_committed(
    s3_server, tmp_path
):
    """Found by review: a run (a resumed one, say) that committed nothing new ended with
    'remote tier ...: step 3 is not uploaded (None); the next run uploads it' although the
    remote tier held that very save: drain_uploads found nothing to upload and had no outcome
    to tell. The finalizers run in-process; the driver is the only participant."""
    root = tmp_path / "ckpt"
    url = f"s3://{s3_server.new_bucket()}/run"
    remote = {"url": url, "storage_options": s3_server.storage_options(), "timeout_s": 60.0}

    async def run() -> tuple[dict, dict]:
        earlier = CheckpointFinalizer(str(root), DRIVER_ONLY, max_ckpt_to_keep=None, remote=remote)
        for step in (1, 2, 3):
            await save_driver_step(earlier, step)
        uploaded = await earlier.drain_uploads(60.0)
        await earlier.drain(30.0)
        resumed = CheckpointFinalizer(str(root), DRIVER_ONLY, max_ckpt_to_keep=None, remote=remote)
        return uploaded, await resumed.drain_uploads(60.0)

    uploaded, summary = asyncio.run(run())
    assert (uploaded["step"], uploaded["status"]) == (3, "committed"), uploaded
    assert (summary["step"], summary["status"], summary["tracker"]) == (3, "committed", 3)


def test_I5_back_pressure_counts_an_uploads_deadline_from_when_it_began(
    lone_rank,  # noqa: F811 - the fixture
    s3_server,
    tmp_path,
):
    """One upload runs at a time per rank; the next waits behind it. Each upload here takes
    4 s (the fault hook slows it: a store cannot be made slow at will), within
    checkpoint.timeout_s=6. With remote.max_in_flight=2, the fourth save waits for step 2's
    upload, which began only when step 1's ended. Before, its deadline counted from its
    submission, so save 4 failed ("still running after checkpoint.timeout_s") about 2 s before
    an upload well within its own time would have ended. Now every save goes through."""
    cfg = remote_config(
        tmp_path, s3_server, s3_server.new_bucket(), timeout_s=6.0, remote={"max_in_flight": 2}
    )
    coordinator = CheckpointCoordinator(cfg, {"victim": 1})
    try:
        ray.get(lone_rank.open_manager.remote(cfg))
        ray.get(lone_rank.set_env.remote(ENV_VAR, "upload:victim=sleep=4"))
        for step in (1, 2, 3, 4):
            ray.get(lone_rank.save.remote(step))
            coordinator.save_driver_state(step, {"step": step})
            assert coordinator.wait_for_commit(step)["tracker"] == step
    finally:
        ray.get(lone_rank.set_env.remote(ENV_VAR, None))
        ray.get(lone_rank.close.remote(30.0))
        coordinator.close()

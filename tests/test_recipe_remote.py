"""The toy PPO recipe with a remote tier on a real S3 endpoint on loopback (moto's server),
as a user runs it: `python -m recipes.ppo_toy checkpoint.remote.url=s3://...`, with the
endpoint and credentials in the usual AWS_* environment variables."""

from __future__ import annotations

import shutil

import pytest

from tests.s3_server import MotoServer
from tests.test_recipe import (
    COMPARED,
    RUN_TIMEOUT_S,
    finish,
    read_metrics,
    recipe_env,
    start_recipe,
)
from verl_ckpt import read_tracker, step_dir
from verl_ckpt.store.fsspec_store import FsspecStore


@pytest.mark.slow
def test_I1_I4_a_run_resumes_from_the_remote_tier_after_its_local_root_is_lost(
    s3_server, tmp_path, uninterrupted
):
    """Run 1 (6 steps, saves at 2, 4, 6) uploads its committed steps; its local root is then
    deleted (a fresh machine). Run 2 (to step 10) finds step 6 only in the remote tier,
    downloads it (verified), resumes, and its steps 7..10 are bit-identical to an
    uninterrupted 10-step run. The finished run has its last step (10) in the remote tier,
    whose retention kept 2 steps while the local root kept max_ckpt_to_keep=2."""
    url = f"s3://{s3_server.new_bucket()}/ppo_toy"
    root = tmp_path / "ckpt"
    env = recipe_env(**s3_server.env())
    remote = (f"checkpoint.remote.url={url}", "checkpoint.remote.keep=2")
    output = finish(
        start_recipe(
            tmp_path / "run1",
            "trainer.total_steps=6",
            "checkpoint.save_freq=2",
            f"checkpoint.root_dir={root}",
            *remote,
            env=env,
        )
    )
    assert f"remote tier {url}: step 6 committed; remote tracker names step 6" in output
    store = FsspecStore(url, s3_server.storage_options())
    assert read_tracker(store) == 6
    assert store.listing().committed() == [4, 6]

    shutil.rmtree(root)
    second = finish(
        start_recipe(
            tmp_path / "run2",
            "trainer.total_steps=10",
            "checkpoint.save_freq=2",
            f"checkpoint.root_dir={root}",
            *remote,
            env=env,
        )
    )
    assert f"restored step 6 from the remote tier {url}" in second
    assert f"resumed from {step_dir(root, 6)} (step 6)" in second
    run2 = read_metrics(tmp_path / "run2" / "metrics.jsonl")
    ref = uninterrupted()
    assert sorted(run2) == [7, 8, 9, 10]
    for step in range(7, 11):
        assert {k: run2[step][k] for k in COMPARED} == {k: ref[step][k] for k in COMPARED}, step
    assert read_tracker(root) == 10 and read_tracker(store) == 10
    assert store.listing().committed() == [8, 10]


@pytest.mark.parametrize("fault", ["missing bucket", "wrong credentials", "unknown scheme"])
def test_a_bad_remote_url_is_one_line_at_start_up_before_ray(s3_server, tmp_path, fault):
    """A missing bucket, credentials the endpoint refuses (moto checking them, as AWS does),
    or a scheme fsspec does not know: exit status 2 with one line naming the URL, before Ray
    starts, and nothing written to the local root."""
    server = s3_server
    if fault == "wrong credentials":
        server = MotoServer(tmp_path, auth=True).wait_ready()
    try:
        url = {
            "missing bucket": "s3://no-such-bucket/run",
            "wrong credentials": "s3://any-bucket/run",
            "unknown scheme": "nosuchfs://bucket/run",
        }[fault]
        root = tmp_path / "ckpt"
        proc = start_recipe(
            tmp_path / "run",
            f"checkpoint.root_dir={root}",
            f"checkpoint.remote.url={url}",
            env=recipe_env(**server.env()),
        )
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if server is not s3_server:
            server.stop()
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("ppo_toy: error:")]
    assert len(errors) == 1 and url in errors[0], output[-3000:]
    expected = {
        "missing bucket": "does not exist",
        "wrong credentials": "access denied",
        "unknown scheme": "Protocol not known",
    }[fault]
    assert expected in errors[0], errors[0]
    assert "Traceback" not in output and "embedded Ray" not in output
    assert not root.exists() or list(root.iterdir()) == []

"""Preemption of the real recipe (verl_ckpt/driver/preemption.py; invariants I1, I3, I4, I5):
`ray job stop` of a job submitted to a head on 127.0.0.1, SIGTERM to the embedded-Ray recipe
process, and a SIGKILL of the whole job after its grace period ran out. Each run is
`python -m recipes.ppo_toy` with real Megatron ranks over gloo and real checkpoint files;
the signals and kills are real. The documented hook VERL_CKPT_FAULT only holds a write open
(a hung rank) or slows the commit down, at an exact moment.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from ray.job_submission import JobSubmissionClient

from recipes.metrics import is_write_figures
from tests.conftest import UNINTERRUPTED_STEPS
from tests.test_job_kill import kill_session
from tests.test_recipe import (
    COMPARED,
    REPO_ROOT,
    Output,
    RayHead,
    finish,
    read_metrics,
    recipe_env,
    start_recipe,
)
from verl_ckpt import PREEMPTED_EXIT_STATUS, read_commit_record, read_tracker, step_dir
from verl_ckpt.cli.main import main as verl_ckpt_cli
from verl_ckpt.protocol.faults import ENV_VAR
from verl_ckpt.store.commit_record import is_committed

pytestmark = pytest.mark.slow

# Enough steps (0.3 to 0.5 s each) that a stop requested after step 2 arrives well before
# the end on a loaded machine.
TOTAL = 30
# No scheduled save before the last step: whatever is committed was saved on preemption.
UNSCHEDULED = ("checkpoint.save_freq=100", f"trainer.total_steps={TOTAL}")
# Steps a resumed run trains past the stopped step: enough to show it goes on from there bit
# for bit, and to commit its own last step (nothing in training depends on total_steps).
RESUMED_STEPS = 2


def resumed_to(stopped_at: int) -> tuple[str, str]:
    """The overrides of a run that resumes from `stopped_at` and ends RESUMED_STEPS later."""
    return ("checkpoint.save_freq=100", f"trainer.total_steps={stopped_at + RESUMED_STEPS}")


_LOG_TIME = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[ppo_toy\]\[INFO\] - "


def wait_for_steps(metrics: Path, count: int, output: Output, timeout_s: float = 240) -> int:
    """Wait until the metrics file holds at least `count` complete steps; return how many."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = metrics.read_text().split("\n")[:-1] if metrics.exists() else []  # whole lines
        steps = sum(not is_write_figures(json.loads(line)) for line in lines)
        if steps >= count:
            return steps
        assert output.proc.poll() is None, f"the run ended early:\n{output.text[-4000:]}"
        assert time.monotonic() < deadline, f"{count} steps not done in {timeout_s}s"
        time.sleep(0.05)


def _log_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def step_the_signal_arrived_in(text: str) -> tuple[int, int]:
    """From the recipe's log: (the step under way when the signal arrived, the step the
    preemption line says it committed). The signal's time is the preemption line's time minus
    the seconds it reports since the request; a step is under way until its log line."""
    stopped = re.search(
        _LOG_TIME + r"preemption \(SIGTERM received\): step (\d+) committed ([\d.]+) s after",
        text,
    )
    assert stopped, text[-4000:]
    arrived = _log_time(stopped.group(1)) - float(stopped.group(3))
    ends = {
        int(m.group(2)): _log_time(m.group(1))
        for m in re.finditer(_LOG_TIME + r"step (\d+)/\d+ reward", text)
    }
    under_way = min(step for step, end in ends.items() if end >= arrived - 0.002)
    return under_way, int(stopped.group(2))


def assert_resumes_bit_exactly(tmp_path: Path, root: Path, stopped_at: int, first_run: Path, ref):
    """The stopped step verifies; a run on the same root resumes from it, and every step of
    both runs equals the uninterrupted run's."""
    assert verl_ckpt_cli(["verify", str(root), "--step", str(stopped_at)]) == 0
    resumed = tmp_path / "resumed" / "metrics.jsonl"
    second = finish(
        start_recipe(tmp_path / "resumed", *resumed_to(stopped_at), f"checkpoint.root_dir={root}")
    )
    assert_continued_exactly(root, stopped_at, first_run, second, resumed, ref)


def assert_continued_exactly(
    root: Path, stopped_at: int, first_run: Path, second: str, second_run: Path, ref
) -> None:
    """The second run (its output, its metrics file) resumed from the stopped step and ran to
    its end (`resumed_to`), and every step of both runs equals the uninterrupted run's."""
    assert f"resumed from {step_dir(root, stopped_at)} (step {stopped_at})" in second
    before = read_metrics(first_run)
    after = read_metrics(second_run)
    assert sorted(before) == list(range(1, stopped_at + 1))
    end = stopped_at + RESUMED_STEPS
    assert end <= UNINTERRUPTED_STEPS, f"stopped at step {stopped_at}, past the reference run"
    assert sorted(after) == list(range(stopped_at + 1, end + 1))
    for step, record in {**before, **after}.items():
        assert {k: record[k] for k in COMPARED} == {k: ref()[step][k] for k in COMPARED}, step
    assert read_tracker(root) == end


def test_I1_I4_sigterm_to_the_recipe_saves_the_step_under_way_exits_75_and_resumes_exactly(
    tmp_path, uninterrupted
):
    """SIGTERM (twice: the second must not abort anything) to the embedded-Ray recipe
    process: the step under way finishes, is saved out of schedule and committed, one line
    says so, and the recipe exits with status 75. The tracker names the step the signal
    arrived in (or the next one, when it landed just at a step boundary)."""
    root = tmp_path / "ckpt"
    proc = start_recipe(tmp_path / "run", *UNSCHEDULED, f"checkpoint.root_dir={root}")
    output = Output(proc)
    seen = wait_for_steps(tmp_path / "run" / "metrics.jsonl", 2, output)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    text = output.wait_exit()
    assert proc.returncode == PREEMPTED_EXIT_STATUS, text[-4000:]
    stopped_at = read_tracker(root)
    under_way, committed = step_the_signal_arrived_in(text)
    assert stopped_at == committed and seen < stopped_at < TOTAL, (seen, stopped_at)
    assert stopped_at in (under_way, under_way + 1), (under_way, stopped_at)
    line = output.wait_for(rf"preemption \(SIGTERM received\): step {stopped_at} committed .*", 1)
    assert "exiting with status 75" in line.group(0) and "Traceback" not in text
    assert_resumes_bit_exactly(
        tmp_path, root, stopped_at, tmp_path / "run" / "metrics.jsonl", uninterrupted
    )


def test_I1_I4_ray_job_stop_commits_the_step_under_way_and_the_run_resumes_exactly(
    tmp_path, uninterrupted
):
    """recipes/submit_job.sh submits the recipe to a head on 127.0.0.1; a job stop (the
    request `ray job stop` sends) SIGTERMs the driver. The commit is slowed to 5 s
    (VERL_CKPT_FAULT=commit=sleep=5, in every process of the head): longer than Ray's default
    3 s before its SIGKILL, so the step commits only because the script sets
    RAY_JOB_STOP_WAIT_TIME_S for the job. The same command, submitted again with the
    `checkpoint=sync` preset (synchronous saves, which the other recipe tests do not run),
    connects to the cluster, resumes from that step and runs to its end."""
    root = tmp_path / "ckpt"
    metrics = tmp_path / "metrics.jsonl"
    resumed = tmp_path / "resumed.jsonl"
    head = RayHead(extra_env={ENV_VAR: "commit=sleep=5"})

    def submit(steps: tuple[str, str], *overrides: str) -> subprocess.Popen:
        return subprocess.Popen(
            [
                "bash",
                str(REPO_ROOT / "recipes" / "submit_job.sh"),
                *steps,
                f"checkpoint.root_dir={root}",
                *overrides,
            ],
            cwd=tmp_path,  # the script finds the repository itself
            env={**head.env, "RAY_ADDRESS": head.address},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    try:
        head.wait_ready()
        output = Output(submit(UNSCHEDULED, f"trainer.metrics_path={metrics}"))
        job_id = output.wait_for(r"Job '(raysubmit_\w+)' submitted successfully", 120).group(1)
        seen = wait_for_steps(metrics, 2, output)
        # The request `ray job stop` sends, sent through Ray's job SDK as the CLI does: in a
        # CI run the CLI's own start-up (importing Ray on 2 loaded cores) outlasted the 28
        # steps left, the run finished first and the stop found nothing under way.
        token = head.token_path.read_text()
        client = JobSubmissionClient(head.address, headers={"Authorization": f"Bearer {token}"})
        assert client.stop_job(job_id), f"the job server did not stop {job_id}"
        text = output.wait_exit()
        stopped_at = read_tracker(root)
        stop_seen = (seen, stopped_at, text[-3000:])
        assert stopped_at is not None and seen < stopped_at < TOTAL, stop_seen
        under_way, committed = step_the_signal_arrived_in(text)
        assert stopped_at == committed and stopped_at in (under_way, under_way + 1)
        assert verl_ckpt_cli(["verify", str(root), "--step", str(stopped_at)]) == 0
        second = Output(
            submit(resumed_to(stopped_at), "checkpoint=sync", f"trainer.metrics_path={resumed}")
        )
        second.wait_exit()
    finally:
        head.stop()
    assert second.proc.returncode == 0, second.text[-4000:]
    assert "succeeded" in second.text and "connected to the Ray cluster" in second.text
    assert_continued_exactly(root, stopped_at, metrics, second.text, resumed, uninterrupted)
    # The synchronous save of the last step carries its figures too.
    last = read_metrics(resumed)[stopped_at + RESUMED_STEPS]
    assert last["ckpt_bytes"] > 100_000 and last["ckpt_write_s"] > 0, last


def test_I1_I3_I5_a_save_past_its_grace_is_named_and_after_a_sigkill_mid_save_the_run_resumes(
    tmp_path, four_step_run
):
    """The critic's write hangs (VERL_CKPT_FAULT=write:critic=hang), so the out-of-schedule
    save after SIGTERM cannot commit: at checkpoint.preemption.grace_s the driver says so in
    one line naming the step and the critic rank, and the scheduler's SIGKILL of the whole job
    (every process of its session, Ray included) lands in the middle of that save. The
    previous committed step stays the tracker's and verifies; a new run resumes from it,
    reports the partial step, and saves that step again with none of the killed run's files
    mixed in."""
    # A copy of a run of 4 steps that committed steps 2 and 4.
    root = Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))
    assert read_tracker(root) == 4
    hung = start_recipe(
        tmp_path / "run2",
        *UNSCHEDULED,
        f"checkpoint.root_dir={root}",
        "checkpoint.preemption.grace_s=4",
        env=recipe_env(**{ENV_VAR: "write:critic=hang"}),
        new_session=True,
    )
    output = Output(hung)
    try:
        wait_for_steps(tmp_path / "run2" / "metrics.jsonl", 1, output)
        hung.send_signal(signal.SIGTERM)
        error = output.wait_for(r"ppo_toy: error: the out-of-schedule save of step (\d+).*", 120)
        # The save under way when the job is killed: the actor ranks wrote their files.
        line, killed_step = error.group(0), int(error.group(1))
        partial = step_dir(root, killed_step)
        assert any((partial / "actor").glob("*.distcp")), output.text[-3000:]
    finally:
        kill_session(hung.pid)
        output.wait_exit(60)
    assert "checkpoint.preemption.grace_s=4" in line and "critic rank 0" in line, line
    assert "Traceback" not in output.text
    assert read_tracker(root) == 4
    assert not is_committed(partial)
    assert sorted(p.name for p in root.glob("global_step_*") if is_committed(p)) == [
        "global_step_2",
        "global_step_4",
    ]
    assert verl_ckpt_cli(["verify", str(root)]) == 0
    stale = partial / "critic" / "__stale_from_the_killed_run.distcp"
    stale.write_bytes(b"stale")

    # Resumes from the tracker (step 4), reports the partial step, and saves it again.
    resumed = finish(
        start_recipe(
            tmp_path / "run3",
            f"checkpoint.root_dir={root}",
            "checkpoint.save_freq=1",
            f"trainer.total_steps={killed_step}",
            "checkpoint.max_ckpt_to_keep=null",
        )
    )
    assert f"resumed from {step_dir(root, 4)} (step 4)" in resumed
    reported = (f"uncommitted step directories [{killed_step}]", "uncommitted leftover")
    assert any(message in resumed for message in reported), resumed[-3000:]
    assert read_tracker(root) == killed_step
    assert sorted(read_metrics(tmp_path / "run3" / "metrics.jsonl")) == list(
        range(5, killed_step + 1)
    )
    assert not stale.exists()
    on_disk = {str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file()} - {
        "verl_ckpt_commit.json"
    }
    assert on_disk == {f.path for f in read_commit_record(partial).files}


def test_I5_after_a_stop_commits_an_export_that_would_outlast_the_grace_is_left_to_the_next_run(
    tmp_path,
):
    """With hf_model saved, the step committed on SIGTERM is exported after its commit; here
    the export is held (VERL_CKPT_FAULT=export=hang). The recipe waits for it only for what
    is left of checkpoint.preemption.grace_s, says it is left (one line naming the step),
    and exits with status 75 before the scheduler's SIGKILL would come. Before, it waited
    checkpoint.timeout_s (600 s) for the export: past the grace, into the SIGKILL."""
    root = tmp_path / "ckpt"
    proc = start_recipe(
        tmp_path / "run",
        *UNSCHEDULED,
        f"checkpoint.root_dir={root}",
        "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "checkpoint.preemption.grace_s=20",
        env=recipe_env(**{ENV_VAR: "export:actor=hang"}),
    )
    output = Output(proc)
    wait_for_steps(tmp_path / "run" / "metrics.jsonl", 2, output)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    # The grace, plus the recipe's own exit (closing the coordinator, shutting Ray down).
    text = output.wait_exit(120)
    exited_after = time.monotonic() - signalled
    assert proc.returncode == PREEMPTED_EXIT_STATUS, text[-4000:]
    stopped_at = read_tracker(root)
    assert is_committed(step_dir(root, stopped_at))
    assert re.search(rf"exports of steps \[{stopped_at}\] .* did not end within", text), text[
        -4000:
    ]
    assert "Traceback" not in text
    # Not the 600 s of checkpoint.timeout_s: the grace (20 s) and the exit.
    assert exited_after < 90, exited_after

"""The toy PPO recipe (recipes/ppo_toy.py) as a user runs it: `python -m recipes.ppo_toy` in
real subprocesses, each with its own embedded Ray on 127.0.0.1, real megatron-core ranks over
gloo, real checkpoint files; and as a Ray job submitted to a separately started cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from omegaconf import OmegaConf

from recipes.metrics import read_metrics
from recipes.ppo_config import RecipeConfigError, to_recipe_config
from recipes.ppo_math import gae, policy_loss, token_rewards
from tests.helpers import kill_all
from verl_ckpt import read_commit_record, read_tracker, step_dir
from verl_ckpt.store.commit_record import FileEntry, write_commit_record
from verl_ckpt.store.fsio import file_checksum
from verl_ckpt.store.layout import DRIVER_STATE_FILENAME

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPARED = ("reward", "actor_loss", "critic_loss")
RUN_TIMEOUT_S = 300


def recipe_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    # A single-node Ray stays on 127.0.0.1 only with multi-node clusters off (see conftest).
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env.update(extra)
    return env


def run_python(*args: str) -> subprocess.CompletedProcess:
    """`python ARGS` in the repository with the recipes' environment, output captured; a
    command that does not start Ray (a CLI call, a refusal, an import probe)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def start_recipe(
    out_dir: Path, *overrides: str, env: dict | None = None, new_session: bool = False
) -> subprocess.Popen:
    """`python -m recipes.ppo_toy` with its Hydra output and metrics under `out_dir`
    (`new_session`: in a session of its own, so that all of it can be killed together)."""
    cmd = [
        sys.executable,
        "-m",
        "recipes.ppo_toy",
        f"hydra.run.dir={out_dir}",
        f"trainer.metrics_path={out_dir / 'metrics.jsonl'}",
        *overrides,
    ]
    return subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env or recipe_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


def finish(proc: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"recipe still running after {timeout_s}s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"recipe failed (rc {proc.returncode}):\n{output[-4000:]}"
    return output


class Output:
    """A process's combined output, read by a thread as it comes (a full pipe would block
    the process), and searchable while the process runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self._lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while (match := re.search(pattern, self.text)) is None:
            assert time.monotonic() < deadline, (
                f"no {pattern!r} in {timeout_s}s:\n{self.text[-3000:]}"
            )
            time.sleep(0.1)
        return match

    def wait_exit(self, timeout_s: float = RUN_TIMEOUT_S) -> str:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running after {timeout_s}s:\n{self.text[-4000:]}")
        self._reader.join(30)
        return self.text


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# ---- resume ------------------------------------------------------------------------------


@pytest.mark.slow
def test_I1_I4_resumed_run_continues_exactly_like_an_uninterrupted_one(
    tmp_path, four_step_run, uninterrupted
):
    """A run of 4 steps (saves at 2 and 4), then a run on (a copy of) its root to step 10
    with saves every 2 steps, give steps 1..10 bit-identical rewards and losses to an
    uninterrupted run without saves: model, Adam state (kept offloaded on the host between
    updates), samplers and the driver's prompt RNG all come back exactly from a committed
    step, and saving changes nothing. Also: the reward rises, the save steps' metrics carry
    the checkpoint figures, and retention (max_ckpt_to_keep=2) keeps the two newest steps."""
    root = Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))
    assert read_tracker(root) == 4
    second = finish(
        start_recipe(
            tmp_path / "run2",
            "trainer.total_steps=10",
            "checkpoint.save_freq=2",
            f"checkpoint.root_dir={root}",
        )
    )
    assert f"resumed from {step_dir(root, 4)} (step 4)" in second

    run1 = read_metrics(four_step_run / "metrics.jsonl")
    run2 = read_metrics(tmp_path / "run2" / "metrics.jsonl")
    ref = uninterrupted()
    assert sorted(run1) == list(range(1, 5))
    assert sorted(run2) == list(range(5, 11)), "run 2 did not continue after step 4"
    for step in range(1, 11):
        resumed = run1[step] if step <= 4 else run2[step]
        assert {k: resumed[k] for k in COMPARED} == {k: ref[step][k] for k in COMPARED}, step

    # The policy learns: mean reward of the last three steps well above the first three.
    rewards = [ref[step]["reward"] for step in range(1, 11)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards

    for figures in (run1[2], run1[4], run2[6], run2[8], run2[10]):
        assert figures["ckpt_blocking_s"] > 0 and figures["ckpt_write_s"] > 0, figures
        assert figures["ckpt_bytes"] > 100_000, figures
    assert "ckpt_blocking_s" not in run1[3] and "ckpt_blocking_s" not in run2[7]
    # The resumed run committed its last step; retention (max_ckpt_to_keep=2) kept two, the
    # first run's steps 2 and 4 included in what it deleted.
    assert read_tracker(root) == 10
    assert sorted(p.name for p in root.glob("global_step_*")) == [
        "global_step_10",
        "global_step_8",
    ]
    record = read_commit_record(step_dir(root, 10))
    assert record.participants == {"actor": 2, "critic": 1, "driver": 1}


@pytest.mark.slow
def test_a_driver_state_this_recipe_cannot_resume_is_one_line_before_ray(tmp_path, four_step_run):
    """Found by review: the driver state's format was checked once Ray, the workers and every
    rank's load had run, and failed with a RuntimeError: the recipe printed its traceback.
    A step written by an older recipe (format 1 held the prompt generator) is now refused
    before Ray starts, in one line naming the file and both formats."""
    root = Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))
    state_file = step_dir(root, 4) / DRIVER_STATE_FILENAME
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "format": 1}, state_file)
    # Its commit record as that recipe wrote it: the file's size and checksum in it.
    record = read_commit_record(step_dir(root, 4))
    files = [
        FileEntry(f.path, *file_checksum(state_file)) if f.path == DRIVER_STATE_FILENAME else f
        for f in record.files
    ]
    write_commit_record(step_dir(root, 4), dataclasses.replace(record, files=files))
    proc = start_recipe(tmp_path / "run", f"checkpoint.root_dir={root}", "trainer.total_steps=6")
    output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("ppo_toy:")]
    assert len(errors) == 1 and str(state_file) in errors[0], output[-3000:]
    assert "driver state of format 1, this recipe resumes format 2 only" in errors[0]
    assert "Traceback" not in output and "embedded Ray" not in output, output[-3000:]


@pytest.mark.parametrize("override", ["data.num_prompts=200", "trainer.seed=2"])
def test_a_resume_whose_prompt_stream_changed_is_one_line_before_ray(
    tmp_path, four_step_run, override
):
    """Found by review: a resume with another data.num_prompts or trainer.seed went on
    silently with its data cursor in another prompt stream (prompts skipped or repeated; in
    async mode a RuntimeError's traceback once Ray was up). The keys that make the stream are
    saved with each step; another value is refused before Ray, naming the key."""
    root = Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))
    proc = start_recipe(
        tmp_path / "run", f"checkpoint.root_dir={root}", "trainer.total_steps=6", override
    )
    output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("ppo_toy:")]
    key = override.partition("=")[0]
    assert len(errors) == 1 and f"the step was saved with {key}=" in errors[0], output[-3000:]
    assert "Traceback" not in output and "embedded Ray" not in output, output[-3000:]
    assert read_tracker(root) == 4


def test_I3_readme_rollback_then_resume_path_continues_from_the_older_step(tmp_path, four_step_run):
    """The README's way back to an older step: resume_path at step 2 of a root that
    committed step 4 is refused at start-up; `verl-ckpt rollback ROOT --to 2` moves step 4
    aside; then the same resume_path run continues from step 2 exactly as the first run did
    (bit-identical steps 3 and 4)."""
    # A copy of a run of 4 steps that committed steps 2 and 4.
    root = Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))
    common = ("trainer.total_steps=4", "checkpoint.save_freq=2", f"checkpoint.root_dir={root}")
    from_step_2 = (
        "checkpoint.resume_mode=resume_path",
        f"checkpoint.resume_from_path={step_dir(root, 2)}",
    )
    refused = start_recipe(tmp_path / "refused", *common, *from_step_2)
    output, _ = refused.communicate(timeout=RUN_TIMEOUT_S)
    assert refused.returncode == 2, output[-3000:]
    assert f"verl-ckpt rollback {root} --to 2" in output and "embedded Ray" not in output
    rollback = run_python("-m", "verl_ckpt.cli.main", "rollback", str(root), "--to", "2")
    assert rollback.returncode == 0, rollback.stderr[-2000:]
    assert read_tracker(root) == 2 and not step_dir(root, 4).exists()
    assert [p.name for p in root.glob("rolled_back_*/global_step_4")] == ["global_step_4"]
    second = finish(start_recipe(tmp_path / "run2", *common, *from_step_2))
    assert f"resumed from {step_dir(root, 2)} (step 2)" in second
    run1 = read_metrics(four_step_run / "metrics.jsonl")
    run2 = read_metrics(tmp_path / "run2" / "metrics.jsonl")
    assert sorted(run2) == [3, 4]
    for step in (3, 4):
        assert {k: run2[step][k] for k in COMPARED} == {k: run1[step][k] for k in COMPARED}
    assert read_tracker(root) == 4


# ---- Ray job submission ------------------------------------------------------------------

# How long a test's Ray head may take to come up, its dashboard included.
_HEAD_START_S = 120


class RayHead:
    """A Ray head started with `ray start --head --block` for one test, stopped by its pids.

    `ray stop` is not used: it kills every Ray process on the machine, including the test
    session's own Ray and other users'. This head has its own temp dir, ports and token, and
    its processes fate-share with the `ray start --block` process, which is terminated last.
    """

    def __init__(self, num_cpus: int = 4, extra_env: dict[str, str] | None = None) -> None:
        # Short path: Ray's unix socket paths under the temp dir must stay below ~107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="vcj", dir="/tmp"))
        self.token_path = self.temp_dir / "auth_token"
        self.token_path.write_text(uuid.uuid4().hex)
        gcs, self.dashboard_port, self.agent_port, agent_grpc, client, metrics = free_ports(6)
        self.env = recipe_env(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self.token_path),
            # `ray start` gives up on its dashboard after 60 s by default; on 2 cores busy
            # with the other test worker and a recipe beside it, the dashboard once took
            # longer, and `ray start` exited before wait_ready's own deadline (120 s).
            RAY_DASHBOARD_STARTUP_TIMEOUT_S=str(_HEAD_START_S),
            **(extra_env or {}),
        )
        self.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), self.env["PATH"]])
        self.proc = subprocess.Popen(
            [
                shutil.which("ray", path=self.env["PATH"]),
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={gcs}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                f"--dashboard-agent-listen-port={self.agent_port}",
                f"--dashboard-agent-grpc-port={agent_grpc}",
                f"--ray-client-server-port={client}",
                f"--metrics-export-port={metrics}",
                f"--num-cpus={num_cpus}",
                "--include-dashboard=true",
                f"--temp-dir={self.temp_dir}",
                "--disable-usage-stats",
            ],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def wait_ready(self, timeout_s: float = _HEAD_START_S) -> None:
        """Until the job server answers and the node's dashboard agent, which runs the jobs,
        serves HTTP. The job server waits only 10 s for an agent before it refuses a job
        ("No available agent to submit job"), and on 2 busy cores the agent can start later
        than that; it registers itself with the head right after its HTTP server is up."""
        token = self.token_path.read_text()
        deadline = time.monotonic() + timeout_s
        for what, url in [
            ("job server", f"{self.address}/api/version"),
            ("dashboard agent", f"http://127.0.0.1:{self.agent_port}/"),
        ]:
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
            while not self._answers(request):
                if time.monotonic() >= deadline:
                    pytest.fail(f"the Ray head's {what} at {url} not up within {timeout_s}s")
                time.sleep(0.5)

    def _answers(self, request: urllib.request.Request) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"ray start exited early:\n{self.proc.stdout.read()[-4000:]}")
        try:
            with urllib.request.urlopen(request, timeout=5):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer (404, 401): the server is up
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the `ray start --block` process (it stops its children), then kill any of
        its descendants that outlived it."""
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
        _, alive = psutil.wait_procs(descendants, timeout=10)
        kill_all(alive, timeout_s=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        assert not alive, f"Ray processes outlived `ray start --block`: {alive}"


# ---- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor.tensor_parallel_size=3", "actor.tensor_parallel_size"),
        ("checkpoint.max_ckpt_to_keep=0", "checkpoint.max_ckpt_to_keep"),
    ],
)
def test_bad_override_fails_before_ray_starts_naming_the_key(tmp_path, override, key):
    proc = run_python("-m", "recipes.ppo_toy", f"hydra.run.dir={tmp_path}", override)
    assert proc.returncode != 0
    assert key in proc.stderr, proc.stderr[-2000:]
    assert "embedded Ray" not in proc.stdout + proc.stderr


def test_hydra_checks_overrides_against_the_schema_and_composes_presets():
    """Unknown keys and wrong types fail in Hydra naming the key; checkpoint=sync swaps the
    checkpoint preset (composed in-process, as the app does)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from recipes.ppo_config import register_recipe_configs
    from verl_ckpt import register_configs

    register_configs()
    register_recipe_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base=None):
        for override, key in (
            ("critic.world_size=two", "critic.world_size"),
            ("actor.x=1", "actor.x"),
        ):
            with pytest.raises(ConfigCompositionException) as failure:
                compose("ppo_toy", overrides=[override])
            assert key in str(failure.value.__cause__ or failure.value)
        composed = compose("ppo_toy", overrides=["checkpoint=sync", "trainer.metrics_path=null"])
        default = compose("ppo_toy", overrides=["trainer.metrics_path=null"])
        toggled = compose(
            "ppo_toy",
            overrides=["checkpoint.writer.write_while_copying=true", "trainer.metrics_path=null"],
        )
    assert to_recipe_config(toggled).checkpoint.writer.write_while_copying
    assert not to_recipe_config(default).checkpoint.writer.write_while_copying
    cfg = to_recipe_config(composed)
    assert not cfg.checkpoint.async_save and cfg.checkpoint.writer.mode == "inline"
    assert cfg.checkpoint.save_freq == 10 and not cfg.checkpoint.staging.offload_aware
    # The default preset is `offload`: the recipe offloads its optimizer.
    assert to_recipe_config(default).checkpoint.staging.offload_aware


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        (
            {"actor": {"world_size": 4, "tensor_parallel_size": 2}, "rollout": {"batch_size": 31}},
            "rollout.batch_size",
        ),
        (
            {
                "critic": {"tensor_parallel_size": 4, "world_size": 4},
                "model": {"ffn_hidden_size": 66},
            },
            "critic.tensor_parallel_size",
        ),
        ({"model": {"hidden_size": 30}}, "model.hidden_size"),
        ({"rollout": {"target_token": 32}}, "rollout.target_token"),
        ({"trainer": {"total_steps": 0}}, "trainer.total_steps"),
    ],
)
def test_cross_key_checks_name_the_key(settings, key):
    with pytest.raises(RecipeConfigError, match=key.replace(".", r"\.")):
        to_recipe_config(OmegaConf.create(settings))


def test_schema_defaults_match_configs_ppo_toy_yaml():
    """The dataclass defaults and the YAML users read say the same (checkpoint aside)."""
    yaml = OmegaConf.load(REPO_ROOT / "configs" / "ppo_toy.yaml")
    del yaml["defaults"]
    yaml.trainer.metrics_path = None  # ${hydra:...} resolves only inside the Hydra app
    from_yaml, defaults = to_recipe_config(yaml), to_recipe_config(OmegaConf.create({}))
    for section in ("trainer", "model", "rollout", "algorithm", "actor", "critic"):
        assert getattr(from_yaml, section) == getattr(defaults, section), section


# ---- the metrics file ----------------------------------------------------------------------

KILLED_AFTER_A_SAVE_STEP = """
import os, signal, sys
from recipes.metrics import MetricsLog
log = MetricsLog(sys.argv[1])
log.add({"step": 1, "reward": 0.5, "ckpt_blocking_s": 0.01})  # a save step
log.add({"step": 2, "reward": 0.6, "ckpt_blocking_s": 0.02})  # another
log.set_write_figures(1, 0.2, 10)  # step 1's write ended during step 2
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # before step 2's figures: its save may have committed
"""


def test_a_job_killed_before_a_saves_write_figures_keeps_the_save_steps_line(tmp_path):
    """The recipe used to hold a save step's line until the save's write figures came,
    usually a step later; the save can commit before that, and a job killed in between lost
    the line of a step that no resume trains again (the fresh-clone suite at 564cad7:
    test_recipe_async's sync run, step 4 in no run's metrics). Now every line is written
    when add() returns, and the figures follow in a line of their own."""
    path = tmp_path / "metrics.jsonl"
    run = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_A_SAVE_STEP, str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == -signal.SIGKILL and run.stdout == "ready\n", run.stderr
    metrics = read_metrics(path)
    assert sorted(metrics) == [1, 2]
    figures = {"ckpt_write_s": 0.2, "ckpt_bytes": 10}
    assert metrics[1] == {"step": 1, "reward": 0.5, "ckpt_blocking_s": 0.01, **figures}
    assert metrics[2] == {"step": 2, "reward": 0.6, "ckpt_blocking_s": 0.02}


def test_read_metrics_merges_write_figures_and_refuses_lines_out_of_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "x": 1},
        {"step": 2, "x": 2},
        {"step": 1, "ckpt_write_s": 0.5, "ckpt_bytes": 7},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_metrics(path) == {
        1: {"step": 1, "x": 1, "ckpt_write_s": 0.5, "ckpt_bytes": 7},
        2: {"step": 2, "x": 2},
    }
    for bad in ([lines[1], lines[0]], [lines[2], lines[0]], [lines[0], lines[0]]):
        path.write_text("".join(json.dumps(line) + "\n" for line in bad))
        with pytest.raises(ValueError, match=str(path)):
            read_metrics(path)


# ---- arithmetic and optimizer offload ----------------------------------------------------


def test_gae_matches_a_hand_computation():
    rewards = torch.tensor([[1.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.5]])
    advantages, returns = gae(rewards, values, gamma=1.0, lam=1.0)
    # lam = gamma = 1: advantage = reward-to-go - value.
    assert torch.allclose(advantages, torch.tensor([[1.5, 0.75, 0.5]]))
    assert torch.allclose(returns, torch.tensor([[2.0, 1.0, 1.0]]))
    zero_lam, _ = gae(rewards, values, gamma=1.0, lam=0.0)
    assert torch.allclose(zero_lam, torch.tensor([[0.75, 0.25, 0.5]]))  # one-step TD errors
    assert token_rewards(torch.tensor([[3, 1, 3]]), 3).tolist() == [[1.0, 0.0, 1.0]]


def test_policy_loss_clips_large_ratios():
    old = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    unclipped = policy_loss(torch.full((1, 2), 0.1), old, adv, clip_ratio=0.2)
    clipped = policy_loss(torch.full((1, 2), 1.0), old, adv, clip_ratio=0.2)
    assert torch.isclose(unclipped, -torch.exp(torch.tensor(0.1)))
    assert torch.isclose(clipped, torch.tensor(-1.2))


def test_I4_optimizer_offload_swaps_storage_and_never_writes_the_host_copy():
    """Between updates the optimizer state lives in fresh host tensors that nothing mutates:
    the next update swaps in new copies first (what lets a save reference them safely)."""
    from recipes.workers import ActorWorker

    worker = ActorWorker(to_recipe_config(OmegaConf.create({})), rank=0)
    worker.model = torch.nn.Linear(4, 4)
    worker.optimizer = torch.optim.Adam(worker.model.parameters(), lr=0.1)

    def update():
        worker._onload_optimizer()
        worker.model(torch.ones(2, 4)).sum().backward()
        worker.optimizer.step()
        worker.optimizer.zero_grad()
        worker._offload_optimizer()

    update()
    host = [dict(s) for s in worker.optimizer.state.values()]
    frozen = [{k: v.clone() for k, v in s.items()} for s in host]
    update()
    for before, copy, now in zip(host, frozen, worker.optimizer.state.values()):
        for name, tensor in before.items():
            assert torch.equal(tensor, copy[name]), f"offloaded {name} was written in place"
            assert now[name].data_ptr() != tensor.data_ptr()
        assert not torch.equal(now["exp_avg"], before["exp_avg"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, megatron-core compiles")
def test_megatron_core_is_imported_without_torchs_compiler_stack_on_cpu():
    """recipes/megatron_import.py: on CPU, megatron-core's import-time torch.compile wrappers
    do not import torch._dynamo (seconds of CPU in every rank process); torch.compile is
    torch's own again afterwards, and megatron-core's jit_fuser compiles nothing."""
    probe = (
        "import sys, torch\n"
        "from recipes import megatron_cpu\n"
        "from megatron.core import jit\n"
        "compiler = [m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._induc'))]\n"
        "print(compiler, torch.compile.__module__, jit.jit_fuser.__name__)\n"
    )
    run = run_python("-c", probe)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["[]", "torch", "noop_decorator"], run.stdout

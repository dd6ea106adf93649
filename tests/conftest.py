"""Shared fixtures: a real local Ray bound to loopback, started once per test session."""

from __future__ import annotations

import os
import socket
from pathlib import Path

# Keep every Ray address on loopback. Ray replaces 127.0.0.1 by the machine's reachable IP
# (ray._private.services.resolve_ip_for_localhost) unless multi-node clusters are off, which
# this variable does; it must be set before ray is imported, and Ray's own processes
# inherit it. Multi-node tests still run several nodes, all on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# On a GPU machine, actors that ask for no GPU must not see one: the CPU tests' ranks would
# otherwise build NCCL groups of several ranks on one device (refused by NCCL). Ray hid the
# GPUs from such actors until 2.4x; this variable, read by each worker, restores that.
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1")
# Ray starts its worker processes at nice 15 (its worker_niceness). The suite's processes
# that are not Ray workers (the other pytest worker, recipe drivers, CLI runs, raylets) run
# at nice 0 and then take nearly all of a 2-core CI machine from the ranks and finalizers
# under test, whose 30-60 s deadlines passed (CI failed so). At 0, every process of the
# suite shares the CPU fairly. Read by each raylet: set before any cluster starts, and
# inherited by the clusters that recipe runs and `ray start` make.
os.environ.setdefault("RAY_worker_niceness", "0")
# A head started with `ray start` (test_multinode, test_recipe's job-submission head) posts a
# usage report from its dashboard process even with --disable-usage-stats: a "disabled"
# report, to https://usage-stats.ray.io/ by default (tests/test_usage_report.py). The suite
# sends nothing beyond loopback: the report goes to a loopback port where nothing listens.
# RAY_USAGE_STATS_ENABLED=0 also covers a `ray start` without --disable-usage-stats; the URL
# is still needed, since a head with usage stats disabled posts anyway. (ray.init() clusters
# post nothing.)
os.environ.setdefault("RAY_USAGE_STATS_REPORT_URL", "http://127.0.0.1:9/")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
import ray  # noqa: E402

from recipes.local_ray import init_local_ray  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free TCP port on loopback, for a server started right after (moto, a Ray head).
    Not for a gloo rendezvous: see rank_worker.start_world."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray on 127.0.0.1 with few CPUs; shut down at the end of the session."""
    if ray.is_initialized():
        ray.shutdown()
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    # Always a new cluster of our own, never one found running on the machine.
    init_local_ray(
        _node_ip_address="127.0.0.1",
        num_cpus=4,
        include_dashboard=False,
        namespace="verl_ckpt_tests",
        runtime_env={
            "env_vars": {
                "PYTHONPATH": pythonpath,
                "OMP_NUM_THREADS": "1",
                "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1",
            }
        },
        log_to_driver=False,
    )
    yield
    ray.shutdown()


# Steps of the session's uninterrupted recipe run (the `uninterrupted` fixture): two epochs of
# the recipe's 256 prompts (32 a step), past every step its users compare (up to step 10, and
# a preemption's stopped step and the two after it).
UNINTERRUPTED_STEPS = 16


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """One uninterrupted `python -m recipes.ppo_toy` run of UNINTERRUPTED_STEPS steps, with no
    scheduled save before its last step, run at first use: the tests that interrupt and
    resume runs compare every step with it, bit for bit (nothing in the recipe's training
    depends on trainer.total_steps or on when it saves). Its value is a function returning
    {step: metrics}. Run to its end before the test goes on, not beside the test's own runs:
    the suite keeps both cores busy, so running it beside them saved no time, and two
    embedded Rays starting at once beside the other worker's load once took Ray past its
    fixed 30 s for a raylet to register ("The current node timed out during startup")."""
    from tests.test_recipe import finish, read_metrics, start_recipe

    out = tmp_path_factory.mktemp("uninterrupted")
    finish(
        start_recipe(
            out,
            "checkpoint.save_freq=100",
            f"trainer.total_steps={UNINTERRUPTED_STEPS}",
            f"checkpoint.root_dir={out / 'ckpt'}",
        )
    )
    metrics = read_metrics(out / "metrics.jsonl")
    return lambda: metrics


@pytest.fixture(scope="session")
def four_step_run(tmp_path_factory) -> Path:
    """A recipe run of 4 steps with saves at 2 and 4, both kept (its root `ckpt/`, its
    `metrics.jsonl`): tests that need committed steps of the real recipe work on copies."""
    from tests.test_recipe import finish, start_recipe

    out = tmp_path_factory.mktemp("four_step_run")
    finish(
        start_recipe(
            out,
            "trainer.total_steps=4",
            "checkpoint.save_freq=2",
            "checkpoint.max_ckpt_to_keep=null",
            f"checkpoint.root_dir={out / 'ckpt'}",
        )
    )
    return out


# The roles of the shared rank workers: actor with 2 ranks at TP=2, critic with 1 rank.
ROLES = {"actor": 2, "critic": 1}


# How long a shared rank may take to answer between tests before it counts as broken.
RANK_ANSWERS_WITHIN_S = 30.0


def _start_shared_ranks() -> dict[str, list]:
    from tests.rank_worker import start_world

    workers: dict[str, list] = {}
    try:
        for role, size in ROLES.items():
            workers[role] = start_world(role, size, tp=size)
        ray.get([w.train.remote(1) for group in workers.values() for w in group])
    except BaseException:
        _kill_shared_ranks(workers)  # none left behind by a start that failed halfway
        raise
    return workers


def _kill_shared_ranks(workers: dict[str, list]) -> None:
    for group in workers.values():
        for w in group:
            ray.kill(w)


@pytest.fixture(scope="session")
def ranks(ray_local):
    """Real Megatron ranks in Ray actors, shared by the test modules (each test opens its own
    CheckpointManager on its own root). Each role is its own gloo world. The same dict for
    the whole session: `_shared_ranks_repaired` replaces its workers in place after a test
    that left them broken, so that one failure does not fail every later test."""
    workers = _start_shared_ranks()
    yield workers
    _kill_shared_ranks(workers)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # Each phase's report on the item (`rep_setup`, `rep_call`), for fixtures' teardown.
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def _shared_ranks_repaired(request):
    """After a test that used the shared ranks: when it failed (it may have left a manager
    mid-save, a fault injected, a gloo world waiting in a collective) or a rank does not
    answer, every shared rank is replaced by a fresh one before the next test."""
    yield
    if "ranks" not in request.fixturenames:
        return
    workers = request.getfixturevalue("ranks")
    phases = [getattr(request.node, f"rep_{when}", None) for when in ("setup", "call")]
    failed = any(report is not None and report.failed for report in phases)
    if not failed:
        try:
            ray.get(
                [w.pid.remote() for group in workers.values() for w in group],
                timeout=RANK_ANSWERS_WITHIN_S,
            )
            return
        except (ray.exceptions.RayError, TimeoutError):
            pass
    _kill_shared_ranks(workers)
    workers.update(_start_shared_ranks())


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 endpoint on loopback for the session (moto's server; tests/s3_server.py);
    each test makes a bucket of its own."""
    from tests.s3_server import MotoServer

    server = MotoServer(tmp_path_factory.mktemp("moto")).wait_ready()
    yield server
    server.stop()


@pytest.fixture
def own_s3_server(tmp_path):
    """A moto S3 server for one test, which may stop (SIGSTOP) and continue it."""
    from tests.s3_server import MotoServer

    server = MotoServer(tmp_path).wait_ready()
    yield server
    server.stop()


# ---- two workers (pyproject: pytest -n 2 --dist loadgroup --no-loadscope-reorder) ----------

# The session's recipe runs (`uninterrupted`, `four_step_run`) are built once per worker that
# asks for them: every test that uses one is in one group, so that they run once, on one
# worker. So are the modules below (recipe runs that kill, resume or plant files).
SESSION_RECIPE_RUNS = {"uninterrupted", "four_step_run"}
RECIPE_RUN_MODULES = {
    "test_job_kill",
    "test_recipe",
    "test_recipe_preemption",
    "test_recipe_remote",
    "test_recipe_resume_check",
    "test_untrusted_pickles",
}
RECIPE_RUNS_GROUP = "recipe runs"

# The longest groups of a full run (pytest --durations), longest first; every other group
# follows in collection order. The suite keeps both cores busy until one worker is left with
# the last group: the longest ones start first, so that the last are short (longest
# processing time first). xdist would otherwise order the groups by their number of tests
# (--no-loadscope-reorder turns that off), which left the documentation's examples, the
# longest single test, to the end, on one worker.
LONGEST_FIRST = (
    RECIPE_RUNS_GROUP,
    "test_docs_examples",
    "test_recipe_async",
    "test_report_batches",
    "test_participants",
    "test_remote_tier",
    "test_hf_export",
    "test_multinode",
    "test_core_ray",
)


# First: xdist's own hook turns the markers into the groups it schedules by (a suffix of each
# test's id), and runs before a conftest's hook unless this one asks to go first. Without it
# no group held: a module's tests went to both workers, and each built the module's (and the
# recipe runs') fixtures.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    # xdist hands each worker one group, then another whenever a worker has two tests left.
    order = {group: rank for rank, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(_group_of(item), len(order)))


def _group(item) -> str:
    module = item.module.__name__.rpartition(".")[2]
    if module in RECIPE_RUN_MODULES or SESSION_RECIPE_RUNS & set(item.fixturenames):
        return RECIPE_RUNS_GROUP
    return module


def _group_of(item) -> str:
    return item.get_closest_marker("xdist_group").args[0]

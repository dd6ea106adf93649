"""recipes.local_ray: the embedded Ray is started a second time when its node timed out.

The fault is Ray's (ray-project/ray#65983): the raylet exits when its dashboard agent is
slower than 15 s to start, and `ray.init` fails after 30 s. It was seen for real in this
suite on a loaded 2-core machine (a recipe run's Ray, 2026-11-29). Producing it for real
(an agent held back at start-up) costs about 45 s of a suite over its time budget, so
`ray.init` is replaced here by one that raises Ray's own exception, and `ray.shutdown` by one
that only counts: the real one would end the Ray that this test worker's other tests share."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import ray

from recipes import local_ray
from tests.conftest import REPO_ROOT

RAY_NODE_TIMEOUT = Exception(
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


def _init_failing(errors: list[BaseException], calls: list, monkeypatch) -> None:
    """ray.init raising `errors` one by one, then starting nothing; each call of it (its
    options) and of ray.shutdown ("shutdown") recorded in `calls`."""

    def init(**options):
        calls.append(options)
        if errors:
            raise errors.pop(0)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))


def test_a_node_that_timed_out_starting_is_started_once_more(monkeypatch, caplog):
    calls: list = []
    _init_failing([RAY_NODE_TIMEOUT], calls, monkeypatch)
    with caplog.at_level(logging.WARNING):
        local_ray.init_local_ray(num_cpus=1)
    options = {"address": "local", "num_cpus": 1}
    assert calls == [options, "shutdown", options]
    assert "did not start in time" in caplog.text and "starting it once more" in caplog.text


def test_a_second_time_out_and_every_other_error_are_raised_as_they_are(monkeypatch):
    calls: list = []
    _init_failing([RAY_NODE_TIMEOUT, RAY_NODE_TIMEOUT], calls, monkeypatch)
    with pytest.raises(Exception, match="timed out during startup"):
        local_ray.init_local_ray()
    assert calls == [{"address": "local"}, "shutdown", {"address": "local"}]
    calls.clear()
    _init_failing([ValueError("bad option")], calls, monkeypatch)
    with pytest.raises(ValueError, match="bad option"):
        local_ray.init_local_ray()
    assert calls == [{"address": "local"}]


def _fresh_python(code: str) -> str:
    """`code` run by a fresh interpreter of this checkout without the suite's
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (conftest sets it): its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_ray_asked_on_loopback_that_would_bind_elsewhere_is_refused_before_it_starts():
    """Found in session 23: the CPU benchmark asked for 127.0.0.1, but Ray (which reads its
    switch when imported) bound every run to the machine's reachable address. Now refused,
    in one line naming the variable, before anything starts."""
    out = _fresh_python(
        "import ray\n"
        "from recipes.local_ray import init_local_ray\n"
        "try:\n"
        "    init_local_ray(_node_ip_address='127.0.0.1', num_cpus=1, include_dashboard=False)\n"
        "except RuntimeError as exc:\n"
        "    print('REFUSED', exc, ray.is_initialized())\n"
        "else:\n"
        "    print('BOUND', ray.util.get_node_ip_address())\n"
        "    ray.shutdown()\n"
    )
    assert out.startswith("REFUSED") and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in out, out
    assert out.strip().endswith("False"), out


def test_the_benchmarks_keep_ray_on_loopback():
    """Every benchmark module imports the package first, which turns Ray's multi-node
    resolution off before ray is imported."""
    out = _fresh_python(
        "import benchmarks.run, benchmarks.cuda_path\n"
        "from ray._private import ray_constants\n"
        "print(ray_constants.ENABLE_RAY_CLUSTER)\n"
    )
    assert out.strip() == "False", out

"""recipes.local_ray: the embedded Ray is started a second time when its node timed out.

The fault is Ray's (ray-project/ray#65983): the raylet exits when its dashboard agent is
slower than 15 s to start, and `ray.init` fails after 30 s. It was seen for real in this
suite on a loaded 2-core machine (a recipe run's Ray, 2026-11-29). Producing it for real
(an agent held back at start-up) costs about 45 s of a suite over its time budget, so
`ray.init` is replaced here by one that raises Ray's own exception, and `ray.shutdown` by one
that only counts: the real one would end the Ray that this test worker's other tests share."""

from __future__ import annotations

import logging

import pytest
import ray

from recipes import local_ray

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

"""The suite sends nothing beyond loopback, Ray's usage report included.

A head started with `ray start` (test_multinode's nodes, test_recipe's job-submission head)
sends one usage report from its dashboard process even with `--disable-usage-stats` and
without a dashboard: a "disabled" report, to https://usage-stats.ray.io/ unless
RAY_USAGE_STATS_REPORT_URL names another address. tests/conftest.py points it at loopback
for every process the suite starts. Here a real `ray start --head` shows the report is sent,
to a loopback server of the test's own, and the suite's setting is checked.
"""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import tempfile
import threading
import time
from urllib.parse import urlsplit

import pytest

from tests.conftest import free_port
from tests.test_multinode import RAY, stop_cluster

# The report comes from the head's dashboard process, which on 2 busy cores once took over a
# minute to start (test_recipe.RayHead).
REPORT_WITHIN_S = 180.0


class _Reports(http.server.BaseHTTPRequestHandler):
    received: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append(body.decode(errors="replace"))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


def test_the_suites_ray_sends_its_usage_report_to_loopback():
    url = os.environ.get("RAY_USAGE_STATS_REPORT_URL", "https://usage-stats.ray.io/")
    assert urlsplit(url).hostname == "127.0.0.1", url
    assert os.environ.get("RAY_USAGE_STATS_ENABLED") == "0"


@pytest.mark.slow
def test_ray_start_with_usage_stats_disabled_still_sends_a_report():
    """Why the suite's setting exists: a head started the way the suite starts its heads
    (`--disable-usage-stats`, no dashboard) posts a report to RAY_USAGE_STATS_REPORT_URL."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _Reports)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = free_port()
    env = {
        **os.environ,
        "RAY_USAGE_STATS_REPORT_URL": f"http://127.0.0.1:{server.server_port}/",
        "RAY_AUTH_MODE": "disabled",
    }
    temp_dir = tempfile.mkdtemp(prefix="vcray", dir="/tmp")
    head = [
        RAY,
        "start",
        "--head",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--include-dashboard=false",
        "--num-cpus=1",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    try:
        subprocess.run(head, check=True, env=env, capture_output=True, timeout=120)
        deadline = time.monotonic() + REPORT_WITHIN_S
        while not _Reports.received:
            assert time.monotonic() < deadline, f"no usage report in {REPORT_WITHIN_S} s"
            time.sleep(0.2)
        assert '"source": "OSS"' in _Reports.received[0], _Reports.received[0][:300]
    finally:
        stop_cluster(port)
        server.shutdown()
        server.server_close()
        shutil.rmtree(temp_dir, ignore_errors=True)

"""A real S3 endpoint on loopback for the remote-tier tests: moto's standalone server
(`moto_server`, from `moto[server]`) as a process of its own on 127.0.0.1 and a free port,
reached through s3fs. Its state lives in its memory, so the fault "the S3 server stopped in
the middle of an upload" is a real SIGSTOP of that process (and SIGCONT later), not a kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port

MOTO_SERVER = str(Path(sys.executable).with_name("moto_server"))


class MotoServer:
    """One moto server process; `auth=True` makes it check credentials (moto's
    INITIAL_NO_AUTH_ACTION_COUNT=0: unknown access keys are refused, as AWS refuses them)."""

    def __init__(self, log_dir: Path, auth: bool = False) -> None:
        self._log_dir = log_dir
        self._env = {**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"}
        if auth:
            self._env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self._stopped = False
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log_path = self._log_dir / f"moto_{self.port}.log"
        self._log = open(self._log_path, "wb")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(
            [MOTO_SERVER, "-H", "127.0.0.1", "-p", str(self.port)],
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 60.0, port_attempts: int = 3) -> MotoServer:
        """Until the server answers. The port was free when chosen but is bound only by the
        server, later: another process may take it in between (then moto exits saying so),
        and the server starts again on another port, `port_attempts` times in all."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                taken = "is in use" in self._log_path.read_text(errors="replace")
                port_attempts -= 1
                if not (taken and port_attempts > 0):
                    pytest.fail(f"moto_server exited early with status {self.proc.returncode}")
                self._start()
                continue
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        pytest.fail(f"moto_server on {self.endpoint} not answering within {timeout_s}s")

    def storage_options(self, read_timeout_s: float = 30.0) -> dict[str, Any]:
        """s3fs options for this endpoint (dummy credentials: moto accepts any)."""
        return {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {
                "connect_timeout": 2,
                "read_timeout": read_timeout_s,
                "retries": {"max_attempts": 1},
            },
        }

    def env(self) -> dict[str, str]:
        """The same, as the environment variables a user sets for a process."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def new_bucket(self) -> str:
        import s3fs

        name = f"bkt-{uuid.uuid4().hex[:12]}"
        fs = s3fs.S3FileSystem(**self.storage_options(), skip_instance_cache=True)
        fs.call_s3("create_bucket", Bucket=name)
        return name

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(
            **self.storage_options(), skip_instance_cache=True, use_listings_cache=False
        )

    def pause(self) -> None:
        """SIGSTOP: the server stops answering; connections and state stay."""
        self.proc.send_signal(signal.SIGSTOP)
        self._stopped = True

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self._stopped = False

    def stop(self) -> None:
        if self._stopped:
            self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self._log.close()

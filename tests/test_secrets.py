"""Secrets that stay secret (issue 45, item 5): the remote tier's storage_options (key,
secret, token) never appear in an error, the finalizer's describe(), a log line, the lock
file, a record or anything else the project writes (verl_ckpt/protocol/redaction.py).

Before: start_finalizer's mismatch error and describe() (which any job can call on the named
actor) showed storage_options verbatim, and the lock file recorded the job's argv, where a
Hydra override carries them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from tests.test_recipe import finish, recipe_env, start_recipe
from verl_ckpt.cli.main import main as verl_ckpt_cli
from verl_ckpt.commit.client import start_finalizer
from verl_ckpt.commit.finalizer import CheckpointFinalizer, finalizer_settings
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.protocol.redaction import REDACTED, redacted, settings_digest
from verl_ckpt.store.tracker import read_tracker

KEY = "AKIAVERLCKPTKEY7Q2Z"
SECRET = "verlckptSECRETwJalrXUtnFEMI9x3"
TOKEN = "verlckptTOKENz8y7"


def remote_settings(server, bucket: str, secret: str = SECRET) -> dict:
    options = {**server.storage_options(), "key": KEY, "secret": secret, "token": TOKEN}
    return {
        "url": f"s3://{bucket}/run",
        "storage_options": options,
        "keep": None,
        "every": 1,
        "max_in_flight": 1,
        "threads": 4,
        "timeout_s": 60.0,
    }


def assert_no_secret(text: str) -> None:
    for secret in (KEY, SECRET, TOKEN):
        assert secret not in text, f"{secret} shown in: {text[:2000]}"


def test_redacted_keeps_keys_and_where_the_store_is_never_who():
    settings = {
        "url": "s3://bucket/run",
        "storage_options": {
            "endpoint_url": "http://127.0.0.1:9000",
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"region_name": "us-east-1", "aws_session_token": TOKEN},
            "anon": False,
        },
        "signing": {"key_env": "CKPT_KEY", "api_token": TOKEN, "keys": [KEY]},
        "keep": 2,
    }
    shown = redacted(settings)
    assert shown == {
        "url": "s3://bucket/run",
        "storage_options": {
            "endpoint_url": "http://127.0.0.1:9000",
            "key": REDACTED,
            "secret": REDACTED,
            "client_kwargs": {"region_name": "us-east-1", "aws_session_token": REDACTED},
            "anon": REDACTED,
        },
        "signing": {"key_env": REDACTED, "api_token": REDACTED, "keys": REDACTED},
        "keep": 2,
    }
    assert_no_secret(repr(shown))
    assert settings["storage_options"]["key"] == KEY  # a copy: the settings still work
    other = {**settings, "storage_options": {**settings["storage_options"], "secret": "x"}}
    assert settings_digest(other) != settings_digest(settings)
    assert redacted(other) == shown


PASSWORD = "verlckptPASSWORDq4w8"


def test_a_urls_password_is_redacted_wherever_it_is():
    """Found by review: fsspec takes credentials from a URL's user information
    (ftp://user:password@host), and redaction kept URLs as they were, password included."""
    settings = {
        "url": f"ftp://alice:{PASSWORD}@127.0.0.1:9/ckpt",
        "storage_options": {"endpoint_url": f"http://bob:{PASSWORD}@127.0.0.1:9000"},
        "notes": [f"s3://carol:{PASSWORD}@bucket/x", "ftp://alice@127.0.0.1/no-password"],
    }
    shown = redacted(settings)
    assert shown == {
        "url": f"ftp://{REDACTED}@127.0.0.1:9/ckpt",
        "storage_options": {"endpoint_url": f"http://{REDACTED}@127.0.0.1:9000"},
        "notes": [f"s3://{REDACTED}@bucket/x", "ftp://alice@127.0.0.1/no-password"],
    }
    assert PASSWORD not in repr(shown)


@pytest.mark.parametrize(
    "override",
    [
        f"checkpoint.remote.url=ftp://alice:{PASSWORD}@127.0.0.1:9/ckpt",
        f"+checkpoint.remote.storage_options.endpoint_url=http://bob:{PASSWORD}@127.0.0.1:9",
        f"+checkpoint.remote.storage_options.client_kwargs.endpoint_url=http://b:{PASSWORD}@h:9",
    ],
)
def test_a_password_in_a_remote_url_is_refused_before_ray_and_never_shown(
    tmp_path, capsys, override
):
    """The front door refuses it in one line naming the key, with the password redacted, and
    the run's records (Hydra's .hydra/ files) keep no trace of it; `verl-ckpt ls` of such a
    URL likewise."""
    run = tmp_path / "run"
    extra = () if "remote.url" in override else ("checkpoint.remote.url=s3://bucket/run",)
    proc = start_recipe(run, f"checkpoint.root_dir={tmp_path / 'ckpt'}", override, *extra)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("ppo_toy: invalid config:")]
    assert len(errors) == 1 and "holds a password" in errors[0], output[-3000:]
    assert "Traceback" not in output and "embedded Ray" not in output
    assert PASSWORD not in output
    for path in run.rglob("*"):
        if path.is_file():
            assert PASSWORD not in path.read_text(errors="replace"), path
    code = verl_ckpt_cli(["ls", f"ftp://alice:{PASSWORD}@127.0.0.1:9/ckpt"])
    shown = capsys.readouterr()
    assert code != 0 and "holds a password" in shown.err, shown
    assert PASSWORD not in shown.out + shown.err
    options = f'{{"client_kwargs": {{"endpoint_url": "http://b:{PASSWORD}@127.0.0.1:9"}}}}'
    code = verl_ckpt_cli(["ls", "s3://bucket/run", "--storage-options", options])
    shown = capsys.readouterr()
    assert code != 0 and "client_kwargs.endpoint_url" in shown.err, shown
    assert PASSWORD not in shown.out + shown.err


@pytest.mark.parametrize("command", ["ls", "prune", "rollback"])
def test_the_cli_verbose_line_never_shows_a_urls_password(command, capsys):
    """Found by review: `verl-ckpt -v` logged the URL it ran on, password included, before
    the URL's check refused it (redacted)."""
    url = f"s3://AKIA:{PASSWORD}@127.0.0.1:9/bucket"
    extra = {"ls": [], "prune": ["--keep", "1"], "rollback": ["--to", "1"]}[command]
    code = verl_ckpt_cli(["-v", command, url, *extra])
    shown = capsys.readouterr()
    assert code != 0 and "holds a password" in shown.err, shown
    assert "running" in shown.err and PASSWORD not in shown.out + shown.err


def test_the_finalizers_describe_never_shows_storage_options(s3_server, tmp_path):
    remote = remote_settings(s3_server, s3_server.new_bucket())
    # Before the finalizer opens its store: botocore rewrites nested options in place.
    expected = finalizer_settings(str(tmp_path / "ckpt"), {"driver": 1}, 2, 1, None, remote)
    finalizer = CheckpointFinalizer(str(tmp_path / "ckpt"), {"driver": 1}, 2, remote=remote)
    described = finalizer.describe()
    assert_no_secret(repr(described))
    shown = described["remote"]["storage_options"]
    assert shown["endpoint_url"] == s3_server.endpoint
    assert shown["key"] == shown["secret"] == shown["token"] == REDACTED
    assert described == expected


def test_a_finalizer_mismatch_error_never_shows_the_secrets(ray_local, s3_server, tmp_path):
    """A second start_finalizer of the same root whose settings differ: in a secret alone (the
    error says storage_options differ, not how), and in max_ckpt_to_keep too."""
    root = tmp_path / "ckpt"
    bucket = s3_server.new_bucket()
    first = start_finalizer(root, {"driver": 1}, 2, 60.0, remote=remote_settings(s3_server, bucket))
    try:
        for keep, expected in (
            (2, "remote.storage_options differ; their values are not shown"),
            (3, "max_ckpt_to_keep: 2 running, 3 asked for"),
        ):
            other = remote_settings(s3_server, bucket, secret="another" + SECRET)
            with pytest.raises(CheckpointError) as refused:
                start_finalizer(root, {"driver": 1}, keep, 60.0, remote=other)
            message = str(refused.value)
            assert expected in message, message
            assert_no_secret(message)
            assert "another" + SECRET not in message
    finally:
        ray.kill(first, no_restart=True)


def every_file_holds_no_secret(top: Path) -> int:
    """Grep every file under `top` for the secrets; the number of files read."""
    read = 0
    for path in top.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            for secret in (KEY, SECRET, TOKEN):
                assert secret.encode() not in data, f"{secret} in {path}"
            read += 1
    return read


@pytest.mark.slow
def test_a_run_against_s3_writes_and_prints_no_secret(s3_server, tmp_path):
    """The toy recipe with storage_options key, secret and token given as Hydra overrides
    (the way that reaches the most places: the command line, the lock file, the config the
    driver hands the finalizer and every rank), two saves uploaded. Then every file under
    the root, every object in the bucket, and the run's output: no key, secret or token."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ppo_toy"
    root = tmp_path / "ckpt"
    run_dir = tmp_path / "run"
    output = finish(
        start_recipe(
            run_dir,
            "trainer.total_steps=4",
            "checkpoint.save_freq=2",
            f"checkpoint.root_dir={root}",
            f"checkpoint.remote.url={url}",
            f"+checkpoint.remote.storage_options.key={KEY}",
            f"+checkpoint.remote.storage_options.secret={SECRET}",
            f"+checkpoint.remote.storage_options.token={TOKEN}",
            env=recipe_env(AWS_ENDPOINT_URL=s3_server.endpoint, AWS_DEFAULT_REGION="us-east-1"),
        )
    )
    assert f"remote tier {url}: step 4 committed" in output, output[-3000:]
    assert read_tracker(root) == 4
    assert_no_secret(output)
    assert every_file_holds_no_secret(root) > 10
    # The run's own directory too (metrics, the job's log, Hydra's record of its command
    # line in .hydra/, which the recipe redacts).
    assert (run_dir / ".hydra" / "overrides.yaml").is_file()
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for secret in (KEY, SECRET, TOKEN):
                assert secret.encode() not in data, f"{secret} in {path}"
    fs = s3_server.filesystem()
    objects = fs.find(bucket)
    assert len(objects) > 10, objects
    for name in objects:
        data = fs.cat_file(name)
        for secret in (KEY, SECRET, TOKEN):
            assert secret.encode() not in data, f"{secret} in s3://{name}"

"""`verl-ckpt`: list, verify, inspect, prune, roll back, export and pull checkpoints: one
code path for a local root and a remote tier URL (s3://bucket/prefix, file:///path, ...), each
a store (store/base.py) opened by `open_store`. The commands live in commands_read.py (ls,
verify, inspect) and commands_change.py (prune, rollback, export, pull); this module parses
and dispatches.

Exit status: 0 success; 1 the checkpoint is bad (not committed, corrupt record, unreadable
tracker, files failing verification); 2 a usage error (ROOT missing or not a directory, a bad
option value, no directory for the step asked for, ROOT in use by a running job). Errors are
one line on stderr. Commands that change a local root (prune, rollback) hold its lock
(`RootLock`) throughout, so they never run beside a job or beside each other. For a URL,
storage options come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) and/or
`--storage-options JSON`.

Signed commit records (docs/signing.md): with `--signing-key-file PATH` or
`--signing-key-env NAME` (each repeatable: every key given is accepted), every command reads
only steps whose record one of the keys signed; `ls` lists the others as refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verl_ckpt.cli.commands_change import cmd_export, cmd_prune, cmd_pull, cmd_rollback
from verl_ckpt.cli.commands_read import cmd_inspect, cmd_ls, cmd_verify
from verl_ckpt.cli.common import EXIT_BAD_CHECKPOINT, EXIT_USAGE, CliError, open_root
from verl_ckpt.cli.output import escaped
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError
from verl_ckpt.protocol.redaction import without_password
from verl_ckpt.store.base import Store
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.open_store import is_remote_url
from verl_ckpt.store.signing import keyring_from

__all__ = ["main"]

# Named, not __name__: run as `python -m verl_ckpt.cli.main` this module is __main__, and
# its errors must still go through the handler of "verl_ckpt.cli" (_configure_logging).
logger = logging.getLogger("verl_ckpt.cli.main")

_Handler = Callable[[Store, argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        # argparse's default prints the whole usage block first; one line reads better.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- entry point ---------------------------------------------------------------------------


def _step_number(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a step number >= 0, got {text!r}")
    return int(text)


def _keep_count(text: str) -> int:
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1, got {text!r}: prune never deletes every committed step"
        )
    return int(text)


def _local_directory(text: str) -> Path:
    # Path() would make s3://bucket/x the local s3:/bucket/x, created and written into.
    if is_remote_url(text):
        raise argparse.ArgumentTypeError(
            f"must be a local directory, not the URL {without_password(text)!r}"
        )
    return Path(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _thread_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


_EPILOG = (
    "exit status: 0 ok; 1 the checkpoint is bad (not committed, corrupt, failed "
    "verification); 2 usage error (ROOT missing or not a directory, bad option, no such step, "
    "ROOT in use by a running job)"
)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="verl-ckpt",
        description="List, verify, inspect, prune and roll back a verl_ckpt checkpoint root "
        "(ls, verify, inspect, prune and rollback also take a remote tier URL); pull a step "
        "from one.",
        epilog=_EPILOG,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, handler: _Handler, summary: str, details: str = ""
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name, help=summary, description=f"{summary} {details}".strip(), epilog=_EPILOG
        )
        sub.add_argument(
            "root",
            metavar="ROOT",
            help="the checkpoint root directory, or a remote tier URL (s3://bucket/prefix, ...)",
        )
        sub.set_defaults(handler=handler)
        _storage_options_flag(sub)
        _signing_flags(sub)
        return sub

    _add_read_commands(command)
    _add_change_commands(command)
    _add_pull_command(commands)
    return parser


_Command = Callable[..., argparse.ArgumentParser]


def _add_read_commands(command: _Command) -> None:
    """ls, verify, inspect: they read a root or a URL and change nothing."""
    command("ls", cmd_ls, "List every global_step_<N> directory and the tracker.")
    verify = command(
        "verify",
        cmd_verify,
        "Re-read every file of a committed step and check its size and checksum.",
        "Files are hashed in parallel, one thread per available core; the throughput is reported.",
    )
    verify.add_argument("--step", type=_step_number, help="default: the tracker's step")
    verify.add_argument(
        "--threads",
        type=_thread_count,
        metavar="N",
        help="files hashed at once (default: one per available core)",
    )
    inspect = command(
        "inspect", cmd_inspect, "Show a committed step's participants and tensors per role."
    )
    inspect.add_argument("--step", type=_step_number, help="default: the tracker's step")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")


def _add_change_commands(command: _Command) -> None:
    """prune, rollback, export: they change a root (under its lock) or a URL."""
    prune = command(
        "prune",
        cmd_prune,
        "Delete old committed steps by hand (for stopped jobs).",
        "Keeps the newest --keep committed steps and always the tracker's target; "
        "uncommitted directories are left alone. A running job's finalizer applies "
        "max_ckpt_to_keep itself after every commit, so prune is for the root of a stopped "
        "job.",
    )
    prune.add_argument("--keep", type=_keep_count, required=True, help="committed steps to keep")
    prune.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    rollback = command(
        "rollback",
        cmd_rollback,
        "Resume from an older committed step: move every newer step out of the way.",
        "Moves every global_step_<M> with M > --to (committed or not) into "
        "ROOT/rolled_back_<time>/, or deletes them with --delete, then points the tracker at "
        "--to. Journaled: an interrupted rollback is completed by the next job start or by "
        "running the same command again. Refused while a job holds the root. The root keeps a "
        "record of the committed steps moved out, so that a remote tier still holding them "
        "does not bring them back at the next start (it is refused instead). On a remote tier "
        "URL, --delete is required: the newer steps are deleted (record first), then the "
        "remote tracker names --to.",
    )
    rollback.add_argument(
        "--to",
        type=_step_number,
        required=True,
        metavar="N",
        help="the committed step to resume from",
    )
    rollback.add_argument(
        "--delete", action="store_true", help="delete the newer steps instead of keeping them"
    )
    rollback.add_argument("--dry-run", action="store_true", help="only list what would be done")
    export = command(
        "export",
        cmd_export,
        "Write the Hugging Face weights of a role of a committed step.",
        "Reads the role's committed torch_dist directory (no ranks needed), converts it with a "
        "mapping (gpt2 built in) and writes safetensors, config.json and an export record "
        "(sizes, checksums) into OUT, or by default into ROOT/global_step_<N>/<role>/"
        "huggingface/ (refused while a job holds the root). Written aside and renamed into "
        "place: never a partial export. An export that already verifies is kept.",
    )
    export.add_argument(
        "out", metavar="OUT", type=_local_directory, nargs="?", help="output directory"
    )
    export.add_argument("--step", type=_step_number, help="default: the tracker's step")
    export.add_argument("--role", required=True, help="the role to export, e.g. actor")
    export.add_argument(
        "--architecture", help="the mapping to use (default: the one that fits the model)"
    )
    export.add_argument(
        "--max-shard-mb", type=_keep_count, default=2048, help="largest safetensors file"
    )


def _add_pull_command(commands: Any) -> None:
    """pull: a URL's step into a local root (two places, so not `command`)."""
    pull = commands.add_parser(
        "pull",
        help="Fetch a committed step from a remote tier URL into a local root.",
        description="Fetch a committed step from a remote tier URL into a local root: every "
        "file downloaded in parallel and verified against the step's commit record, the "
        "record written last. The next job start on ROOT resumes from it when it is the "
        "newest committed step.",
        epilog=_EPILOG,
    )
    pull.add_argument("root", metavar="URL", help="the remote tier URL (s3://bucket/prefix)")
    pull.add_argument("--step", type=_step_number, help="default: the newest committed step")
    pull.add_argument(
        "dest", metavar="ROOT", type=_local_directory, help="the local checkpoint root to pull into"
    )
    pull.set_defaults(handler=cmd_pull)
    _storage_options_flag(pull)
    _signing_flags(pull)


# Deadline of each store call (listing, reading a record, deleting) of a command on a URL.
DEFAULT_STORE_TIMEOUT_S = 60.0


def _storage_options_flag(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--storage-options",
        metavar="JSON",
        help='for a URL: fsspec storage options, e.g. \'{"endpoint_url": "http://..."}\' '
        "(the AWS_* environment variables work too)",
    )
    sub.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_STORE_TIMEOUT_S,
        metavar="S",
        help="for a URL: each store call (listing, reading a record, deleting) ends within S "
        f"seconds or the command fails naming the object (default {DEFAULT_STORE_TIMEOUT_S:g}; "
        "the transfers of verify, inspect and pull end within 3600 s)",
    )


def _signing_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--signing-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="trust only steps whose commit record is signed with the key in PATH "
        "(checkpoint.signing; repeatable: every key given is accepted)",
    )
    sub.add_argument(
        "--signing-key-env",
        action="append",
        default=[],
        metavar="NAME",
        help="the same, with the key in the environment variable NAME",
    )


def _keyring(args: argparse.Namespace) -> None:
    """Read the keys of the signing flags into `args.keyring` (None without flags): a key
    file or variable that does not give a key is a usage error naming the flag."""
    try:
        args.keyring = keyring_from(
            args.signing_key_file, args.signing_key_env, "--signing-key-file", "--signing-key-env"
        )
    except CheckpointError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # "verl-ckpt: error: ...", the same shape as argparse's usage errors. Escaped: a
        # message may quote names read from a root (terminal escapes, newlines).
        message = escaped(record.getMessage(), keep_newlines=True)
        return f"verl-ckpt: {record.levelname.lower()}: {message}"


def _configure_logging(verbose: bool) -> None:
    # Our own handler on our own logger: the host's logging setup (or pytest's) stays as is.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    cli_logger = logging.getLogger("verl_ckpt.cli")  # every command module's logger
    cli_logger.handlers = [handler]
    cli_logger.propagate = False
    cli_logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, except that `export`'s optional OUT may follow its options: argparse
    matches an optional positional with the first run of positionals (ROOT) and would
    then refuse `ROOT --role actor OUT`."""
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "export" and args.out is None and len(extra) == 1:
        if not extra[0].startswith("-"):
            # OUT after the options (as docs/huggingface.md writes it): checked as OUT is.
            try:
                args.out, extra = _local_directory(extra[0]), []
            except argparse.ArgumentTypeError as exc:
                parser.error(f"argument OUT: {exc}")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tool; return the exit status (0 ok, 1 bad checkpoint, 2 usage error)."""
    try:
        args = _parse(_build_parser(), argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _configure_logging(args.verbose)
    # Before the URL's check (open_root), which refuses one holding a password.
    logger.debug("running %s on %s", args.command, without_password(str(args.root)))
    try:
        _keyring(args)
        store = open_root(args.root, args)
        return _run(args.handler, store, args)
    except CliError as exc:
        logger.error("%s", exc)
        return exc.code
    except BrokenPipeError:
        # The reader (`| head`) went away: not an error of ours. Point stdout at devnull so
        # the interpreter's final flush does not complain a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BAD_CHECKPOINT
    except (CheckpointError, OSError) as exc:
        # Corrupt or uncommitted record, unknown format version, a file we cannot read: the
        # library's messages already name the path.
        logger.error("%s", exc)
        return EXIT_BAD_CHECKPOINT


def _run(handler: _Handler, store: Store, args: argparse.Namespace) -> int:
    """The command on `store`; a store's own errors (an endpoint, a bucket, credentials)
    are one line naming the URL."""
    if isinstance(store, LocalStore):
        return handler(store, args)
    from verl_ckpt.store.fsspec_store import describe_store_error

    try:
        return handler(store, args)
    except CommitTimeoutError as exc:  # a store call past --timeout: it names the object
        raise CliError(describe_store_error(exc), EXIT_BAD_CHECKPOINT) from None
    except (CliError, CheckpointError, BrokenPipeError):
        raise  # they name what failed (a store call past --timeout names the object)
    except Exception as exc:  # noqa: BLE001 - a store error: one line naming the URL
        raise CliError(f"{store.url}: {describe_store_error(exc)}", EXIT_BAD_CHECKPOINT) from None


if __name__ == "__main__":
    sys.exit(main())

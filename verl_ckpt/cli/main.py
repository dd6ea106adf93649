"""`verl-ckpt`: list, verify, inspect, prune, roll back and export a checkpoint root; ls,
verify, inspect, prune and rollback (with --delete) take a remote tier URL too, and `pull`
fetches a step from one (remote/cli.py).

Exit status: 0 success; 1 the checkpoint is bad (not committed, corrupt record, unreadable
tracker, files failing verification); 2 a usage error (ROOT missing or not a directory, a bad
option value, no directory for the step asked for, ROOT in use by a running job). Errors are
one line on stderr. Commands that change the root (prune, rollback) hold its lock
(`RootLock`) throughout, so they never run beside a job or beside each other.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from verl_ckpt.format.inspection import TensorEntry, read_role_entries, scan_steps
from verl_ckpt.hf.record import describe_context_length, export_dir, verify_export
from verl_ckpt.protocol.errors import (
    CheckpointConfigError,
    CheckpointError,
    RootLockedError,
    TrackerError,
)
from verl_ckpt.startup.resume_check import QUARANTINE_DIRNAME
from verl_ckpt.startup.root_lock import RootLock, is_locked, read_holder
from verl_ckpt.store.commit_record import CommitRecord, read_commit_record
from verl_ckpt.store.fsspec_store import is_remote_url
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    DRIVER_ROLE,
    DRIVER_STATE_FILENAME,
    list_step_dirs,
    step_dir,
    step_of_dir,
)
from verl_ckpt.store.retention import DELETING_PREFIX, delete_step_dir, steps_to_delete
from verl_ckpt.store.rollback import (
    ARCHIVE_PREFIX,
    execute_rollback,
    intent_path,
    plan_rollback,
    read_rollback_intent,
    refuse_while_rollback_pending,
)
from verl_ckpt.store.tracker import read_tracker, tracker_path
from verl_ckpt.store.verification import verify_step

__all__ = ["main"]

logger = logging.getLogger(__name__)

EXIT_BAD_CHECKPOINT = 1
EXIT_USAGE = 2

_Handler = Callable[[Path, argparse.Namespace], int]


class _CliError(Exception):
    """A user-facing failure: one line of message and the exit status to end with."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        # argparse's default prints the whole usage block first; one line reads better.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- formatting ----------------------------------------------------------------------------


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_age(seconds: float) -> str:
    for limit, unit_s, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if seconds < limit:
            return f"{int(seconds // unit_s)}{unit}"
    return f"{int(seconds // 86400)}d"


def _print_table(rows: list[tuple[str, ...]], right: frozenset[int] = frozenset()) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        print("  ".join(cells).rstrip())


# ---- shared checks -------------------------------------------------------------------------


def _check_root(root: Path) -> Path:
    if not root.exists():
        raise _CliError(f"ROOT {root} does not exist", EXIT_USAGE)
    if not root.is_dir():
        raise _CliError(f"ROOT {root} is not a directory", EXIT_USAGE)
    if step_of_dir(root) is not None:
        raise _CliError(
            f"ROOT {root} is a step directory; pass the root that holds it ({root.parent})",
            EXIT_USAGE,
        )
    return root


def _pick_step(root: Path, asked: int | None) -> tuple[int, Path]:
    """The step to work on: `asked`, else the tracker's; and its existing directory."""
    step = asked
    if step is None:
        try:
            step = read_tracker(root)
        except TrackerError as exc:
            raise _CliError(f"{exc}; pass --step N", EXIT_BAD_CHECKPOINT) from None
        if step is None:
            raise _CliError(
                f"{tracker_path(root)} does not exist, so there is no default step; pass --step N",
                EXIT_BAD_CHECKPOINT,
            )
    path = step_dir(root, step)
    if not path.is_dir():
        present = sorted(list_step_dirs(root)) or "none"
        origin = "" if asked is not None else f" (named by the tracker {tracker_path(root)})"
        # A step the user typed is a usage error; one the tracker names is a broken root.
        code = EXIT_USAGE if asked is not None else EXIT_BAD_CHECKPOINT
        raise _CliError(f"{path}{origin} does not exist; steps present: {present}", code)
    return step, path


@contextmanager
def _locked(root: Path, purpose: str) -> Iterator[None]:
    """Hold the root's lock for a command that changes the root; refused if a job holds it."""
    try:
        lock = RootLock.acquire(root, purpose=purpose)
    except RootLockedError as exc:
        raise _CliError(str(exc), EXIT_USAGE) from None
    with lock:
        yield


# ---- commands ------------------------------------------------------------------------------


def _cmd_ls(root: Path, args: argparse.Namespace) -> int:
    steps = scan_steps(root)
    by_step = {info.step: info for info in steps}
    target = None
    try:
        target = read_tracker(root)
        if target is None:
            note = f"none ({tracker_path(root).name} missing: nothing committed yet?)"
        elif target not in by_step:
            note = f"step {target}, BUT {step_dir(root, target)} does not exist"
        elif not by_step[target].committed:
            note = f"step {target}, BUT that step is {by_step[target].problem}"
        else:
            note = f"step {target}"
    except TrackerError as exc:
        note = f"unreadable: {exc}"
    print(f"root: {root}")
    print(f"tracker: {note}")
    if is_locked(root):
        holder = read_holder(root)
        print(f"in use by: {holder.describe() if holder else 'a process that left no name'}")
    if steps:
        rows = [("", "STEP", "SIZE", "AGE", "ROLES", "STATUS")]
        for info in steps:
            rows.append(
                (
                    "*" if info.step == target else "",
                    str(info.step),
                    _human_bytes(info.size),
                    _human_age(info.age_s),
                    ",".join(info.roles) or "-",
                    info.problem or "committed",
                )
            )
        _print_table(rows, right=frozenset({1, 2, 3}))
        if target in by_step:
            print("(* = the tracker's target)")
    else:
        print("no global_step_<N> directories")
    _print_leftovers(root)
    return 0


def _print_leftovers(root: Path) -> None:
    """What `ls`'s table does not show: a pending rollback, archives, half-deleted steps."""
    try:
        intent = read_rollback_intent(root)
    except CheckpointError as exc:
        print(f"pending rollback: unreadable: {exc}")
    else:
        if intent is not None:
            print(
                f"pending rollback: to step {intent.to}, moving steps {list(intent.steps)} "
                f"({intent_path(root)}): interrupted; the next job start or `verl-ckpt "
                f"rollback {root} --to {intent.to}` completes it"
            )
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.startswith(ARCHIVE_PREFIX):
            moved = sorted(list_step_dirs(entry))
            print(
                f"archive {entry}: steps {moved} (moved out by verl-ckpt rollback; "
                "delete it when no longer needed)"
            )
        elif entry.name.startswith(DELETING_PREFIX):  # retention's name for a doomed step
            print(
                f"leftover {entry}: a deletion by retention was interrupted or failed; "
                "removed after the next commit"
            )
        elif entry.name == QUARANTINE_DIRNAME:
            for moved in sorted(p for p in entry.iterdir() if p.is_dir()):
                print(
                    f"quarantined {moved}: failed verification at a job start "
                    "(checkpoint.resume_fallback=previous); never deleted by verl_ckpt"
                )


def _cmd_verify(root: Path, args: argparse.Namespace) -> int:
    step, path = _pick_step(root, args.step)
    record = read_commit_record(path)  # CommitRecordError: not committed, corrupt, version
    result = verify_step(path, record, threads=args.threads)
    problems = [problem.describe() for problem in result.problems]
    if record.step != step:
        problems.insert(0, f"{path / COMMIT_RECORD_FILENAME}: names step {record.step}, not {step}")
    exports = _verify_exports(path, record, problems)
    speed = f" in {result.seconds:.3f} s ({result.gb_per_s:.2f} GB/s, {result.threads} threads)"
    status = _print_verify_verdict(step, record, problems, speed)
    if status == 0:
        for line in exports:
            print(line)
    return status


def _print_verify_verdict(step: int, record: CommitRecord, problems: list[str], speed: str) -> int:
    """Print `verify`'s verdict on a step (local or remote); its exit status."""
    if problems:
        print(f"FAILED step {step}: {len(problems)} problem(s) in {len(record.files)} files")
        for problem in problems:
            print(problem)
        return EXIT_BAD_CHECKPOINT
    total = sum(entry.size for entry in record.files)
    print(f"OK step {step}: {len(record.files)} files, {total} bytes verified{speed}")
    return 0


def _verify_exports(path: Path, record: CommitRecord, problems: list[str]) -> list[str]:
    """Check every role's Hugging Face export that exists (step E): problems go to
    `problems`; a line per export that verified is returned."""
    lines = []
    for role in sorted(record.participants):
        directory = export_dir(path, role)
        if role == DRIVER_ROLE or not directory.exists():
            continue
        export, found = verify_export(directory)
        problems.extend(found)
        if export is not None and not found:
            total = sum(entry.size for entry in export.files)
            lines.append(
                f"OK Hugging Face export of {role} ({export.architecture}): "
                f"{len(export.files)} files, {total} bytes verified"
            )
    return lines


def _role_entries(role_dir: Path) -> list[TensorEntry]:
    try:
        return read_role_entries(role_dir)
    except FileNotFoundError:
        raise _CliError(f"{role_dir / '.metadata'} is missing", EXIT_BAD_CHECKPOINT) from None
    except Exception as exc:  # noqa: BLE001 - `.metadata` is a pickle: damage raises anything
        raise _CliError(
            f"{role_dir / '.metadata'} is unreadable: {type(exc).__name__}: {exc}",
            EXIT_BAD_CHECKPOINT,
        ) from None


def _print_inspection(
    root: str, step_location: str, record: CommitRecord, roles: dict[str, list[TensorEntry]]
) -> None:
    print(f"step {record.step} under {root}: committed, format version {record.format_version}")
    print("participants: " + ", ".join(f"{r} x{n}" for r, n in sorted(record.participants.items())))
    for role, entries in roles.items():
        print(f"\nrole {role} ({step_location}/{role}):")
        rows = [("  KEY", "DTYPE", "SHAPE", "BYTES")]
        for e in entries:
            shape = str(e.shape) if e.kind == "tensor" else "-"
            rows.append((f"  {e.key}", e.dtype or "object", shape, str(e.nbytes)))
        _print_table(rows, right=frozenset({3}))
        total = sum(e.nbytes for e in entries)
        tensors = sum(e.kind == "tensor" for e in entries)
        print(
            f"  total: {len(entries)} entries ({tensors} tensors), "
            f"{total} bytes ({_human_bytes(total)})"
        )
    for entry in record.files:
        if entry.path == DRIVER_STATE_FILENAME:
            print(f"\ndriver state: {entry.path}, {entry.size} bytes")


def _cmd_inspect(root: Path, args: argparse.Namespace) -> int:
    step, path = _pick_step(root, args.step)
    record = read_commit_record(path)
    roles = {
        role: _role_entries(path / role)
        for role in sorted(record.participants)
        if role != DRIVER_ROLE
    }
    _inspection_output(str(root), str(path), record, roles, args.json)
    return 0


def _inspection_output(
    root: str, step_location: str, record: CommitRecord, roles: dict, as_json: bool
) -> None:
    """`inspect`'s output, for a local root or a remote tier URL (remote/cli.py)."""
    if not as_json:
        _print_inspection(root, step_location, record, roles)
        return
    report = {
        "root": root,
        "step": record.step,
        "format_version": record.format_version,
        "participants": record.participants,
        "roles": {
            role: {
                "path": f"{step_location}/{role}",
                "entries": [asdict(e) for e in entries],
                "total_bytes": sum(e.nbytes for e in entries),
            }
            for role, entries in roles.items()
        },
        "files": [asdict(entry) for entry in record.files],
    }
    json.dump(report, sys.stdout, indent=1)
    print()


def _cmd_prune(root: Path, args: argparse.Namespace) -> int:
    with _locked(root, "verl-ckpt prune"):
        return _prune(root, args)


def _prune(root: Path, args: argparse.Namespace) -> int:
    refuse_while_rollback_pending(root)
    try:
        target = read_tracker(root)
    except TrackerError as exc:
        # Without the tracker we cannot know which step a resume would load (I3).
        raise _CliError(f"{exc}; refusing to prune", EXIT_BAD_CHECKPOINT) from None
    steps = scan_steps(root)
    committed = [info.step for info in steps if info.committed]
    doomed = set(steps_to_delete(committed, args.keep, {target} if target is not None else ()))
    verb = "would delete" if args.dry_run else "deleted"
    for info in steps:
        if info.step in doomed:
            if not args.dry_run:
                delete_step_dir(info.path)
            print(f"{verb} step {info.step}: {info.path} ({_human_bytes(info.size)})")
        elif not info.committed:
            print(f"left alone step {info.step}: {info.problem} (prune deletes committed steps)")
    kept = sorted(set(committed) - doomed)
    print(f"kept committed steps: {kept or 'none'}; tracker's target: {target}")
    return 0


def _cmd_export(root: Path, args: argparse.Namespace) -> int:
    step, path = _pick_step(root, args.step)
    from verl_ckpt.hf.export import export_role  # torch: seconds to import, only here

    def export() -> object:
        try:
            shard = args.max_shard_mb << 20
            return export_role(path, args.role, args.architecture, args.out, shard)
        except CheckpointConfigError as exc:  # a role, architecture or OUT the user typed
            raise _CliError(str(exc), EXIT_USAGE) from None

    if args.out is None:
        # Into the step itself: the root changes, so not beside a job (its retention could
        # delete the step midway) nor beside another command.
        with _locked(root, "verl-ckpt export"):
            summary = export()
    else:
        summary = export()
    if summary.existing:
        print(
            f"step {step} role {args.role}: already exported to {summary.path} "
            f"({summary.files} files verified)"
        )
    else:
        print(
            f"exported step {step} role {args.role} ({summary.architecture}) to {summary.path}: "
            f"{summary.files} files, {summary.bytes} bytes in {summary.seconds:.1f} s; "
            f"{describe_context_length(summary.context_length)}"
        )
    return 0


def _cmd_rollback(root: Path, args: argparse.Namespace) -> int:
    with _locked(root, "verl-ckpt rollback"):
        _pick_step(root, args.to)  # a step the user typed and that is not there: exit 2
        pending = read_rollback_intent(root)
        intent = plan_rollback(root, args.to, delete=args.delete)
        if pending is not None:
            logger.warning(
                "completing the interrupted rollback to step %d (%s)", intent.to, intent_path(root)
            )
        try:
            tracker = read_tracker(root)
            before = "none" if tracker is None else str(tracker)
        except TrackerError:  # only when completing a pending rollback, which rewrites it
            before = "unreadable"
        if not args.dry_run:
            execute_rollback(root, intent)
    for step in intent.steps:
        if intent.delete:
            verb = "would delete" if args.dry_run else "deleted"
            print(f"{verb} step {step}: {step_dir(root, step)}")
        else:
            verb = "would move" if args.dry_run else "moved"
            print(f"{verb} step {step} to {root / intent.archive / step_dir(root, step).name}")
    if not intent.steps:
        print(f"no step newer than {intent.to}")
    suffix = " (dry run: nothing changed)" if args.dry_run else ""
    print(f"tracker: {before} -> {intent.to}{suffix}")
    return 0


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
        return sub

    command("ls", _cmd_ls, "List every global_step_<N> directory and the tracker.")
    verify = command(
        "verify",
        _cmd_verify,
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
        "inspect", _cmd_inspect, "Show a committed step's participants and tensors per role."
    )
    inspect.add_argument("--step", type=_step_number, help="default: the tracker's step")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    prune = command(
        "prune",
        _cmd_prune,
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
        _cmd_rollback,
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
        _cmd_export,
        "Write the Hugging Face weights of a role of a committed step.",
        "Reads the role's committed torch_dist directory (no ranks needed), converts it with a "
        "mapping (gpt2 built in) and writes safetensors, config.json and an export record "
        "(sizes, checksums) into OUT, or by default into ROOT/global_step_<N>/<role>/"
        "huggingface/ (refused while a job holds the root). Written aside and renamed into "
        "place: never a partial export. An export that already verifies is kept.",
    )
    export.add_argument("out", metavar="OUT", type=Path, nargs="?", help="output directory")
    export.add_argument("--step", type=_step_number, help="default: the tracker's step")
    export.add_argument("--role", required=True, help="the role to export, e.g. actor")
    export.add_argument(
        "--architecture", help="the mapping to use (default: the one that fits the model)"
    )
    export.add_argument(
        "--max-shard-mb", type=_keep_count, default=2048, help="largest safetensors file"
    )
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
    pull.add_argument("dest", metavar="ROOT", help="the local checkpoint root to pull into")
    pull.set_defaults(handler=None)
    _storage_options_flag(pull)
    return parser


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


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # "verl-ckpt: error: ...", the same shape as argparse's usage errors.
        return f"verl-ckpt: {record.levelname.lower()}: {record.getMessage()}"


def _configure_logging(verbose: bool) -> None:
    # Our own handler on our own logger: the host's logging setup (or pytest's) stays as is.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, except that `export`'s optional OUT may follow its options: argparse
    matches an optional positional with the first run of positionals (ROOT) and would
    then refuse `ROOT --role actor OUT`."""
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "export" and args.out is None and len(extra) == 1:
        if not extra[0].startswith("-"):
            args.out, extra = Path(extra[0]), []
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
    logger.debug("running %s on %s", args.command, args.root)
    try:
        if is_remote_url(args.root):
            from verl_ckpt.cli.remote import run_remote_command

            return run_remote_command(args)
        if args.handler is None:
            raise _CliError(f"{args.command} needs a remote tier URL, not {args.root}", EXIT_USAGE)
        return args.handler(_check_root(Path(args.root)), args)
    except _CliError as exc:
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


if __name__ == "__main__":
    sys.exit(main())

"""One remote tier URL through fsspec: the same layout as a local root, under a prefix.

    <url>/latest_checkpointed_iteration.txt        the remote tracker ("N\\n", one PUT)
    <url>/global_step_<N>/<role>/...               the files of the step, as on disk
    <url>/global_step_<N>/driver_state.pt
    <url>/global_step_<N>/verl_ckpt_commit.json    the commit record, uploaded LAST

Every listing goes to the store (no fsspec listings cache: other processes write the same
prefix), and every call runs under the deadlines given in storage_options (botocore's
connect and read timeouts for s3). Those alone do not bound a call: s3fs retries a timed
out request on top of botocore's attempts (a 2 s read timeout took 25 s with one attempt;
the defaults, minutes). A store opened with `call_timeout_s` (start-up, the CLI) runs each
of its calls through `call_with_deadline`, which ends it at that deadline naming the object
(not the streams of a transfer, which have the transfer's own deadline). Such a call keeps
running in its thread and may still land: no later call of this store on the same object is
sent before it ended (each fails until then), so a late PUT of the tracker can never land
after a newer one of the same process (I2).

An object store cannot rename: a step is deleted record first, then its objects
(`retire_step` returns the step's own name), and rollback deletes instead of archiving. A
file is published whole: one PUT, or a multipart upload completed only once its bytes were
checked, else aborted (an incomplete multipart upload is no object).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CheckpointConfigError, CommitTimeoutError
from verl_ckpt.store.base import PartPool, Publisher, Store
from verl_ckpt.store.fsio import (
    FileTooLarge,
    atomic_write_bytes,
    make_dir,
    open_regular,
    read_regular,
)
from verl_ckpt.store.fsspec_publish import MultipartUpload, OnePut, S3PartPool, StreamedObject
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    printable,
    relative_path_problem,
    step_name,
    step_of_dir,
)

__all__ = [
    "FsspecStore",
    "RemoteListing",
    "call_with_deadline",
    "check_store",
    "describe_store_error",
]

_T = TypeVar("_T")
# The least share of a call's deadline left to send it once an earlier call on its object
# ended (FsspecStore._bounded).
_LEAST_CALL_SHARE = 0.1

logger = logging.getLogger(__name__)

# A listing is data from the bucket: past this many objects under one prefix it is refused
# rather than held in memory (a step of 4096 ranks has tens of thousands).
MAX_LISTED_OBJECTS = 10_000_000

# s3 defaults when storage_options' config_kwargs do not say: an unreachable endpoint fails
# a connection after 10 s (botocore: 60 s), a stopped one a request after 60 s, with 3
# attempts (s3fs retries timeouts a few more times on top).
_S3_CONFIG_DEFAULTS = {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 3}}


@dataclass(frozen=True)
class RemoteListing:
    """Every object under the URL, read in one (paginated) listing."""

    # step -> {path relative to the step directory: size}
    steps: dict[int, dict[str, int]]

    def committed(self) -> list[int]:
        """Steps whose commit record is present, oldest first."""
        return sorted(s for s, files in self.steps.items() if COMMIT_RECORD_FILENAME in files)

    def uncommitted(self) -> list[int]:
        return sorted(s for s, files in self.steps.items() if COMMIT_RECORD_FILENAME not in files)

    def size(self, step: int) -> int:
        return sum(self.steps.get(step, {}).values())


class FsspecStore(Store):
    """An fsspec filesystem and the prefix of one URL (store/base.py). With `call_timeout_s`,
    each call of the methods below (not the streams, which have their transfer's deadline)
    ends within it, or raises CommitTimeoutError naming the object."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        call_timeout_s: float | None = None,
        setting: str = "checkpoint.remote.url",
    ) -> None:
        """`setting`: what the user gave the URL as, named by the errors of a bad one."""
        import fsspec

        self.call_timeout_s = call_timeout_s
        self.url = url.rstrip("/")
        protocol = self.url.split("://", 1)[0]
        botocore_settings = (storage_options or {}).get("config_kwargs")
        if botocore_settings is not None and not isinstance(botocore_settings, Mapping):
            # Named by type only: a storage option's value may be a secret.
            raise CheckpointConfigError(
                f"{setting}={url!r}: storage option config_kwargs must be a mapping of "
                f"botocore Config settings, not a {type(botocore_settings).__name__}"
            )
        options = _with_defaults(protocol, dict(storage_options or {}))
        try:
            self.fs, path = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as exc:
            raise CheckpointConfigError(
                f"{setting}={url!r} needs a package that is not installed: {exc} "
                "(pip install 'verl_ckpt[s3]' for s3://)"
            ) from None
        except ValueError as exc:
            raise CheckpointConfigError(f"{setting}={url!r} is invalid: {exc}") from None
        except TypeError as exc:
            # A storage option the filesystem's constructor does not take (its name only).
            raise CheckpointConfigError(
                f"{setting}={url!r}: a storage option is refused: {exc}"
            ) from None
        self.path = path.rstrip("/")
        self.is_local = "file" in _protocols(self.fs)
        # Calls past their deadline, still running, by object (`_bounded`).
        self._overrunning: dict[str, threading.Thread] = {}
        self._overrunning_lock = threading.Lock()

    # ---- names ---------------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        """The fsspec path of `parts` under the prefix."""
        return "/".join([self.path, *parts])

    # ---- objects -------------------------------------------------------------------------

    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        def read() -> bytes | None:
            if self.is_local:  # file://: a regular file only, as on a local root
                return read_regular(self.key(rel), max_bytes)
            try:
                if max_bytes is None:
                    return self.fs.cat_file(self.key(rel))
                # One byte more than the bound: a ranged GET never fetches a huge object.
                return self.fs.cat_file(self.key(rel), start=0, end=max_bytes + 1)
            except FileNotFoundError:
                return None

        data = self._bounded(read, rel)
        if data is not None and max_bytes is not None and len(data) > max_bytes:
            raise FileTooLarge(errno.EFBIG, f"larger than {max_bytes} bytes", self.uri(rel))
        return data

    def exists(self, rel: str) -> bool:
        return self._bounded(lambda: self.fs.exists(self.key(rel)), rel)

    def put_bytes(
        self, rel: str, data: bytes, before_replace: Callable[[], None] | None = None
    ) -> None:
        """One PUT on object stores, which readers see entirely or not at all; on a local
        filesystem (file://), tmp file + fsync + rename (fsio)."""

        def put() -> None:
            if self.is_local:
                make_dir(os.path.dirname(self.key(rel)), parents=True, exist_ok=True)
                atomic_write_bytes(self.key(rel), data, before_replace=before_replace)
                return
            if before_replace is not None:
                before_replace()
            self.fs.pipe_file(self.key(rel), data)

        self._bounded(put, rel)

    def remove(self, rel: str) -> None:
        def remove() -> None:
            try:
                self.fs.rm_file(self.key(rel))
            except FileNotFoundError:
                pass

        self._bounded(remove, rel)

    def remove_tree(self, rel: str) -> None:
        def remove_tree() -> None:
            try:
                self.fs.rm(self.key(rel), recursive=True)
            except FileNotFoundError:
                pass

        self._bounded(remove_tree, rel)

    def list_steps(self) -> list[int]:
        return sorted(self.listing().steps)

    def list_files(self, rel: str) -> dict[str, int]:
        def find() -> dict[str, Any]:
            try:
                return self.fs.find(self.key(rel), detail=True)
            except FileNotFoundError:
                return {}

        prefix = self.key(rel) + "/"
        return {
            name[len(prefix) :]: int(info.get("size") or 0)
            for name, info in _bounded_listing(self._bounded(find, rel), self.uri(rel)).items()
            if info.get("type") != "directory"
            and name.startswith(prefix)
            and _listed_name_ok(name[len(prefix) :], self.uri(rel))
        }

    def retire_step(self, step: int) -> str | None:
        return step_name(step)  # no cheap rename: the record goes first (retention.py)

    def open_read(self, rel: str) -> BinaryIO:
        if self.is_local:  # file://: a regular file only (a FIFO would hang the transfer)
            return open(open_regular(self.key(rel)), "rb")
        return self.fs.open(self.key(rel), "rb", block_size=_READ_BLOCK)

    def open_publish(
        self, rel: str, size: int, part_size: int, parts: PartPool | None = None
    ) -> Publisher:
        if self.is_local:
            from verl_ckpt.store.local import LocalStore  # file://: tmp + fsync + rename

            return LocalStore(self.path).open_publish(rel, size, part_size)
        if size <= part_size:
            # One PUT: a multipart upload would cost three requests for one part.
            return OnePut(self.fs, self.key(rel))
        if isinstance(parts, S3PartPool):
            return MultipartUpload(parts, self.key(rel))
        return StreamedObject(self.fs.open(self.key(rel), "wb", block_size=part_size))

    def part_pool(self, threads: int, timeout_s: float) -> PartPool | None:
        if not hasattr(self.fs, "call_s3"):
            return None
        return S3PartPool(self.fs, threads, timeout_s)

    def listing(self) -> RemoteListing:
        """Every step's objects and sizes, in one recursive listing of the prefix."""

        def find() -> dict[str, Any]:
            try:
                return self.fs.find(self.path, detail=True)
            except FileNotFoundError:
                return {}

        return self._listing_of(_bounded_listing(self._bounded(find, ""), self.url))

    def _listing_of(self, found: dict[str, Any]) -> RemoteListing:
        steps: dict[int, dict[str, int]] = {}
        prefix = self.path + "/"
        for name, info in found.items():
            if info.get("type") == "directory" or not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("/", 1)
            step = step_of_dir(parts[0])
            if step is None or len(parts) != 2 or not _listed_name_ok(parts[1], self.url):
                continue
            steps.setdefault(step, {})[parts[1]] = int(info.get("size") or 0)
        return RemoteListing(steps)

    def _bounded(self, call: Callable[[], _T], rel: str) -> _T:
        """`call()`, ended at `call_timeout_s` (if set) with an error naming `rel`'s URL.
        A call on `rel` that outlasted its deadline may still land: this one is sent only
        once it ended (waited for within this call's deadline). Sent beside it, this one
        could land first and be undone by it: a tracker moved back (I2), a removed object
        back."""
        if self.call_timeout_s is None:
            return call()
        where = self.uri(rel) if rel else self.url
        deadline = deadline_in(self.call_timeout_s)
        self._after_overrunning_call(rel, deadline, where)
        return call_with_deadline(
            call,
            time_left(deadline),
            f"the remote tier {where}",
            left_running=lambda thread: self.hold_back(rel, thread),
            stated_s=self.call_timeout_s,
        )

    def _after_overrunning_call(self, rel: str, deadline: float, where: str) -> None:
        with self._overrunning_lock:
            earlier = self._overrunning.get(rel)
        # A sequence held back as a whole (hold_back) goes on sending its own calls.
        if earlier is None or earlier is threading.current_thread():
            return
        earlier.join(time_left(deadline))
        # Sent with (next to) no time left, this call would be reported as failed and then
        # left running, able to land after all: it is not sent (the caller tries again).
        if earlier.is_alive() or time_left(deadline) < _LEAST_CALL_SHARE * self.call_timeout_s:
            raise CommitTimeoutError(
                f"the remote tier {where}: an earlier call on it outlasted its deadline and "
                f"may still land; no other is sent before it ends (waited "
                f"{self.call_timeout_s:g}s)"
            )
        with self._overrunning_lock:
            if self._overrunning.get(rel) is earlier:
                del self._overrunning[rel]

    def hold_back(self, rel: str, thread: threading.Thread) -> None:
        with self._overrunning_lock:
            # Those that ended since are forgotten: the dict holds only calls still running.
            for name in [n for n, t in self._overrunning.items() if not t.is_alive()]:
                del self._overrunning[name]
            self._overrunning[rel] = thread


def check_store(url: str, storage_options: dict[str, Any], timeout_s: float) -> FsspecStore:
    """Open the store and prove that it takes a write: one small object put and removed.

    A wrong scheme, a missing bucket, wrong credentials or an unreachable endpoint is one
    CheckpointConfigError naming the URL, within `timeout_s`.
    """
    # Every later call of the returned store ends within `timeout_s` too (start-up's reads).
    store = FsspecStore(url, storage_options, call_timeout_s=timeout_s)
    probe = f".verl_ckpt_probe_{uuid.uuid4().hex}"

    def write_and_remove() -> None:
        if store.is_local:
            make_dir(store.path, parents=True, exist_ok=True)
        store.fs.pipe_file(store.key(probe), b"probe")
        store.remove(probe)

    try:
        call_with_deadline(write_and_remove, timeout_s, f"the remote tier {url}")
    except Exception as exc:  # noqa: BLE001 - every failure here is the URL's, in one line
        raise CheckpointConfigError(
            f"checkpoint.remote.url={url!r} is unusable: {describe_store_error(exc)}"
        ) from None
    return store


def describe_store_error(exc: BaseException) -> str:
    """One line saying what a store error means to the user."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, CommitTimeoutError):
        return f"{text} (endpoint unreachable or stopped?)"
    if isinstance(exc, FileNotFoundError):
        return f"the bucket or path does not exist ({text})"
    if isinstance(exc, PermissionError):
        return (
            f"access denied ({text}); check the credentials (checkpoint.remote.storage_options "
            "or the AWS_* environment variables) and the bucket's permissions"
        )
    return f"{type(exc).__name__}: {text}"


def call_with_deadline(
    fn: Callable[[], _T],
    timeout_s: float,
    what: str,
    left_running: Callable[[threading.Thread], None] | None = None,
    stated_s: float | None = None,
) -> _T:
    """Run `fn` on a daemon thread; raise CommitTimeoutError naming `what` if it has not
    returned within `timeout_s` (the thread is left behind: a hung socket cannot be
    interrupted, and a daemon thread does not keep the process alive; `left_running` is
    given it first). The error states `stated_s` (default `timeout_s`): the deadline as
    configured, where `timeout_s` is what was left of it."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            result["error"] = exc

    thread = threading.Thread(target=run, name="verl_ckpt_remote_call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        if left_running is not None:
            left_running(thread)
        stated = timeout_s if stated_s is None else stated_s
        raise CommitTimeoutError(f"{what} did not answer within {stated:g}s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _bounded_listing(found: dict[str, Any], where: str) -> dict[str, Any]:
    if len(found) > MAX_LISTED_OBJECTS:
        raise FileTooLarge(
            errno.EFBIG, f"lists more than {MAX_LISTED_OBJECTS} objects; refused", where
        )
    return found


def _listed_name_ok(name: str, where: str) -> bool:
    """Whether an object name of a listing may stand for a file of a step; one that may not
    (`..`, control characters: anyone may write the bucket) is skipped with a warning."""
    problem = relative_path_problem(name)
    if problem is not None:
        logger.warning("skipping object %s under %s: %s", printable(name), where, problem)
    return problem is None


def _with_defaults(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    # Other processes write the same prefix: a cached listing would hide their objects.
    options.setdefault("skip_instance_cache", True)
    options.setdefault("use_listings_cache", False)
    if protocol in ("s3", "s3a"):
        config = dict(_S3_CONFIG_DEFAULTS)
        config.update(options.get("config_kwargs") or {})
        options["config_kwargs"] = config
    elif protocol == "file":
        options.setdefault("auto_mkdir", True)
    return options


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


# Reads of a transfer go in blocks of this size (s3fs's default is 5 MiB).
_READ_BLOCK = 50 << 20

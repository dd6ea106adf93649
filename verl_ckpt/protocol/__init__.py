"""The save protocol of verl_ckpt, on one page. Every other docstring points here.

Participants: every rank of every role (a `CheckpointManager` each), the driver (its own
state, through `CheckpointCoordinator`), and the finalizer (one Ray actor per root).
Each numbered step says who runs it, where, its deadline, its fault phase
(`VERL_CKPT_FAULT`, see faults.py), what is durable once it is done, and how a crash there
is recovered, after an actor restart (Ray restarts the finalizer; ranks keep going) and
after a whole-job restart (everything killed, the job started again).

 0. start             driver, before Ray starts (`startup.prepare_start`).
                      Validates the config, locks the root (one job per root; the lock dies
                      with its holder), recovers it (finishes an interrupted rollback, rolls
                      the tracker forward to the newest committed step), resolves the resume
                      step and refuses one older than the newest committed step. Writes
                      nothing but the lock and the recovery; deletes nothing, ever.
    verify resume     driver, same place, before any state is touched (`resume_check.py`).
                      `resume_verify`: the record and every file's size, or every checksum
                      (all cores). A failing step is an error naming the file, or with
                      `resume_fallback=previous` it is renamed into <root>/quarantine/ (never
                      deleted) BEFORE the tracker moves back to the newest older step that
                      verifies (else the roll-forward above would bring it back).
                      Crash between the rename and the tracker: the tracker names a missing
                      step; the next start with `previous` falls back the same way.
                      With a remote tier holding the failing step committed, its copy is
                      downloaded and verified beside the root first, then the local copy is
                      quarantined and the download renamed into its place: the run resumes
                      from the same step. A fallback below the remote tier's newest
                      committed step is refused before anything moves (its uploads would go
                      over it), naming `verl-ckpt rollback URL --to N --delete`.
    start finalizer   driver (`finalizer_client.start_finalizer`); the actor recovers the
                      root the same way and writes the root marker that ranks read back.

 1. plan              rank, training thread. Deadline: timeout_s.
                      Agree with the save group (group_agreement: a monitored barrier and
                      one all-gather on a private gloo group, from the rank's agreement
                      thread; none for a group of one rank). A rank whose plan is cached
                      does not wait for the outcome: its save thread checks it before
                      begin_step, and every rank fails if one disagrees. Then
                      `begin_step` on the finalizer, with the save's id: it waits while
                      max_in_flight steps are uncommitted, removes an uncommitted leftover
                      of the step, creates the directory (marked with the job's run id).
                      Refused, in one line: a committed, failed or lost step (a step number
                      is saved once) and a second save of a step this participant already
                      reported. A refusal of a failed step on the save thread ends that
                      save quietly: not the rank's own failure, it must not fail the next
                      step when raised by the next save(). Then validate sharding and
                      build the DCP plan (cached while the structure holds).
                      Durable: an empty step directory.
                      A save() that raises before this (an earlier failure, raised once
                      instead of saving) reports a failure for its step at once.
                      With a cached plan (no collective left), the agreement's check and
                      begin_step run on the save thread while step 2 copies, and the plan
                      after it: the trainer never waits for an earlier step's commit or
                      retention (the back-pressure still holds).
                      Crash: the directory is an uncommitted leftover, removed when the step
                      is saved again.
 2. stage             rank, training thread (the only other blocking part).
                      Copy every tensor into reused host buffers (or reference host tensors
                      that are provably not changed in place until the write ends: version
                      counters, and quiet()/fence_before/load() wait for those writes), and
                      deep-copy the non-tensor state (rank 0's common.pt part; the
                      non-tensor shards when planning moves off this thread).
                      `save()` returns here. Durable: nothing.
 3. write             rank, writer threads or the writer process. Deadline: timeout_s from
                      save(). Fault phase `write`. Each file is written, checksummed as the
                      bytes pass, fsynced. Durable: the rank's files of the step.
                      Crash: the step never commits (see 5); leftovers as in 1.
 4. report            rank, its save thread. Fault phase `report`. Deadline: timeout_s.
                      A `RankReport` (files with sizes and checksums, DCP write results, or
                      a typed `Failure`) to the finalizer. The finalizer learns completion
                      from reports only, never from collectives (I6). A report of a save
                      that a newer save of the same participant replaced is ignored. A step
                      still missing reports `timeout_s` + 2 x RPC_SLACK_S after its last
                      begin_step fails, naming who is missing (back-pressure never waits on
                      a participant that died or never saved it).
                      A failed step's directory is deleted (as in 7, from the finalizer's
                      commit thread) once nobody writes into it: every save that began it
                      reported, or its deadline passed. Never one holding a commit record.
                      Actor restart: the reports of this job's steps in flight are lost; the
                      restarted finalizer refuses them and those steps never commit (an
                      earlier job's leftovers are plain leftovers, saved over).
 5. commit record     finalizer, its commit thread, once every expected report succeeded.
                      Fault phase `commit` (before the record). Completes each role's
                      torch_dist directory (.metadata, metadata.json), fsyncs, then writes
                      the commit record atomically. A role's .metadata is made while its
                      ranks write, from its last commit's reports, and used only if every
                      rank reported byte-identical inputs (metadata_forecast; never
                      waited for). THE COMMIT POINT: from here the step is
                      committed, whatever happens next.
                      Crash before: the step is lost (uncommitted leftover).
                      Crash after: both restarts roll the tracker forward to it (step 0).
 6. tracker           finalizer, commit thread. Fault phase `tracker` (before the rename).
                      Atomic replace of latest_checkpointed_iteration.txt, never backwards.
                      An error before the rename withdraws the record (the step failed, and
                      disk says so); nothing un-commits a step after the rename.
                      Crash: rolled forward at the next start (actor or job).
 7. retention         finalizer, commit thread, after the tracker moved. Fault `delete`.
                      Committed steps beyond max_ckpt_to_keep leave the step namespace by
                      one atomic rename, lose their record, then their files. Never the
                      tracker's target, never a step in flight, never at start-up.
                      A failure is logged and retried after the next commit; the step
                      stays committed. Crash: the `.deleting_*` leftover is removed by the
                      next retention.

 E. export            finalizer's export queue (hf/scheduler.py), queued when the commit is
                      recorded (before retention, which keeps queued and exporting steps);
                      the work runs in a Ray task of its own (hf/export.py), one at a time,
                      for each role in checkpoint.hf_export.architectures when save_contents
                      has hf_model. Deadline: timeout_s. Fault phase `export`. Reads the role's
                      committed torch_dist directory and verl_ckpt_model.json (written by the
                      role's rank 0 in step 3, committed in step 5), writes safetensors and
                      config.json into `<role>/.huggingface.tmp.*`, then the export record
                      (every file's size and checksum) last, then renames the directory to
                      `<role>/huggingface/`. Never on the commit path: the tracker moved in 6,
                      and a failed export (logged, in status(), returned by
                      wait_for_exports) leaves the step committed. Crash: the temporary
                      directory is removed by the next export of that role; `verl-ckpt export`
                      writes any export that is missing. A waiting step superseded by a newer
                      commit is skipped (logged), so exports never pile up.
 S. stop (preemption) driver, at a step boundary (`preemption.py`). A signal of
                      `preemption.signals` (the handler only records it; a second one changes
                      nothing) or the deadline in `preemption.deadline_env` coming near: the
                      step under way finishes, every role and the driver save it out of
                      schedule (steps 1-7 as for any save, every wait ending at the stop's
                      deadline: `grace_s` after the signal), the driver waits for its commit,
                      logs one line, finishes as usual and exits with status 75. Past the
                      deadline: an error naming who is missing (exit 1). A SIGKILL at any
                      point: the step is an uncommitted leftover (as in 1); the previous
                      committed step stays the tracker's.

The remote tier (only with checkpoint.remote.url; verl_ckpt/remote/) is a second commit
protocol with the same guarantees, run after the local one and never delaying it:

 0'. start (remote)   driver, before Ray starts (`remote/startup.py`, from prepare_start).
                      The URL takes a write (probe object put and removed) within 60 s, or
                      one line names it; every later store call of the start ends within
                      min(60 s, timeout_s) too, or one line names the object (s3fs's own
                      retries would multiply the client's read timeout into minutes); the
                      download within timeout_s. Its newest committed step (readable record)
                      is read; with resume_mode=auto, a remote tracker naming a step newer
                      than the root's newest whose record is missing or does not read is an
                      error naming the object (never a silent older or fresh start).
                      resume_mode=auto downloads the newest step into the root when it is
                      newer than the root's newest (`remote/pull.py`: files verified into
                      `.pulling_global_step_<N>/`, record last, one rename), and recovery
                      rolls the tracker forward to it; unless `verl-ckpt rollback` moved that
                      very save out of the root (<root>/.verl_ckpt_rolled_back.json holds its
                      step and record hash): then the start is refused, naming
                      `verl-ckpt rollback URL --to N --delete` (newer remote steps deleted
                      record first, then the remote tracker moved back: one PUT).
                      The finalizer rolls the remote tracker forward at every start.
 8. upload            each rank, its upload thread (never the training or save thread), after
                      its report (4). Fault phase `upload`. Deadline: timeout_s.
                      Waits for the finalizer's word that the step committed locally
                      (`upload_turn`, report-based: I6) and whether it is uploaded
                      (remote.every). Before that word, the finalizer removes a remote
                      commit record of the step that differs from the local one (another
                      save of the step, left by a rollback or a fallback; logged): objects
                      are never written under a record that is not theirs, and a failure
                      half-way leaves the remote step uncommitted, never committed-but-mixed
                      (commit_remote_step, step 9, checks the same). Then the rank
                      uploads its own files in parallel,
                      multipart, each completed only if the bytes sent match its reported
                      checksum, and reports the paths it confirmed (`UploadReport`).
                      save() waits only while remote.max_in_flight uploads are pending.
                      Local retention skips steps being uploaded and runs again after.
                      Crash or failure: the finalizer uploads what no rank confirmed (9).
                      Finalizer restart: steps committed before it are not uploaded by the
                      ranks; a newer step, or the end of the run, catches up.
 9. remote record     finalizer, a thread, one remote commit at a time, once every rank
                      reported (or at the deadline). Uploads the files no rank confirmed
                      (driver state, each role's .metadata and metadata.json, a failed
                      rank's), lists the step and checks every file's size, then uploads the
                      commit record: THE REMOTE COMMIT POINT.
                      Failure before: logged, nothing remote looks committed (no record);
                      the next upload catches up (a newer step, or the last committed step,
                      uploaded whole by `drain_uploads` at the end of a run).
10. remote tracker    finalizer, after the record: one PUT of "N\n" (atomic on object
                      stores; tmp + rename on file://), never backwards.
                      Crash before: rolled forward by the next finalizer start.
11. remote retention  finalizer, after the remote tracker: committed steps beyond remote.keep
                      (only readable records count; a step whose record does not read is
                      neither counted nor deleted) lose their record, then their objects;
                      leftovers of failed uploads
                      older than the newest remote commit are removed. Never the remote
                      tracker's target, never a step being uploaded. Failures are logged and
                      retried after the next remote commit.
    end of a run      driver (`CheckpointCoordinator.wait_for_uploads`): the newest committed
                      step is uploaded (whole, if its ranks skipped or failed it), and every
                      upload under way awaited, within timeout_s.

The finalizer's bookkeeping (which reports arrived, which step is committing) is
`ledger.StepLedger` (`remote.ledger.UploadLedger` for uploads); steps 5-7 and the recovery
of step 0 are plain functions on a directory in `commit.py` and `recovery.py` (9-11 on a
store in `remote/tier.py`), step E lives in `hf/`; the actor (`finalizer.py`) only connects
them.
"""

from verl_ckpt.protocol.deadlines import RPC_SLACK_S, call_deadline, deadline_in, time_left
from verl_ckpt.protocol.phases import Failure, Phase, describe_failures

__all__ = [
    "RPC_SLACK_S",
    "Failure",
    "Phase",
    "call_deadline",
    "deadline_in",
    "describe_failures",
    "time_left",
]

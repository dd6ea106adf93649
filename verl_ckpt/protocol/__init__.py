"""The save protocol of verl_ckpt, on one page: a contract. Every other docstring points here.

Participants: every rank of every role (a `CheckpointManager` each), the driver (its own
state, through `CheckpointCoordinator`: it begins, writes and reports like a rank, on its
own thread), the participants declared to the coordinator (any Ray actor: a
`StateParticipant` each; see "Declared participants" below) and the finalizer (one Ray
actor per root, restarted by Ray). Function names are
relative to `verl_ckpt.`; tests/test_protocol_page.py imports every one of them and checks
the phases against `Phase` (protocol/phases.py, the only list). Details and edge cases live
in the docstrings of the modules named.

Who runs each step, on which thread, its deadline and its fault phase (`VERL_CKPT_FAULT`,
protocol/faults.py; "-": no hook):

 step | name              | who, thread                            | deadline             | phase
 0    | start             | driver, before ray.init                | -                    | -
 0'   | remote start      | driver, inside step 0                  | min(60 s, timeout_s) | -
 1    | plan              | rank: training thread, or save thread  | timeout_s            | plan
 2    | stage             | rank: training thread, or save thread  | -                    | stage
 3    | write             | rank: writer threads or writer process | timeout_s from save  | write
 4    | report            | rank: save thread; finalizer's loop    | timeout_s from save  | report
 5    | commit record     | finalizer: commit thread               | -                    | commit
 6    | tracker           | finalizer: commit thread               | -                    | tracker
 7    | retention         | finalizer: commit thread               | -                    | delete
 E    | export            | finalizer's queue, a Ray task          | timeout_s            | export
 8    | upload            | rank: upload thread                    | timeout_s from start | upload
 9    | remote record     | finalizer: remote thread               | timeout_s            | -
 10   | remote tracker    | finalizer: remote thread               | timeout_s a call     | -
 11   | remote retention  | finalizer: remote thread               | timeout_s a call     | -
 S    | stop (preemption) | driver, at a step boundary             | grace_s from signal  | -

Phase `rollback` fires in `verl-ckpt rollback` (store.rollback.execute_rollback), outside a save.

The code that does each step:

 step | function
 0    | startup.prepare.prepare_start, store.recovery.recover_root,
      | startup.resume_check.settle_resume_step, commit.client.start_finalizer
 0'   | startup.remote.check_remote_start, startup.remote.fetch_newer_remote_step
 1    | rank.agreement.agree_on_save, format.megatron_compat.validate_sharding,
      | commit.finalizer.CheckpointFinalizer.begin_step, format.megatron_compat.plan_save,
      | commit.participant.ParticipantLink.begin, commit.aggregator.ReportAggregator.begin,
      | commit.finalizer.CheckpointFinalizer.begin_batch, commit.admission.Admission.begin_steps
 2    | rank.snapshot_plan.split_live, rank.staging.copy_into,
      | participants.state_copy.stage_state
 3    | store.checksummed_file.write_checksummed, format.file_writer.write_bucket,
      | participants.saver.StateParticipant.save
 4    | commit.participant.ParticipantLink.report, commit.finalizer.CheckpointFinalizer.report,
      | commit.intake.ReportIntake.take, commit.ledger.StepLedger.record,
      | commit.batcher.NodeBatcher.submit, commit.aggregator.ReportAggregator.report_batch,
      | commit.finalizer.CheckpointFinalizer.report_batch, commit.intake.ReportIntake.take_batch
 5    | commit.committer.Committer.start_commit, commit.steps.commit_step
 6    | store.tracker.move_tracker
 7    | store.retention.apply_retention, store.retention.delete_step
 E    | hf.scheduler.ExportQueue.submit, hf.export.export_role
 8    | remote.rank_uploader.RankUploader.submit, remote.transfer.copy_files
 9    | remote.tier.commit_remote_step
 10   | store.tracker.move_tracker
 11   | store.retention.apply_retention, remote.finalizer_tier.RemoteTier.protected
 S    | driver.preemption.PreemptionGuard.stop_requested, driver.preemption.commit_before_deadline

What is durable once each step is done, and what a crash there leaves (an actor restart:
Ray restarts the finalizer, ranks go on; a job restart: everything killed and started again):

 step | durable once done                | after a crash there
 0    | the lock; the roll-forward       | the next start does it again
 0'   | a pulled step (one rename)       | `.pulling_*` replaced by the next pull
 1    | an empty step directory          | an uncommitted leftover, removed when saved again
 2    | nothing                          | as 1
 3    | the rank's files, fsynced        | as 1: the step never commits
 4    | nothing (the finalizer's memory) | actor restart: this job's steps in flight are lost
 5    | the commit record: COMMIT POINT  | before: as 1; after: rolled forward at start (6)
 6    | the tracker names the step       | rolled forward at the next start (actor or job)
 7    | old steps gone: rename, delete   | `.deleting_*` removed by the next retention
 E    | `<role>/huggingface/`, record    | `.huggingface.tmp.*` removed by the next export
 8    | the rank's objects, no record    | the finalizer uploads what no rank confirmed (9)
 9    | remote record: COMMIT POINT      | before: nothing remote is committed; caught up later
 10   | the remote tracker names it      | rolled forward at the next finalizer start
 11   | old remote steps gone            | retried after the next remote commit
 S    | the step under way, committed    | SIGKILL: as 1; the tracker keeps the previous step

Order, as the code runs it:
- Step 0 runs before Ray starts: config and root checks, the root lock, recovery (finish an
  interrupted rollback, roll the tracker forward), the resume step chosen and verified
  (a failing one quarantined before the tracker moves back). It deletes nothing. After
  ray.init the driver starts the finalizer, which recovers the root the same way and writes
  the root marker every rank reads back.
- save() first waits for room (max_in_flight writes, remote.max_in_flight uploads; an
  earlier failure is raised there, once, and reported for this step at once). Then step 1:
  the save group's agreement (step, root, plan still fits) on a private gloo group, then,
  when the plan is not cached, sharding validation (a collective on the save group), both
  before `begin_step`: ranks that disagree fail before any directory exists. `begin_step`
  waits while max_in_flight steps are uncommitted (retention included) and removes an
  uncommitted leftover of the step.
- Plan not cached (first save, changed structure): agreement, validation and begin_step on
  the training thread, then the copy (2), then the DCP plan over the copies (a collective).
  Just before the plan's gather every rank states on the agreement's group that it is ready
  (a rank that failed since the agreement states that it withdraws): no rank waits in the
  trainer group's gather for a peer that will never join it.
- Plan cached (and a background writer): the training thread only copies (2); the save
  thread checks the agreement's outcome, calls begin_step and plans beside the copy, and
  writes once the copy ended. Deferred snapshot: save() returns before the copy; the save
  thread copies first, then agreement, begin_step, plan. Either way save() never waits for
  an earlier commit. Live snapshot: as deferred, but host tensors are not copied: the
  writers read the trainer's memory (rank.snapshot_plan.live_candidates), and fence()
  opens only once they are written (I4), so the fence waits for all of the above.
  With async_save=false (writer inline) save() runs steps 1-4 itself and returns after 4.
- Steps 3-4 follow on the save thread; the finalizer learns completion from reports only,
  never from collectives (I6). A step still missing reports timeout_s + 2 x RPC_SLACK_S
  after its last begin_step fails, naming who is missing; a failed step's directory is
  deleted once nobody writes into it (commit.ledger.StepLedger.discardable).
- Steps 5-7 run on the finalizer's commit thread, one step at a time; E and 8 are queued at
  the commit, before retention, which keeps steps being exported or uploaded.

Declared participants (verl_ckpt/participants/, docs/participants.md): the driver declares
them to the coordinator, `participants={name: count}`, fixed when the finalizer starts (the
finalizer's `state_participants`, one more entry of its table of expected reports: its
ledger names them "<name>[<index>]"). Each index saves as a rank does, off its caller's
path: save() copies the state (2: tensors to the host, containers rebuilt; only what
torch.load(weights_only=True) reads back) and returns; its save thread calls begin_step
(1), writes `<step>/<name>/state_<index>.pt` fsynced and checksummed (3) and reports it
(4), or reports the failure; `skip(step, why)` fails the step at once. The commit (5)
expects no `.metadata` of theirs; the commit record lists them in `state_participants`
(name -> count, beside `participants`: the roles and the driver), written only when there
are some. A step missing one of their reports at its deadline fails naming it. The remote
tier's finalizer uploads their files with the driver's (8-9); retention, rollback, verify
and pull treat them as any file of the step. At start-up a resume step holding a
participant the run does not declare, or another count of one, is refused in one line
(startup.resume_fit.check_participants_fit); a participant new to the step starts empty.

The commit point is the durable commit record (5): from a crash after it, every restart
rolls the tracker forward to the step. Until the tracker's rename the finalizer itself may
withdraw the record, so that disk agrees with the failure it reports: a record renamed but
not made durable (its directory's fsync failed), or a tracker write that failed before its
rename (6). Where even the withdrawal fails, the step stays committed. After the tracker's
rename nothing un-commits a step; retention (7) never deletes the tracker's target, a step
in flight, or anything at start-up, and does not run after a commit whose record or tracker
move was not made durable (a power loss could bring back the step before). The remote tier
(8-11, verl_ckpt/remote/) repeats this after the local commit and never delays it: record
last, then tracker, never backwards; there a failed tracker PUT never withdraws the record
(it may have landed), and the local tier's fault phases do not fire.

With checkpoint.signing (store/signing.py, docs/signing.md) the record of 5 is signed with
the run's key (9 uploads the same bytes), and steps 0, 0' and 7 and the CLI trust only a
record one of the accepted keys signed: an unsigned one is not committed for them, refused
before any other file of its step is read.
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

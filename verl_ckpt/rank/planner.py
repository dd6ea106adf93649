"""Step 1 (plan) on one rank (protocol/__init__.py): agree with the save group, begin the
step on the finalizer, build the DCP plan, and keep it while the structure holds.

Every collective of a save runs in `layout()`, on the training thread. A rank whose plan is
cached goes ahead without waiting for its peers: its statement goes out once save() has
composed the job, and the save thread checks the group's statements before begin_step.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from verl_ckpt.commit.participant import ParticipantLink
from verl_ckpt.format import megatron_compat
from verl_ckpt.format.structure import Structure, describe_structure
from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.rank.agreement import SaveAgreement, Statement, check_went_ahead, plan_reusable
from verl_ckpt.rank.copy_progress import write_order
from verl_ckpt.rank.save_job import DOING_AGREEMENT, DOING_BEGIN, Layout, SaveJob

__all__ = ["StepPlanner"]


class StepPlanner:
    """The plan cache and the agreement of one rank. `goes_ahead`: a rank with a save thread
    may go ahead on its cached plan (without one, every step runs in save())."""

    def __init__(
        self,
        config: CheckpointConfig,
        group: dist.ProcessGroup | None,
        root: Path,
        agreement: SaveAgreement,
        link: ParticipantLink,
        goes_ahead: bool,
    ) -> None:
        self._config = config
        self._group = group
        self._root = root
        # The root as a number the save group can compare in one integer all-gather.
        self._root_id = int.from_bytes(hashlib.sha256(str(root).encode()).digest()[:7])
        self._agreement = agreement
        self._link = link
        self._goes_ahead = goes_ahead
        self._plan_cache: megatron_compat.SavePlanCache | None = None
        # The step for which this rank owes its save group a second statement (ready_to_plan,
        # or withdraw_from_plan if it failed first): set once the agreement's verdict is that
        # the plan gathers over the trainer's group, which every rank reaches alike.
        self._ready_owed: int | None = None

    @property
    def statements_made(self) -> int:
        return self._agreement.statements_made

    # ---- the training thread: the collectives ---------------------------------------------

    def layout(self, step: int, state: dict, go_ahead: bool = True) -> Layout:
        started = time.perf_counter()
        sharded, common, items = megatron_compat.split_common_state(state)
        structure = describe_structure(items)
        # Agreement comes before begin_step: ranks that disagree on the step or the root fail
        # together before any directory or file exists.
        reuse, statement = self._agree_with_group(step, structure, go_ahead)
        cache = self._plan_cache if reuse else None
        distribution = None
        if self._config.fully_parallel_save:
            distribution = megatron_compat.spread_main_replicas(
                sharded, self._group, cache.replica_distribution if cache else None
            )
        if not reuse:
            megatron_compat.validate_sharding(items, self._group)
        seconds = time.perf_counter() - started
        return Layout(
            step, sharded, common, items, structure, reuse, distribution, seconds, statement
        )

    def _agree_with_group(
        self, step: int, structure: Structure, go_ahead: bool
    ) -> tuple[bool, Statement | None]:
        """State the step, the root and whether the cached plan fits (rank/agreement.py).
        Returns whether the plan is reused, and, if this rank goes ahead on its cached plan,
        the statement it will make (state_went_ahead; only the save thread waits for the
        others). A rank that plans over the group makes it now and waits for the outcome."""
        cached = self._plan_cache is not None and self._plan_cache.structure == structure
        ahead = go_ahead and cached and self._goes_ahead
        statement = Statement(step, self._root_id, cached, ahead)
        if ahead:
            return True, statement
        statements = self._agreement.outcome(self._agreement.start(statement))
        reusable = self._judge(plan_reusable, statements)
        reuse = self._config.assume_constant_structure and reusable
        # Owed from here on when the plan gathers: the collectives that follow (the
        # sharding's validation, on rank 0 only) may fail on one rank and not on its peers.
        self._ready_owed = None if reuse else step
        return reuse, None

    def _judge(self, verdict: Callable[[list[Statement], str], Any], statements: list) -> Any:
        """`verdict` (plan_reusable, check_went_ahead) on the group's statements. A mixed
        verdict drops the cached plan: the next save then plans over the group on every
        rank, instead of failing again wherever one rank's cache (a plan that failed there
        after its gather) differs from its peers'."""
        try:
            return verdict(statements, self._link.role)
        except CheckpointError:
            self._plan_cache = None
            raise

    def withdraw(self, step: int, statements_before: int) -> None:
        """This rank's save (or prepare()) of `step` failed: make the statement its peers
        still wait for (rank/agreement.py). None made since `statements_before`: that it
        does not save the step; else, if the plan gathers, that it will not join it."""
        if self.statements_made == statements_before:
            self.state_withdrawn(step)
        else:
            self.withdraw_from_plan()

    def state_went_ahead(self, layout: Layout) -> None:
        """Make the statement of a rank that went ahead, once (rank/agreement.py). Made last in
        save(), when the job is composed: the agreement thread's collective then runs while
        the save returns (and the deferred copy, or the copy, runs), instead of taking the
        interpreter from the training thread in the middle of save()."""
        if layout.statement is not None and layout.agreement is None:
            layout.agreement = self._agreement.start(layout.statement)

    def state_withdrawn(self, step: int) -> None:
        """save(step) failed on this rank before it stated anything: state that it does not
        save the step (rank/agreement.py). Its peers that went ahead wait for a statement in a
        collective; never made, this rank's next statement would pair with theirs for this
        step, and every later step of the role would fail."""
        self._agreement.start(Statement(step, self._root_id, False, False, withdrawn=True))

    def ready_to_plan(self, step: int) -> None:
        """Just before the plan's gather on the trainer's group (plan_save's before_gather,
        which runs on every path a rank that owes it takes: an owed plan is never cached):
        state that this rank began the step, copied and converted its state, and wait until
        every rank of the group did. Between the agreement and this point a rank may fail
        (begin_step refused, the copy failed, Ctrl-C): it states that it withdraws
        (withdraw_from_plan), and its peers end here with StepNotCommittedError, instead of
        waiting in a collective it never joins until the trainer group's own timeout (and
        then raising that instead of the step's failure)."""
        # Only the debt of this very step: the save thread plans cached steps too, while the
        # training thread may owe the next step's statement already.
        if self._ready_owed != step:
            return
        # Made, then cleared: an interrupt between the two leaves the debt to withdraw_from_plan,
        # which then states the withdrawal its peers wait for (never neither statement).
        pending = self._agreement.start(Statement(step, self._root_id, plan_cached=False))
        self._ready_owed = None
        self._agreement.outcome(pending)

    def withdraw_from_plan(self) -> None:
        """This rank's save failed after the agreement and before ready_to_plan: state that
        it withdraws, without waiting (its peers wait for the statement; rank/agreement.py)."""
        step = self._ready_owed
        if step is not None:
            self.state_withdrawn(step)
            self._ready_owed = None  # after the statement went out (as in ready_to_plan)

    def plan_ahead(self, layout: Layout) -> None:
        """prepare(): the plan depends on the structure only: planned over the live tensors,
        nothing is written, and the first save reuses it. DCP's planning makes the directory
        it plans for: a scratch one, not a stray entry in the checkpoint root."""
        with tempfile.TemporaryDirectory(prefix="verl_ckpt_plan_") as scratch:
            prepared = megatron_compat.plan_save(
                layout.sharded,
                Path(scratch) / "plan",
                self._group,
                self._config.writer.threads,
                layout.structure,
                self._plan_cache if layout.reuse_plan else None,
                layout.distribution,
                before_gather=lambda: self.ready_to_plan(layout.step),
            )
        if self._config.assume_constant_structure:
            self._plan_cache = prepared.plan_cache

    # ---- either thread: begin_step and the plan -------------------------------------------

    def agree_and_begin(self, job: SaveJob) -> None:
        """On the save thread: every rank's statement fits (the rank went ahead on its cached
        plan), and only then begin_step: ranks that disagree fail before any directory
        exists."""
        if job.layout.agreement is not None:
            job.stats.doing = DOING_AGREEMENT
            waited = time.perf_counter()
            self._judge(check_went_ahead, self._agreement.outcome(job.layout.agreement))
            job.stats.agree_s = time.perf_counter() - waited
        job.stats.doing = DOING_BEGIN
        self.begin(job)

    def begin(self, job: SaveJob) -> None:
        """Step 1's begin_step on the finalizer: the step's directory for this rank."""
        started = time.perf_counter()
        job.directory = self._link.begin(job.step, job.save_id)
        job.stats.begin_s = time.perf_counter() - started

    def plan(self, job: SaveJob) -> None:
        """Step 1's plan over the copies, into the step's directory: gathered over the group
        (training thread only) unless the cached plan is reused (no collective)."""
        started = time.perf_counter()
        job.prepared = megatron_compat.plan_save(
            job.layout.sharded,
            job.directory,
            self._group,
            self._config.writer.threads,
            job.layout.structure,
            self._plan_cache if job.layout.reuse_plan else None,
            job.layout.distribution,
            # Once the local conversion is done: a rank that fails in it withdraws instead.
            # A reused plan gathers nothing and owes nothing: the save thread, which plans
            # only those, never touches the training thread's debt.
            before_gather=None if job.layout.reuse_plan else lambda: self.ready_to_plan(job.step),
        )
        job.stats.plan_converted = job.prepared.converted
        if self._config.assume_constant_structure:
            self._plan_cache = job.prepared.plan_cache
        if self._config.writer.write_while_copying:
            # The next save's copy fills the buffers in the order these writes read them
            # (only an order: without writes beside the copy it makes no difference).
            slot = job.copy.slot
            slot.write_order = write_order(job.prepared.write_buckets, slot.buffers)
        job.stats.plan_s = job.layout.seconds + (time.perf_counter() - started)

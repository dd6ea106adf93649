"""What the recipe's driver decides about a resume before Ray starts, from the start plan
(`verl_ckpt.prepare_start`, protocol step 0) and the files of the resume step alone.

- Nothing to do: the resume step already reaches `trainer.total_steps`. Said in one line and
  the run ends, instead of after some 40 s of Ray and worker start-up. Not with a remote
  tier: a run that ends also uploads the newest committed step if the last run could not,
  and that takes the finalizer.
- Dropped state: each part of a role's saved state that this run does not load
  (`checkpoint.load_contents`) is one warning line naming the role, the part and why; a
  change of a role's rank count, which rules out its per-rank state, is named with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import verl_ckpt
from verl_ckpt.startup.resume_fit import saved_parts

__all__ = ["PART_NAMES", "dropped_state", "nothing_to_do"]

# What each part of `checkpoint.load_contents` is, and what a run that skips it starts from.
PART_NAMES = {
    "model": ("model weights", "the model starts from its initialisation"),
    "optimizer": ("optimizer state", "the optimizer starts fresh"),
    "extra": ("extra state (RNG)", "its random streams start from trainer.seed"),
}


def nothing_to_do(start: verl_ckpt.StartPlan, total_steps: int) -> int | None:
    """The resume step when it already reaches `total_steps` and the run can end here;
    None: the run has steps to train (or a remote tier to bring up to date)."""
    if start.resume_dir is None or start.config.remote.url is not None:
        return None
    step = verl_ckpt.step_of_dir(start.resume_dir)
    return step if step is not None and step >= total_steps else None


def dropped_state(
    resume_dir: Path | None, roles: Mapping[str, int], load_contents: Iterable[str]
) -> list[str]:
    """One line per role and part saved in the committed step `resume_dir` (None: a fresh
    start) that `load_contents` leaves out; `roles`: each role's ranks in this run."""
    if resume_dir is None:
        return []
    path = Path(resume_dir)
    wanted = list(load_contents)
    record = verl_ckpt.read_commit_record(path)
    lines = []
    for role, ranks in roles.items():
        saved_ranks = record.role_world_size(role)
        for part in sorted(saved_parts(path / role) - set(wanted)):
            what, consequence = PART_NAMES[part]
            why = f"checkpoint.load_contents={wanted} leaves it out"
            if part == "extra" and saved_ranks not in (None, ranks):
                why += (
                    f"; saved by {saved_ranks} ranks, this run has {ranks}: per-rank state "
                    "cannot be resharded"
                )
            lines.append(
                f"resume from step {record.step}: {role}: {what} not loaded ({why}); {consequence}"
            )
    return lines

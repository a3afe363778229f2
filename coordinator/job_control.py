"""A job's end: the step it ends at, `atoll job stop` and `atoll job extend`, and when it finished.

Decisions are pure functions of (the job's target, the newest step reported, the control record, now). The
nodes learn the target from every step acknowledgement (`StepAck.target_steps`) and end there, after a
checkpoint; since step reports travel off the critical path and a pipeline's stages are a few steps apart, a
stop ends `STOP_MARGIN` steps past the newest step reported (so every stage hears it before it gets there),
and an extension is refused once the job is within `EXTEND_MARGIN` steps of its end (a stage may have
finished already).
"""

from __future__ import annotations

from dataclasses import replace

from atoll.coordinator.store import JobControlRecord

STOP_MARGIN = 4
"""Steps past the newest reported step at which a stopped job ends: the in-flight window between stages (2) and
the reports still on their way."""
EXTEND_MARGIN = 4
"""An extension needs the job at least this many steps from its end."""
MAX_TARGET_STEPS = 10**9
"""Largest target an extension may reach."""


class ControlRefused(ValueError):
    """A stop or extension that cannot be done now; the message says why and what to do instead."""


def target_steps(spec_steps: int, control: JobControlRecord) -> int:
    """The step the job ends at: the spec's, unless `atoll job stop/extend` changed it."""
    return control.target_steps or spec_steps


def _newest(newest_step: int | None) -> str:
    return "no step reported yet" if newest_step is None else f"the newest reported is step {newest_step}"


def stop(control: JobControlRecord, *, spec_steps: int, newest_step: int | None, now: float
         ) -> tuple[JobControlRecord, str]:
    """`atoll job stop`: end `STOP_MARGIN` steps after the newest reported step (never later than the target).
    Steps are named by index, as the logs and `atoll status` name them (step 0 is the first); a checkpoint by the
    steps it follows, as its folder and `atoll export --step` name it."""
    target = target_steps(spec_steps, control)
    if control.finished_unix:
        raise ControlRefused(f"the job already finished after step {target - 1} ({target} steps); nothing to stop")
    newest = -1 if newest_step is None else newest_step
    end = min(target, newest + 1 + STOP_MARGIN)
    how = (f"the job stops after step {end - 1} ({_newest(newest_step)}), with a checkpoint of its {end} steps "
           f"(step-{end:08d}); the nodes then exit") if end < target else \
        (f"the job already ends after step {target - 1} ({_newest(newest_step)}), within {STOP_MARGIN} steps; it "
         f"stops there with a checkpoint of its {target} steps (step-{target:08d})")
    return replace(control, target_steps=end, stopped_unix=control.stopped_unix or now), how


def extend(control: JobControlRecord, steps: int, *, spec_steps: int, newest_step: int | None
           ) -> tuple[JobControlRecord, str]:
    """`atoll job extend --steps N`: the job ends N steps later."""
    if steps < 1:
        raise ControlRefused(f"extend by at least one step, got {steps}")
    target = target_steps(spec_steps, control)
    if control.finished_unix:
        raise ControlRefused(f"the job finished after step {target - 1}; to train on, `atoll export` its last "
                             f"checkpoint and start a new job from it (`pretrained = \"EXPORT_DIR\"` under [model], more "
                             f"steps), with a new coordinator --state-dir and new node --checkpoint-dir folders: the "
                             f"weights carry over, not the optimizer state")
    if control.stopped_unix:
        raise ControlRefused("the job is stopping (atoll job stop); it cannot be extended")
    newest = -1 if newest_step is None else newest_step
    if newest + 1 + EXTEND_MARGIN > target:
        raise ControlRefused(f"the job is at step {newest}, within {EXTEND_MARGIN} steps of its end after step "
                             f"{target - 1}: "
                             f"some stages may have finished; extend earlier, or start a longer job from the last "
                             f"checkpoint")
    new = target + steps
    if new > MAX_TARGET_STEPS:
        raise ControlRefused(f"a job of {new} steps is too long; extend by fewer steps")
    return replace(control, target_steps=new), (f"the job now ends after step {new - 1} instead of step {target - 1} "
                                                f"({_newest(newest_step)}); steps past the spec's "
                                                f"{spec_steps} train at the schedule's final learning rate")


def finished(control: JobControlRecord, *, complete: bool, now: float) -> JobControlRecord | None:
    """The record with the finish time set, when the job has just completed (`CoordinatorState.job_complete`:
    its last step reported; in outer mode, a replica group's last round); else None."""
    if control.finished_unix or not complete:
        return None
    return replace(control, finished_unix=now)


FINAL_CHECKPOINT_LEASES = 2.0
"""Leases a trained job waits for its final checkpoint once its writers trained their last step: a node writing it
is alive, so its report comes within a lease or two, or the node is gone."""


def finish_with_checkpoint(now: float, *, trained_unix: float, final_steps: set[int], done_steps: set[int],
                           writers_busy: bool, bound_s: float) -> tuple[bool, str]:
    """Whether a job whose last step was trained at `trained_unix` is finished at `now`: once a complete checkpoint of
    one of `final_steps` is held (none expected: at once), or, without it, once the writers are no longer training
    (`writers_busy`) and `bound_s` passed; with a reason ("" for the ordinary end)."""
    if not final_steps or done_steps & final_steps:
        return True, ""
    if writers_busy or now < trained_unix + bound_s:
        return False, f"waiting for the final checkpoint (step-{min(final_steps):08d})"
    newest = max(done_steps, default=0)
    held = f"step-{newest:08d}" if newest else "none"
    return True, (f"the job trained its steps but its final checkpoint (step-{min(final_steps):08d}) was not written "
                  f"within {bound_s:.0f}s: the newest complete checkpoint held is {held}; resume or export from that")


def job_state(control: JobControlRecord) -> str:
    """"finished", "stopping" (`atoll job stop` given) or "running"."""
    if control.finished_unix:
        return "finished"
    return "stopping" if control.stopped_unix else "running"

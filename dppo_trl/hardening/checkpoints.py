"""Checkpoints that are either complete or clearly not, and resumes that say when they are not exact.

`Trainer._save_checkpoint` writes `checkpoint-N` file by file (weights, optimizer, scheduler, RNG, and
`trainer_state.json` last). An interruption in between leaves a `checkpoint-N` that transformers'
`get_last_checkpoint` picks and that fails to resume. `staged_checkpoint` makes the Trainer write the whole checkpoint
under `_incomplete-checkpoint-N/` and renames it to `checkpoint-N` only once every rank is done, so a directory named
`checkpoint-N` is always complete. The leading `_` keeps a staging folder out of the Hub uploads of `push_to_hub`
(transformers ignores `_*`).

Generation cycles: GRPOTrainer generates one batch every `steps_per_generation * num_iterations` micro-steps and
trains on slices of it. The slices are not checkpointed, so a resume from a checkpoint inside a cycle regenerates
(see `docs/api.md`, "Checkpoints and resuming"): it is correct (μ comes with the new completions) but not the
uninterrupted run. The helpers here detect and report it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from fractions import Fraction

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

logger = logging.getLogger(__name__)

STAGING_PREFIX = "_incomplete-"
TRAINER_STATE_NAME = "trainer_state.json"
# transformers uploads the checkpoint folder itself in the background with these strategies: renaming it under the
# upload would break the push, so those checkpoints are written in place.
_HUB_STRATEGIES_UPLOADING_CHECKPOINTS = ("checkpoint", "all_checkpoints")


@contextlib.contextmanager
def staged_checkpoint(trainer, trial=None):
    """Run the Trainer's `_save_checkpoint` inside this block to write the checkpoint under a staging name.

    The Trainer's own code does all the writing; only its `_get_output_dir` is pointed at a staging folder for the
    duration. Afterwards the main process renames the finished checkpoint into place, points
    `state.best_model_checkpoint` at the final name, and applies `save_total_limit` (which the Trainer applied to
    the staging folder). On an exception or interrupt nothing is renamed: `_incomplete-checkpoint-N/` is left behind
    for the user to see, ignored by `get_last_checkpoint`, and replaced by the next save of step N.
    """
    args = trainer.args
    if args.push_to_hub and str(getattr(args.hub_strategy, "value", args.hub_strategy)) in (
        _HUB_STRATEGIES_UPLOADING_CHECKPOINTS
    ):
        yield
        return
    run_dir = trainer._get_output_dir(trial=trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staging_root = os.path.join(run_dir, STAGING_PREFIX + name)
    staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
    if args.should_save and os.path.exists(staging_root):
        shutil.rmtree(staging_root)  # left by an interrupted save of the same step
    trainer.accelerator.wait_for_everyone()

    trainer._get_output_dir = lambda trial=None: staging_root  # instance attribute: shadows the method for this save
    try:
        yield
    except OSError as error:
        # Disk full, quota, I/O error: say which save failed and what is still safe to resume from.
        latest = latest_complete_checkpoint(run_dir)
        raise OSError(
            error.errno,
            f"Saving checkpoint {final} failed while writing under {staging_root}: {error}. The staged folder is left "
            "incomplete (ignored on resume); "
            + (f"the last complete checkpoint is {latest}." if latest else "there is no complete checkpoint yet."),
        ) from error
    finally:
        del trainer._get_output_dir
    # Every rank writes into the checkpoint (its RNG state, its optimizer shard): rename only after all are done.
    trainer.accelerator.wait_for_everyone()
    if not args.should_save or not os.path.isdir(staged):
        return
    _publish(staged, final)
    shutil.rmtree(staging_root, ignore_errors=True)
    if trainer.state.best_model_checkpoint == staged:
        trainer.state.best_model_checkpoint = final
        trainer.state.save_to_json(os.path.join(final, TRAINER_STATE_NAME))
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _publish(staged: str, final: str) -> None:
    """Rename `staged` to `final`; an existing `final` (a re-save of the same step) is replaced after the rename."""
    replaced = None
    if os.path.exists(final):
        replaced = os.path.join(os.path.dirname(final), STAGING_PREFIX + "replaced-" + os.path.basename(final))
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(staged, final)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# Finding checkpoints
# ----------------------------------------------------------------------------------------------------------------
def checkpoint_step(path: str) -> int | None:
    """N of a `checkpoint-N` folder name, else None."""
    name = os.path.basename(os.path.normpath(path))
    prefix = PREFIX_CHECKPOINT_DIR + "-"
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


def is_complete_checkpoint(path: str) -> bool:
    """Whether `path` holds a resumable checkpoint: a readable `trainer_state.json`, which the Trainer writes last."""
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME), encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return True


def scan_checkpoints(output_dir: str) -> tuple[list[str], list[str]]:
    """`(complete, incomplete)` checkpoint folders of `output_dir`, each sorted oldest first.

    Incomplete ones are staging folders left by an interrupted save, and `checkpoint-N` folders without a readable
    `trainer_state.json` (written in place, e.g. by a plain `Trainer` or with a checkpoint-uploading `hub_strategy`).
    """
    if not os.path.isdir(output_dir):
        return [], []
    complete: list[str] = []
    incomplete: list[str] = []
    for entry in os.listdir(output_dir):
        path = os.path.join(output_dir, entry)
        if not os.path.isdir(path):
            continue
        if entry.startswith(STAGING_PREFIX):
            incomplete.append(path)
        elif checkpoint_step(entry) is not None:
            (complete if is_complete_checkpoint(path) else incomplete).append(path)

    def order(path: str) -> tuple[int, str]:
        step = checkpoint_step(path.split(STAGING_PREFIX)[-1].removeprefix("replaced-"))
        return (step if step is not None else -1, path)

    return sorted(complete, key=order), sorted(incomplete, key=order)


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest complete `checkpoint-N` of `output_dir` (by N), or None."""
    complete, _ = scan_checkpoints(output_dir)
    return complete[-1] if complete else None


# ----------------------------------------------------------------------------------------------------------------
# Generation cycles
# ----------------------------------------------------------------------------------------------------------------
def generation_cycle_micro_steps(args) -> int:
    """Micro-steps between two generations: GRPOTrainer's `_prepare_inputs` generates when
    `_step % (steps_per_generation * num_iterations) == 0`, `_step` counting `training_step` calls."""
    return args.steps_per_generation * args.num_iterations


def generation_cycle_offset(global_step: int, args) -> int:
    """How many micro-steps into a generation cycle optimizer step `global_step` ends (0: on a boundary)."""
    return (global_step * args.gradient_accumulation_steps) % generation_cycle_micro_steps(args)


def generation_cycle_steps(args) -> Fraction:
    """Optimizer steps per generation cycle (a fraction when a cycle ends inside an optimizer step)."""
    return Fraction(generation_cycle_micro_steps(args), args.gradient_accumulation_steps)


def save_steps_hint(args) -> str | None:
    """A warning text when `save_steps` puts checkpoints inside generation cycles, else None."""
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    save_steps = args.save_steps
    if strategy != "steps" or not save_steps or save_steps < 1 or save_steps != int(save_steps):
        return None
    if generation_cycle_offset(int(save_steps), args) == 0:
        return None
    cycle = generation_cycle_steps(args)
    return (
        f"save_steps={int(save_steps)} is not a multiple of the generation cycle ({cycle} optimizer steps: "
        f"steps_per_generation={args.steps_per_generation} x num_iterations={args.num_iterations} micro-steps / "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps}), so some checkpoints fall inside a "
        "generation batch. Resuming from one regenerates that batch: training stays correct (μ comes with the new "
        "completions) but does not reproduce the uninterrupted run. Use a save_steps that is a multiple of "
        f"{cycle} for exact resumes."
    )


def resume_offset_message(global_step: int, args) -> str | None:
    """A warning text when resuming at `global_step` lands inside a generation cycle, else None."""
    offset = generation_cycle_offset(global_step, args)
    if global_step <= 0 or offset == 0:
        return None
    cycle = generation_cycle_micro_steps(args)
    return (
        f"Resuming at step {global_step}, {offset} of {cycle} micro-steps into a generation batch "
        f"(steps_per_generation={args.steps_per_generation}, num_iterations={args.num_iterations}, "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps}). The completions of that batch were not "
        "checkpointed: GRPOTrainer generates a new batch now, and every later generation happens at this offset "
        "instead of on the uninterrupted run's cycle boundaries. Training stays correct (μ comes with the new "
        "completions) but does not reproduce the uninterrupted run. Checkpoints at multiples of "
        f"{generation_cycle_steps(args)} optimizer steps resume exactly."
    )


class GenerationCycleResumeCheck(TrainerCallback):
    """Warns at the start of a resumed run whose checkpoint lies inside a generation cycle."""

    def on_train_begin(self, args, state, control, **kwargs):
        message = resume_offset_message(state.global_step, args)
        if message is not None:
            logger.warning(message)
            warnings.warn(message, UserWarning, stacklevel=2)

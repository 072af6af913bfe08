"""Hugging Face ``transformers.Trainer`` integration (``pip install casckpt[transformers]``).

:class:`CasckptCallback` commits each ``checkpoint-N`` directory the Trainer saves as a
directory snapshot (:meth:`casckpt.Store.add_dir`) and keeps at most ``keep_local`` of them on
local disk; :func:`checkout_for_resume` writes a committed one back, byte-identical, for
``trainer.train(resume_from_checkpoint=...)``::

    from casckpt.integrations.transformers import CasckptCallback, checkout_for_resume

    trainer = Trainer(..., callbacks=[CasckptCallback(store, run="ft")])
    # the same two lines on the first launch (None: from scratch) and every restart, on the
    # same host (a local copy is reused once verified) or anywhere, even with output_dir gone:
    path = checkout_for_resume(store, "ft@latest", args.output_dir)
    trainer.train(resume_from_checkpoint=path)

Importing :mod:`casckpt` never imports this module nor transformers; import it explicitly.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from casckpt.engine.versions.validate import check_name
from casckpt.errors import (
    CasckptError,
    CheckoutMismatchError,
    CheckpointCommitError,
    InvalidArgumentError,
    RefNotFoundError,
    VersionExistsError,
)
from casckpt.integrations.resume import version_to_resume
from casckpt.store import Store
from casckpt.store_core import Ref
from casckpt.types import Version

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR: the Trainer names dirs checkpoint-N
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class _Saved:
    """A checkpoint directory this callback committed; ``commit`` is None once durable."""

    directory: Path
    step: int
    commit: Future[Version] | None


class CasckptCallback(TrainerCallback):  # type: ignore[misc]  # transformers is untyped for mypy
    """Commit every checkpoint the Trainer saves; keep at most ``keep_local`` on local disk.

    After each save (``on_save``) the new ``output_dir/checkpoint-N`` directory becomes version
    ``run@N`` (``N`` = ``state.global_step``) with ``metrics`` = the finite numeric entries of
    ``state.log_history`` logged at steps up to ``N`` (the latest value of each name) and
    ``metadata`` = ``{"integration": "transformers", "transformers": <version>, "checkpoint":
    "checkpoint-N"}``. Only the world's process zero commits.

    Background commits (``block=False``, the default): ``on_save`` hands the directory to the
    callback's one commit thread and returns at once, so the Trainer does not wait for the
    directory to be read; commits run one at a time, in step order, each a blocking
    ``add_dir`` (the files are read in place, no copy is staged). The Trainer never writes to a
    checkpoint directory once saved; nothing else may either until its commit is done (a file
    truncated while ``add_dir`` maps it ends the process with SIGBUS).

    Local disk: the callback deletes checkpoint directories it committed, oldest first, so that
    at most ``keep_local`` remain, and never one whose commit is not durable: with ``block=False``
    it waits for that commit first. The newest directory's own commit is not waited for at its
    save, so with ``keep_local=0`` each directory is deleted at the next save or at the end of
    training (``on_train_end``, which waits for every pending commit). Directories
    it did not commit (one checked out to resume from, say) and ``state.best_model_checkpoint``
    (``load_best_model_at_end`` loads it) are never deleted by the callback.

    ``TrainingArguments.save_total_limit`` rotates before the callback sees a save, so with
    ``block=False`` it could delete a directory before its commit has read it (or before the
    commit is durable, losing that checkpoint if the commit then failed): the callback refuses
    a limit below
    ``max(keep_local, 1) + 1`` at ``on_train_begin``, and with a limit set it waits for every
    pending commit before each save (the Trainer also keeps the best checkpoint, so the newest
    one's directory can be rotated away at the next save). Leave it ``None`` and let
    ``keep_local`` bound local checkpoints. A directory is deleted by renaming it to a hidden
    ``.checkpoint-N.casckpt-deleting`` first, so a crash part-way leaves no partial
    ``checkpoint-N`` for ``resume_from_checkpoint=True`` to pick.

    Errors: a failed commit raises :class:`~casckpt.errors.CheckpointCommitError` (the store's
    error is its ``__cause__``) from the next save or from ``on_train_end``, and so out of
    ``trainer.train()``; the directory it was storing is kept. A blocking commit's error
    propagates as the store raised it. A save at a step the run already holds (a second
    training reusing the run name) raises :class:`~casckpt.errors.VersionExistsError`, saying
    how to resume or pick a new name, at that save; its directory is kept.

    Crash recovery: a training resumed from ``output_dir/checkpoint-N`` whose commit died with
    the process that saved it (the run lacks step ``N``) commits that directory at
    ``on_train_begin``, blocking, before training goes on (the callback never deletes it).

    Close the store only after ``trainer.train()`` returns: commits may still be running until
    ``on_train_end``. Not thread-safe: the Trainer calls it from its training loop.
    """

    def __init__(self, store: Store, run: str | None = None, keep_local: int = 1,
                 block: bool = False) -> None:
        """Args:
            store: an open store; the callback does not close it.
            run: the run to commit into; default: ``args.run_name`` or the name of
                ``args.output_dir``, with characters a run name cannot hold replaced by ``-``.
            keep_local: how many committed checkpoint directories to keep on local disk (>= 0).
            block: commit in the foreground (the Trainer waits for each commit at its save);
                False: on the callback's commit thread.

        Raises:
            InvalidArgumentError, InvalidNameError: a bad ``keep_local`` or ``run``.
        """
        if isinstance(keep_local, bool) or not isinstance(keep_local, int) or keep_local < 0:
            raise InvalidArgumentError(f"keep_local must be an int >= 0, got {keep_local!r}")
        self._store = store
        self._run = None if run is None else check_name(run, "run")
        self._keep_local = keep_local
        self._block = bool(block)
        self._saved: list[_Saved] = []  # oldest first
        self._committer: ThreadPoolExecutor | None = None  # one thread: commits in step order

    @property
    def run(self) -> str | None:
        """The run committed into (None until training begins when not given)."""
        return self._run

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Pick the run name; refuse a ``save_total_limit`` that could race a background commit."""
        limit = args.save_total_limit
        need = max(self._keep_local, 1) + 1
        if not self._block and limit is not None and 0 < limit < need:
            raise InvalidArgumentError(
                f"save_total_limit={limit} lets the Trainer delete a checkpoint directory before "
                f"its background commit has stored it; set save_total_limit=None (keep_local="
                f"{self._keep_local} bounds local checkpoints) or >= {need}, or pass block=True"
            )
        if self._run is None:
            self._run = run_name_for(args)
        if state.is_world_process_zero:
            _finish_removals(Path(str(args.output_dir)))
        self._adopt_resumed(args, state)

    def _adopt_resumed(self, args: TrainingArguments, state: TrainerState) -> None:
        # A resumed training starts from output_dir/checkpoint-<global_step>; if the run lacks
        # that step, its commit died with the process that saved it: store it now (blocking,
        # once), as the Trainer's save_total_limit rotation or the user may delete it later.
        step, run = state.global_step, self._run
        directory = Path(str(args.output_dir)) / f"{PREFIX}-{step}"
        if not state.is_world_process_zero or step <= 0 or run is None or not directory.is_dir():
            return
        try:
            self._store.resolve(f"{run}@{step}")
            return
        except RefNotFoundError:
            pass
        try:
            self._store.add_dir(directory, **self._commit_args(state, directory, step))
        except VersionExistsError as exc:  # a deleted version holds the step: deleted on purpose
            logger.warning("not committing the resumed %s: %s", directory, exc)

    def _commit_args(self, state: TrainerState, directory: Path, step: int) -> dict[str, Any]:
        return dict(
            run=self._run, step=step, metrics=metrics_at(state.log_history, step),
            metadata={"integration": "transformers", "transformers": transformers.__version__,
                      "checkpoint": directory.name},
            message=f"transformers.Trainer {directory.name}",
        )

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """Commit ``checkpoint-<global_step>``; delete local directories beyond ``keep_local``.

        Raises:
            CheckpointCommitError: an earlier background commit failed.
            InvalidArgumentError: the Trainer saved no such directory.
            VersionExistsError: the run already holds this step (another training's).
        """
        if not state.is_world_process_zero:
            return
        self._collect(wait=False)
        step = state.global_step
        directory = Path(str(args.output_dir)) / f"{PREFIX}-{step}"
        if not directory.is_dir():
            raise InvalidArgumentError(
                f"the Trainer reported a save at step {step} but {directory} is not a directory; "
                "CasckptCallback commits the Trainer's own checkpoint-N directories"
            )
        if self._run is None:
            self._run = run_name_for(args)
        try:
            held: Version | None = self._store.resolve(f"{self._run}@{step}")
        except RefNotFoundError:
            held = None
        if held is not None:  # another training's: checked here, so both modes say what to do
            raise VersionExistsError(
                f"run {self._run!r} already holds step {step} ({held.id[:12]}) from another "
                f"training, so {directory} was not stored (it is kept): to continue that "
                f"training, resume from the store (path = checkout_for_resume(store, "
                f"'{self._run}@latest', output_dir); trainer.train(resume_from_checkpoint=path)); "
                "to start over, pass CasckptCallback(run=<a new name>)")
        commit = self._commit_args(state, directory, step)
        pending = None
        if self._block:
            self._store.add_dir(directory, **commit)
        else:
            if self._committer is None:
                self._committer = ThreadPoolExecutor(1, thread_name_prefix="casckpt-hf-commit")
            store = self._store
            pending = self._committer.submit(lambda: store.add_dir(directory, **commit))
        self._saved.append(_Saved(directory, step, pending))
        self._prune(state, keep_newest_pending=True)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Before a save that rotates (``save_total_limit``), wait for pending commits."""
        self._before_rotation(args, state, bool(control.should_save))

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """As :meth:`on_step_end`, for saves at the end of an epoch."""
        self._before_rotation(args, state, bool(control.should_save))

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """As :meth:`on_step_end`, for ``save_strategy="best"`` (it decides after evaluating)."""
        self._before_rotation(args, state, args.save_strategy == "best")

    def _before_rotation(self, args: TrainingArguments, state: TrainerState, saving: bool) -> None:
        # The Trainer's save_total_limit rotation runs inside its save, before on_save, and may
        # delete any checkpoint directory but the newest and the best: every one of them must be
        # durable in the store by then (the kept best dir makes the newest pending one a target).
        if saving and not self._block and args.save_total_limit and state.is_world_process_zero:
            self._collect(wait=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Wait for every pending commit, then delete local directories beyond ``keep_local``.

        Raises:
            CheckpointCommitError: a background commit failed.
        """
        if not state.is_world_process_zero:
            return
        try:
            self._collect(wait=True)
        finally:
            if self._committer is not None:  # a failure above leaves the later commits running
                self._committer.shutdown(wait=True)
                self._committer = None
        self._prune(state, keep_newest_pending=False)

    def _collect(self, *, wait: bool) -> None:
        """Take the outcome of finished commits (of all when ``wait``); raise the first failure
        (each later one is logged: its directory is kept too)."""
        failures: list[CheckpointCommitError] = []
        for saved in list(self._saved):
            if saved.commit is not None and (wait or saved.commit.done()):
                try:
                    self._settle(saved, saved.commit)
                except CheckpointCommitError as exc:
                    failures.append(exc)
        for later in failures[1:]:
            logger.error("%s", later)
        if failures:
            raise failures[0]

    def _settle(self, saved: _Saved, commit: Future[Version]) -> None:
        try:
            commit.result()
        except CasckptError as exc:
            self._saved.remove(saved)  # kept on disk, no longer ours to delete
            raise CheckpointCommitError(
                f"committing {saved.directory} as {self._run}@{saved.step} failed: {exc}; the "
                "directory is kept: fix the store and commit it with "
                f"store.add_dir({str(saved.directory)!r}, run={self._run!r}, step={saved.step})"
            ) from exc
        saved.commit = None

    def _prune(self, state: TrainerState, *, keep_newest_pending: bool) -> None:
        surplus = len(self._saved) - self._keep_local
        best = state.best_model_checkpoint
        for saved in list(self._saved[:max(surplus, 0)]):
            if saved.commit is not None:
                if keep_newest_pending and saved is self._saved[-1] and not saved.commit.done():
                    break  # its commit just started; deleted at the next save or at train end
                self._settle(saved, saved.commit)
            self._saved.remove(saved)
            if best is not None and Path(best).resolve() == saved.directory.resolve():
                continue
            if saved.directory.exists():
                _remove(saved.directory)


def _finish_removals(output_dir: Path) -> None:
    """Delete what a crash left half-deleted by :func:`_remove` (only ever directories whose
    commit had returned: nothing else is given that name)."""
    for doomed in output_dir.glob(f".{PREFIX}-*.casckpt-deleting"):
        if doomed.is_dir() and not doomed.is_symlink():
            shutil.rmtree(doomed)


def _remove(directory: Path) -> None:
    """Delete ``directory`` so that a crash part-way leaves no partial ``checkpoint-N`` behind
    (``resume_from_checkpoint=True`` would resume from it): renamed to a hidden name first."""
    doomed = directory.with_name(f".{directory.name}.casckpt-deleting")
    if doomed.exists():  # left by an earlier crash
        shutil.rmtree(doomed)
    directory.rename(doomed)
    shutil.rmtree(doomed)


def run_name_for(args: TrainingArguments) -> str:
    """A run name from ``args.run_name`` or the name of ``args.output_dir`` (``hf-trainer`` if
    neither gives one), characters a run name cannot hold replaced by ``-``."""
    for text in (args.run_name, Path(args.output_dir or "").name):
        name = _NOT_IN_NAME.sub("-", str(text or "")).replace("..", ".").strip("-._")[:128]
        if name:
            return name
    return "hf-trainer"


def metrics_at(log_history: Iterable[Mapping[str, Any]], step: int) -> dict[str, float]:
    """The finite numeric entries of ``log_history`` logged at steps <= ``step``, latest wins."""
    out: dict[str, float] = {}
    for entry in log_history:
        if entry.get("step", 0) > step:
            continue
        for key, value in entry.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                out[key] = float(value)
    return out


def checkout_for_resume(store: Store, ref: Ref, output_dir: str | Path) -> str | None:
    """The checkpoint directory to resume from: ``output_dir/checkpoint-<step>`` of the
    directory snapshot ``ref``, or None on a first launch (``ref`` is ``RUN@latest`` and the
    run has no version yet), so one line serves the first launch and every restart::

        path = checkout_for_resume(store, "ft@latest", args.output_dir)
        trainer.train(resume_from_checkpoint=path)  # None: from scratch

    On the same host the directory is usually still there (``keep_local`` keeps it): it is
    reused if it holds exactly the version, every file hashed against the digest the store
    recorded (``Store.checkout(reuse=True)``). One that differs is moved aside to a hidden
    ``.checkpoint-<step>.casckpt-differs[-N]`` (logged at WARNING; nothing is deleted) and the
    version is checked out in its place. Either way the files are byte-identical to the
    committed save, so training resumes exactly where it left off: weights, optimizer,
    scheduler, RNG and Trainer state.

    Returns:
        The checkpoint directory's path, as a str; None on a first launch (logged at WARNING).

    Raises:
        RefNotFoundError: no such version (a missing step or tag, a fork of a run with no
            version of its own: see :mod:`casckpt.integrations.resume`).
        NotADirectorySnapshotError: the version was stored with ``commit``, not ``add_dir``.
        CheckoutTargetError: ``output_dir/checkpoint-<step>`` is a file or a link.
        Others: as :meth:`casckpt.Store.checkout`.
    """
    version = version_to_resume(store, ref)
    if version is None:
        logger.warning("%s names no version yet: training starts from scratch", ref)
        return None
    target = Path(output_dir) / f"{PREFIX}-{version.step}"
    try:
        return str(store.checkout(version.id, target, reuse=True))
    except CheckoutMismatchError as exc:
        aside = _aside(target)
        target.rename(aside)
        logger.warning("%s; moved it to %s and checking out %s@%s in its place",
                       exc, aside, version.run, version.step)
    return str(store.checkout(version.id, target))


def _aside(target: Path) -> Path:
    """A free hidden name next to ``target`` for a directory that differs from the store's
    version (hidden, so the Trainer's ``checkpoint-*`` globs never pick it up)."""
    aside = target.with_name(f".{target.name}.casckpt-differs")
    number = 1
    while aside.exists() or aside.is_symlink():
        number += 1
        aside = target.with_name(f".{target.name}.casckpt-differs-{number}")
    return aside

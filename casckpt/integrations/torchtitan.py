"""torchtitan: its ``CheckpointManager`` saving into and resuming from a store.

::

    from casckpt.integrations.torchtitan import CasckptCheckpointManager

    config = Trainer.Config(..., checkpoint=CasckptCheckpointManager.Config(
        enable=True, interval=500, store="/shared/ckpts", run="llama3-8b"))

:class:`CasckptCheckpointManager` is torchtitan's own DCP ``CheckpointManager`` (its
``Config`` builds it: torchtitan's trainer needs no change) with three of its hooks
replaced, nothing else: ``dcp_save`` passes casckpt's DCP writer (:mod:`casckpt.dcp`), so
the checkpoint of step N becomes version ``run@N`` instead of the folder ``step-N`` (every
rank writes only chunks the store does not hold; the version is published once every rank
wrote, so a save killed part way leaves none); ``_load`` resumes from the store: the run's
newest version (``load_step=-1``) or ``run@load_step``, and when the run has none yet, it
is torchtitan's own ``_load`` (``initial_load_path``, Hugging Face weights, an existing
``step-N`` folder of files, or a fresh start); ``dcp_load`` reads through casckpt's DCP
reader for such a version. ``interval``, ``last_save_model_only`` and ``export_dtype``,
``exclude_from_loading``, ``async_mode="async"`` (on the gloo group torchtitan makes for
it) work as they do for folders. ``keep_latest_k`` becomes the run's retention policy
(``keep_last``, applied by ``casckpt gc``): nothing is deleted while training runs.
A Hugging Face export at the last step (``last_save_in_hf``) is still written as files.

Needs the extra: ``pip install 'casckpt[torchtitan]'`` (torchtitan 0.3, Python 3.11+).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

import casckpt
from casckpt.errors import InvalidArgumentError, RefNotFoundError
from casckpt.integrations.resume import SCHEME, scheme_ref, version_to_resume
from casckpt.retention_rules import make_policy

_STEP = re.compile(r"step-(\d+)$")
log = logging.getLogger(__name__)


class CasckptCheckpointManager(CheckpointManager):  # type: ignore[misc]  # torchtitan is untyped
    """torchtitan's ``CheckpointManager`` on a casckpt store: built by its ``Config`` (torchtitan's
    fields plus ``store`` and ``run``) where torchtitan's trainer builds its own. The checkpoint of
    step N is version ``run@N``; ``load()`` resumes the run's newest version (or
    ``run@load_step``), and torchtitan's own load when the run has none yet; ``keep_latest_k``
    sets the run's ``keep_last`` retention policy (``casckpt gc`` deletes, never the manager).

    Raises (when built, on every rank):
        InvalidArgumentError: ``async_mode="async_with_pinned_mem"``, which saves from
            another process (use ``"async"``), or an empty ``store`` or ``run``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        store: str = ""
        """The casckpt store, as ``casckpt.open`` takes it: its directory (for a store on S3 and
        PostgreSQL too, the one holding its ``casckpt.toml``), or that file."""

        run: str = ""
        """The run whose versions the checkpoints become (``run@step``)."""

    def __init__(self, config: Config, **components: Any) -> None:
        if config.enable:
            if not config.store or not config.run:
                raise InvalidArgumentError(
                    "CasckptCheckpointManager.Config needs store= (the casckpt store's directory or "
                    "casckpt.toml) and run= (the run the checkpoints become versions of)")
            if config.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
                raise InvalidArgumentError(
                    "checkpoint.async_mode='async_with_pinned_mem' saves from another process, "
                    "which casckpt's DCP writer does not support: use async_mode='async'")
        super().__init__(config, **components)
        if not self.enable:
            return
        self.casckpt_run = config.run
        self.casckpt_store = casckpt.open(config.store)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.keep_latest_k > 0 and not self.load_only and rank == 0:
            self._keep_latest(self.keep_latest_k)

    def _keep_latest(self, k: int) -> None:
        """Make ``keep_latest_k`` the run's policy (``keep_last=k``), unless the run has a policy
        of another shape (kept: set by hand, ``casckpt retention set``), which is logged."""
        try:
            current = self.casckpt_store.retention.get(self.casckpt_run)
        except RefNotFoundError:  # no such run yet: set() creates it
            current = None
        wanted = make_policy(keep_last=k)
        if current == wanted:
            return
        if current is not None and current != make_policy(keep_last=current.keep_last or 1):
            log.warning("checkpoint.keep_latest_k=%d is not applied: run %r has its own retention "
                        "policy (%s), which casckpt gc applies; set keep_latest_k=0 to silence this",
                        k, self.casckpt_run, current)
            return
        self.casckpt_store.retention.set(self.casckpt_run, keep_last=k)

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """Save ``state_dict`` as version ``run@N`` (``checkpoint_id`` is torchtitan's
        ``.../step-N``); a Hugging Face export (``to_hf``) is torchtitan's, into files."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        step = _STEP.search(checkpoint_id)
        if step is None:
            raise InvalidArgumentError(f"{checkpoint_id!r} does not end in step-N, the step "
                                       "torchtitan saves: the version's step comes from it")
        writer = self.casckpt_store.dcp_writer(run=self.casckpt_run, step=int(step[1]))
        result = None
        if async_mode == AsyncMode.ASYNC:
            result = state_dict_saver.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        else:
            state_dict_saver.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """Load the version a ``casckpt://REF`` names; any other id is torchtitan's."""
        ref = scheme_ref(checkpoint_id)
        if ref is None:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        state_dict_loader.load(state_dict, storage_reader=self.casckpt_store.dcp_reader(ref))
        self.states[MODEL].load_state_dict(state_dict)  # torchtitan flattens the model's keys

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Resume from ``run@step`` (``-1``: the newest version); torchtitan's own load when
        ``step`` is -1 and the run has no version yet.

        Raises:
            RefNotFoundError: ``step`` names no version of the run.
        """
        version = self._version(step)
        if version is None:
            return bool(super()._load(step))
        states = self._states_to_load(model_only=version.step == 0)  # step 0: a seed checkpoint
        self.dcp_load(states, f"{SCHEME}{version.id}", from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def _version(self, step: int) -> Any:
        """The version to resume: ``run@step`` (``-1``: the newest), through the run's lineage --
        a fork with no version of its own resumes its fork point, and a step at or before the
        fork is the parent's; None: a first launch (the run has no version, and is no fork).

        Raises:
            RefNotFoundError: ``step`` names no version of the run or its lineage.
        """
        ref = f"{self.casckpt_run}@latest" if step == -1 else f"{self.casckpt_run}@{step}"
        try:
            return version_to_resume(self.casckpt_store, ref)
        except RefNotFoundError:
            node = {n.name: n for n in self.casckpt_store.lineage()}.get(self.casckpt_run)
            if node is None or node.fork_version is None or node.parent_run is None:
                raise
            if step == -1 or step == node.fork_step:
                return self.casckpt_store.resolve(node.fork_version)
            if node.fork_step is None or step > node.fork_step:
                raise
            return version_to_resume(self.casckpt_store, f"{node.parent_run}@{step}")

    def _should_purge(self) -> bool:
        return False  # keep_latest_k is the run's retention policy: casckpt gc deletes

    def _close(self) -> None:
        try:
            self.maybe_wait_for_saving()  # an async save still writing through the store
        finally:
            super()._close()
            store = getattr(self, "casckpt_store", None)  # None: __init__ failed before opening it
            if store is not None:
                store.close()

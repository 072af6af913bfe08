"""A handle bound to one run of a store (``Store.run``): what a training loop calls.

Every call names the run once, at :meth:`casckpt.Store.run`; steps stand for versions
(``run.restore(1200)``, ``run.restore("latest")``), and ``save_every`` says when a step
is due for a checkpoint (:meth:`Run.should_save`). Each method is the ``Store`` call it
replaces, with ``run=`` filled in: the same rows, the same errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from casckpt.errors import InvalidArgumentError, RefNotFoundError
from casckpt.types import RetentionPolicy, RunInfo, TensorHistoryEntry, Version

if TYPE_CHECKING:
    import numpy as np
    import torch

    from casckpt.engine.write.commithandle import CommitHandle

Step = int | str | Version
"""A version of the run: a step number, ``"latest"``, or any ref (``"tag:best"``, a Version)."""
SaveEvery = int | timedelta | tuple[int, timedelta] | None


class _RetentionCalls(Protocol):
    def get(self, run: str) -> RetentionPolicy | None: ...

    def set(self, run: str, **rules: Any) -> RetentionPolicy: ...


class _LocationCalls(Protocol):
    def redundancy(self, run: str | None = None) -> str: ...

    def set_redundancy(self, spec: str, *, run: str | None = None) -> str: ...


class _OpsCalls(Protocol):
    def delta_chain(self, run: str | None = None) -> int: ...

    def set_delta_chain(self, chain: int, *, run: str | None = None) -> None: ...


class RunStore(Protocol):
    """The calls a :class:`Run` makes on its store (:class:`casckpt.Store` has them): a run
    handle is made by the store and depends on it only through these, so ``casckpt.store``
    and ``casckpt.run`` import in one direction."""

    @property
    def commit(self) -> Callable[..., Version | CommitHandle]: ...

    def restore(self, ref: Any, into: object = None, *, map_location: Any = None) -> Any: ...

    def load_tensor(self, ref: Any, path: str, *, map_location: Any = None
                    ) -> torch.Tensor | np.ndarray: ...

    @property
    def log(self) -> Callable[..., list[Version]]: ...

    def history(self, run: str, path: str) -> list[TensorHistoryEntry]: ...

    def best(self, run: str, metric: str, mode: str = "min") -> Version: ...

    def fork(self, ref: Any, run: str) -> RunInfo: ...

    def delete(self, ref: Any, reason: str = "manual") -> Version: ...

    @property
    def retention(self) -> _RetentionCalls: ...

    @property
    def locations(self) -> _LocationCalls: ...

    @property
    def ops(self) -> _OpsCalls: ...


def save_rule(save_every: object) -> SaveEvery:
    """``save_every`` checked: a positive step interval, a positive time interval, both (a
    tuple: whichever comes first), or None (every step).

    Raises:
        InvalidArgumentError: anything else, naming the field.
    """
    if save_every is None:
        return None
    if isinstance(save_every, tuple) and len(save_every) == 2:
        steps, every = save_every
        if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 and \
                isinstance(every, timedelta) and every > timedelta(0):
            return (steps, every)
    elif isinstance(save_every, int) and not isinstance(save_every, bool) and save_every > 0:
        return save_every
    elif isinstance(save_every, timedelta) and save_every > timedelta(0):
        return save_every
    raise InvalidArgumentError(
        f"save_every must be a positive step count (500), a positive datetime.timedelta "
        f"(timedelta(minutes=30)), or a tuple of both (whichever comes first); got {save_every!r}")


class Run:
    """One run of a store: save, restore, query and govern it without repeating its name.

    Made by :meth:`casckpt.Store.run`; valid while its store is open.
    """

    def __init__(self, store: RunStore, name: str, save_every: SaveEvery = None) -> None:
        self._store, self._name, self._every = store, name, save_every
        self._last: tuple[int, float] | None = None  # (step, time) of the last save seen
        self._background: list[CommitHandle] = []  # this handle's block=False saves not seen done

    def __repr__(self) -> str:
        return f"Run({self._name!r})"

    @property
    def name(self) -> str:
        """The run's name."""
        return self._name

    def ref(self, step: Step = "latest") -> str | Version:
        """The ref of a step of this run: ``7`` -> ``"name@7"``, ``"latest"`` -> ``"name@latest"``;
        another ref (``"tag:best"``, ``"other@3"``, a Version) as it is."""
        if isinstance(step, Version):
            return step
        if isinstance(step, int) and not isinstance(step, bool):
            return f"{self._name}@{step}"
        if step == "latest":
            return f"{self._name}@latest"
        if isinstance(step, str):
            return step
        raise InvalidArgumentError(f"a step is an int, 'latest' or a ref; got {step!r}")

    # -- training --------------------------------------------------------------------------

    @overload
    def save(self, state: object, step: int, *, metrics: Mapping[str, float] | None = None,
             metadata: Mapping[str, Any] | None = None, message: str | None = None,
             tags: Iterable[str] = (), block: Literal[True] = True) -> Version: ...

    @overload
    def save(self, state: object, step: int, *, metrics: Mapping[str, float] | None = None,
             metadata: Mapping[str, Any] | None = None, message: str | None = None,
             tags: Iterable[str] = (), block: Literal[False]) -> CommitHandle: ...

    def save(self, state: object, step: int, *, metrics: Mapping[str, float] | None = None,
             metadata: Mapping[str, Any] | None = None, message: str | None = None,
             tags: Iterable[str] = (), block: bool = True) -> Version | CommitHandle:
        """Commit ``state`` as this run's ``step`` (:meth:`Store.commit`)."""
        started = time.time()  # the time should_save counts from
        done: Version | CommitHandle = self._store.commit(
            state, run=self._name, step=step, metrics=metrics, metadata=metadata, message=message,
            tags=tags, block=block)
        self._last = (step, started)
        if not isinstance(done, Version):  # block=False: a handle to a commit in flight
            self._background = [h for h in self._background if not h.done()]
            self._background.append(done)
        return done

    def restore(self, step: Step = "latest", *, into: object = None, map_location: Any = None) -> Any:
        """The state of ``step`` (:meth:`Store.restore`; ``into`` fills a state in place)."""
        return self._store.restore(self.ref(step), into, map_location=map_location)

    def load_tensor(self, path: str, step: Step = "latest", *, map_location: Any = None
                    ) -> torch.Tensor | np.ndarray:
        """One tensor of ``step`` (:meth:`Store.load_tensor`)."""
        return self._store.load_tensor(self.ref(step), path, map_location=map_location)

    def latest_step(self) -> int | None:
        """The run's highest visible step (None: no version yet, or no such run)."""
        found = self._versions(limit=1)
        return found[0].step if found else None

    def steps(self, *, pending: bool = False) -> list[int]:
        """Every visible step of the run, ascending.

        A version becomes visible once its commit has published it, so a step saved with
        ``block=False`` is left out until its background commit finishes (``handle.wait()``,
        :meth:`Store.wait_commits`). With ``pending=True`` the steps this handle saved with
        ``block=False`` that are still being committed are included too (a commit that then
        fails leaves its step out of later answers); other handles' and processes' commits in
        flight are never seen.
        """
        # the handles before the versions: one that finishes in between is among the versions
        running = [h.step for h in self._background if not h.done()] if pending else []
        return sorted({v.step for v in self._versions(order="asc")}.union(running))

    def should_save(self, step: int, *, now: datetime | float | None = None, final: bool = False) -> bool:
        """Whether ``step`` is due for a checkpoint under ``save_every``: always without a rule,
        for the run's first save, and with ``final``; else once ``step`` is the step interval
        past the last save, or the time interval has passed since it (``now``: the time to
        judge by, datetime or epoch seconds; default: now). The last save is this handle's,
        else the run's latest version in the store (a resumed job keeps its rhythm)."""
        if final or self._every is None:
            return True
        last = self._last if self._last is not None else self._stored_last()
        if last is None:
            return True
        steps, every = (self._every if isinstance(self._every, tuple) else
                        (self._every, None) if isinstance(self._every, int) else (None, self._every))
        at = now.timestamp() if isinstance(now, datetime) else time.time() if now is None else float(now)
        return (steps is not None and step - last[0] >= steps) or (
            every is not None and at - last[1] >= every.total_seconds())

    # -- queries ---------------------------------------------------------------------------

    def log(self, **filters: Any) -> list[Version]:
        """The run's versions (:meth:`Store.log` with ``run`` set; same filters)."""
        return self._store.log(self._name, **filters)

    def history(self, path: str) -> list[TensorHistoryEntry]:
        """Where the tensor at ``path`` changed along the run's lineage (:meth:`Store.history`)."""
        return self._store.history(self._name, path)

    def best(self, metric: str, mode: str = "min") -> Version:
        """The version with the best ``metric`` (:meth:`Store.best`)."""
        return self._store.best(self._name, metric, mode)

    # -- lineage and policy ----------------------------------------------------------------

    def fork(self, new_name: str, *, at: Step = "latest", save_every: SaveEvery = None) -> Run:
        """A new run branching from ``at`` (:meth:`Store.fork`), as a handle."""
        self._store.fork(self.ref(at), new_name)
        return Run(self._store, new_name, save_rule(save_every))

    def delete(self, step: Step) -> Version:
        """Delete one version (:meth:`Store.delete`; gc reclaims it after its grace)."""
        return self._store.delete(self.ref(step))

    @property
    def retention(self) -> RetentionPolicy | None:
        """The run's retention policy (None: it keeps every version)."""
        try:
            return self._store.retention.get(self._name)
        except RefNotFoundError:
            return None

    @retention.setter
    def retention(self, policy: RetentionPolicy) -> None:
        set_policy(self._store, self._name, policy)

    @property
    def redundancy(self) -> str:
        """The redundancy new packs of the run get (its own, else the store's)."""
        return self._store.locations.redundancy(self._name)

    @redundancy.setter
    def redundancy(self, spec: str) -> None:
        self._store.locations.set_redundancy(spec, run=self._name)

    @property
    def delta_chain(self) -> int:
        """Deltas deep the run's chunks may be stored before a keyframe (0: none)."""
        return self._store.ops.delta_chain(self._name)

    @delta_chain.setter
    def delta_chain(self, chain: int) -> None:
        self._store.ops.set_delta_chain(chain, run=self._name)

    def _versions(self, **filters: Any) -> list[Version]:
        try:
            return self._store.log(self._name, **filters)
        except RefNotFoundError:
            return []  # a run without versions yet

    def _stored_last(self) -> tuple[int, float] | None:
        found = self._versions(limit=1)
        return (found[0].step, found[0].created_at.timestamp()) if found else None


def set_policy(store: RunStore, run: str, policy: RetentionPolicy | Mapping[str, Any]) -> None:
    """Give ``run`` the retention ``policy`` (a RetentionPolicy, or its fields as a mapping).

    Raises:
        InvalidArgumentError: not a policy, or a rule out of range (as ``store.retention.set``).
    """
    if isinstance(policy, RetentionPolicy):
        fields = policy.to_dict()
    elif isinstance(policy, Mapping):
        fields = {str(name): value for name, value in policy.items()}  # an odd key is an unknown rule
    else:
        raise InvalidArgumentError(
            f"retention must be a casckpt.RetentionPolicy or a mapping of its rules; got {policy!r}")
    store.retention.set(run, **fields)

"""Retention planning: which versions of a run a policy keeps, and why. Pure: no I/O.

The rules, what each keeps and the reason it gives are declared in
:mod:`casckpt.retention_rules` (one field of ``RetentionPolicy`` each); a version is
kept if ANY rule keeps it (restic ``forget`` semantics). Besides the rules:

- The newest durable version is kept while a newer version of the run is not durable (on
  a fast tier, or lost with one). Reason ``"newest durable (...)"``.
- Fork points: versions another run was forked from are always kept while
  that run has visible versions, or has none yet (a fresh fork is about to
  restore its fork point); once all its versions are deleted the fork point
  is released. Reason ``"fork point of run NAME"``.

A run without a policy keeps every version (reason ``"no retention policy"``).

Call order for GC (see ``casckpt.catalog.retention``): inside one catalog write
transaction, ``load_histories`` -> :func:`plan` per history -> ``soft_delete``
the ``deleted`` versions of each plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from casckpt.catalog.retention import RunHistory
from casckpt.retention_rules import Candidate, hits, policy_from_json
from casckpt.types import RetentionDecision, RetentionPlan, RetentionPolicy, Version

NO_POLICY = "no retention policy"
NEWEST_DURABLE = "newest durable (newer versions are not drained from a fast tier)"


def keep_reasons(versions: Sequence[Candidate], policy: RetentionPolicy | None,
                 forks: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Why each version is kept: version id -> reasons, an empty tuple for a version to delete.

    Args:
        versions: the visible versions of ONE run (any order; ids and steps unique).
        policy: the run's policy; None keeps everything.
        forks: version id -> names of the live runs forked from it.

    Deterministic: the same input gives the same output, whatever its order.
    """
    if policy is None:
        return {v.id: (NO_POLICY,) for v in versions}
    reasons: dict[str, list[str]] = {v.id: [] for v in versions}
    for version_id, reason in hits(versions, policy):
        reasons[version_id].append(reason)
    for version_id, found in reasons.items():
        found.extend(f"fork point of run {child}" for child in sorted(forks.get(version_id, ())))
    guard = _newest_durable(versions)
    if guard is not None:
        reasons[guard].append(NEWEST_DURABLE)
    return {k: tuple(v) for k, v in reasons.items()}


def _newest_durable(versions: Sequence[Candidate]) -> str | None:
    """The newest durable version, when a newer one is not durable yet (still on a fast tier,
    or lost with one): a policy keeping only the newest versions would otherwise leave the run
    nothing that survives the loss of that tier."""
    ordered = sorted(versions, key=lambda v: v.step, reverse=True)
    for v in ordered:
        if getattr(v, "durability", "durable") == "durable":
            return v.id if v is not ordered[0] else None
    return None


def decide(versions: Sequence[Version], policy: RetentionPolicy | None,
           forks: Mapping[str, Sequence[str]]) -> tuple[RetentionDecision, ...]:
    """A :class:`RetentionDecision` per version, newest (highest step) first; see :func:`keep_reasons`."""
    reasons = keep_reasons(versions, policy, forks)
    ordered = sorted(versions, key=lambda v: v.step, reverse=True)
    return tuple(RetentionDecision(v, bool(reasons[v.id]), reasons[v.id]) for v in ordered)


def plan(history: RunHistory) -> RetentionPlan:
    """Apply a run's stored policy to its visible versions (dry: nothing is written).

    Raises:
        CatalogError: the stored policy is malformed (see :func:`policy_from_json`).
    """
    policy = None if history.policy is None else policy_from_json(history.policy, history.run)
    return RetentionPlan(history.run, policy, decide(history.versions, policy, history.forks))

"""Retention: the pure planner against a brute-force reference, and policies, plans,
soft delete and undelete through a real store and the CLI."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select, update
from typer.testing import CliRunner, Result

import casckpt
from casckpt import retention_rules as rules
from casckpt.catalog import schema as s
from casckpt.cli.main import app
from casckpt.engine.maintenance import retention as planner
from casckpt.errors import (
    CatalogError,
    InvalidArgumentError,
    RefNotFoundError,
    VersionSweptError,
)
from casckpt.testing.internals import internals
from casckpt.types import RetentionPolicy

# -- the planner against a reference -------------------------------------------------------

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
BASE = 1_800_000_000  # 2027-01-15, a Friday


@dataclass(frozen=True)
class Cand:
    id: str
    step: int
    ts: int  # whole UTC seconds, so every comparison is exact
    metrics: Mapping[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ()

    @property
    def created_at(self) -> datetime:
        return EPOCH + timedelta(seconds=self.ts)


@st.composite
def histories(draw: st.DrawFn) -> list[Cand]:
    steps = draw(st.lists(st.integers(0, 3000), unique=True, max_size=24))
    scale = draw(st.sampled_from([1, 60, 1200, 3600, 6 * 3600, 86400, 3 * 86400, 7 * 86400, 30 * 86400]))
    times = [BASE + draw(st.integers(0, 30)) * scale + draw(st.integers(0, scale - 1)) for _ in steps]
    if times and draw(st.booleans()):  # several versions committed in the same second
        times = [draw(st.sampled_from(times[:3])) for _ in times]
    if draw(st.booleans()):  # usually time follows steps; sometimes it does not
        times = [t for _, t in sorted(zip(sorted(steps), sorted(times), strict=True))]
        steps = sorted(steps)
    metric = st.dictionaries(st.sampled_from(["loss", "acc"]),
                             st.sampled_from([0.5, 0.25, 1.0, -2.0, 3.5]), max_size=2)
    tags = st.lists(st.sampled_from(["best", "keep", "release"]), unique=True, max_size=2)
    return [Cand(f"v{step:05d}", step, ts, draw(metric), tuple(draw(tags)))
            for step, ts in zip(steps, times, strict=True)]


@st.composite
def policies(draw: st.DrawFn) -> RetentionPolicy:
    count = st.none() | st.integers(1, 6)
    return RetentionPolicy(
        keep_last=draw(count), keep_every=draw(st.none() | st.integers(1, 1500)),
        keep_hourly=draw(count), keep_daily=draw(count), keep_weekly=draw(count),
        keep_within=draw(st.none() | st.integers(1, 40 * 86400).map(float)),
        keep_best=draw(st.none() | st.tuples(st.sampled_from(["loss", "acc", "gone"]),
                                             st.integers(1, 5), st.sampled_from(["min", "max"]))),
        keep_tagged=draw(st.booleans()),
    )


def _bucket(c: Cand, rule: str) -> int:
    hour, day = c.ts // 3600, c.ts // 86400
    # ISO weeks start on Monday; 1970-01-01 was a Thursday, so Monday 1969-12-29 is day -3
    return {"hourly": hour, "daily": day, "weekly": (day + 3) // 7}[rule]


def reference(history: Sequence[Cand], policy: RetentionPolicy,
              forks: Mapping[str, Sequence[str]]) -> dict[str, set[str]]:
    """Per version, the rules that keep it: each rule checked on its own, by brute force."""
    rules: dict[str, set[str]] = {c.id: set() for c in history}
    for c in history:
        others = [o for o in history if o is not c]
        if policy.keep_last is not None and sum(o.step > c.step for o in others) < policy.keep_last:
            rules[c.id].add("last")
        k = policy.keep_every
        if k is not None and not any(o.step // k == c.step // k and o.step < c.step for o in others):
            rules[c.id].add("every")
        for rule, n in (("hourly", policy.keep_hourly), ("daily", policy.keep_daily),
                        ("weekly", policy.keep_weekly)):
            b = _bucket(c, rule)
            newest_in_bucket = not any(_bucket(o, rule) == b and (o.ts, o.step) > (c.ts, c.step)
                                       for o in others)
            newer_buckets = {_bucket(o, rule) for o in history if _bucket(o, rule) > b}
            if n is not None and newest_in_bucket and len(newer_buckets) < n:
                rules[c.id].add(rule)
        if policy.keep_within is not None and c.ts >= max(o.ts for o in history) - policy.keep_within:
            rules[c.id].add("within")
        if policy.keep_best is not None and policy.keep_best[0] in c.metrics:
            metric, n, mode = policy.keep_best
            mine = c.metrics[metric] if mode == "min" else -c.metrics[metric]
            better = [o for o in others if metric in o.metrics and (
                (o.metrics[metric] if mode == "min" else -o.metrics[metric]), -o.step) < (mine, -c.step)]
            if len(better) < n:
                rules[c.id].add("best")
        if policy.keep_tagged and c.tags:
            rules[c.id].add("tagged")
        if forks.get(c.id):
            rules[c.id].add("fork")
    return rules


_PREFIXES = {"last ": "last", "every ": "every", "hourly ": "hourly", "daily ": "daily",
             "weekly ": "weekly", "within ": "within", "best ": "best", "tagged: ": "tagged",
             "fork point of run ": "fork"}


def _rule_of(reason: str) -> str:
    return next(rule for prefix, rule in _PREFIXES.items() if reason.startswith(prefix))


@settings(max_examples=400, deadline=None)
@given(history=histories(), policy=policies(), data=st.data())
def test_planner_matches_the_reference(history: list[Cand], policy: RetentionPolicy,
                                       data: st.DataObject) -> None:
    ids = [c.id for c in history]
    if history and policy.keep_within is not None and data.draw(st.booleans()):
        newest = max(c.ts for c in history)  # exactly on the boundary of some version
        gap = newest - data.draw(st.sampled_from([c.ts for c in history]))
        policy = replace(policy, keep_within=float(gap) if gap else None)
    fork_ids = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=2)) if ids else []
    forks = {vid: ("child-b", "child-a")[: 1 + i] for i, vid in enumerate(fork_ids)}
    expected = reference(history, policy, forks)
    got = planner.keep_reasons(history, policy, forks)
    assert set(got) == set(ids)
    for vid, reasons in got.items():
        assert {_rule_of(r) for r in reasons} == expected[vid], (vid, reasons)
        assert len(set(reasons)) == len(reasons)
    shuffled = list(history)
    random.Random(len(ids)).shuffle(shuffled)
    assert planner.keep_reasons(shuffled, policy, forks) == got  # order-independent


@settings(max_examples=100, deadline=None)
@given(history=histories(), policy=policies())
def test_decisions_are_newest_first_and_kept_exactly_when_a_rule_keeps_them(
        history: list[Cand], policy: RetentionPolicy) -> None:
    versions = [_version(c) for c in history]
    decisions = planner.decide(versions, policy, {})
    assert [d.version.step for d in decisions] == sorted((c.step for c in history), reverse=True)
    expected = reference(history, policy, {})
    for d in decisions:
        assert d.keep == bool(d.reasons) == bool(expected[d.version.id])
    assert all(d.keep and d.reasons == (planner.NO_POLICY,) for d in planner.decide(versions, None, {}))


def _version(c: Cand) -> casckpt.Version:
    return casckpt.Version(id=c.id, run="r", step=c.step, created_at=c.created_at, logical_bytes=0,
                           new_bytes=0, stored_bytes=0, duration_s=0.0, tags=c.tags, metrics=c.metrics)


def test_reasons_read_well() -> None:
    day = 86400
    history = [Cand("a", 0, BASE, {"val_loss": 0.9}), Cand("b", 1000, BASE + day, {"val_loss": 0.5}),
               Cand("c", 4100, BASE + 2 * day, {"val_loss": 0.7}, ("best",)),
               Cand("d", 4200, BASE + 9 * day + 3600)]
    policy = rules.make_policy(keep_last=1, keep_every=1000, keep_daily=2, keep_weekly=1,
                                 keep_within="7d", keep_best=("val_loss", 2, "min"))
    got = planner.keep_reasons(history, policy, {"a": ("ft-a",)})
    assert got == {
        "a": ("every 1000 steps (bucket 0)", "fork point of run ft-a"),
        "b": ("every 1000 steps (bucket 1)", "best 2 by val_loss (min)"),
        "c": ("every 1000 steps (bucket 4)", "daily 2027-01-17", "best 2 by val_loss (min)",
              "tagged: best"),
        "d": ("last 1", "daily 2027-01-24", "weekly 2027-W03", "within 7d of newest"),
    }
    hourly = planner.keep_reasons(history, rules.make_policy(keep_hourly=1), {})
    assert hourly["d"] == ("hourly 2027-01-24 09:00",)


def test_make_policy_validates() -> None:
    best: Any = ["loss", 2, "max"]  # as JSON gives it back
    policy = rules.make_policy(keep_within=timedelta(hours=36), keep_best=best, keep_tagged=False)
    assert policy == RetentionPolicy(keep_within=129600.0, keep_best=("loss", 2, "max"), keep_tagged=False)
    bad: list[dict[str, Any]] = [
        {}, {"keep_tagged": True}, {"keep_last": 0}, {"keep_last": True}, {"keep_daily": 1.5},
        {"keep_every": -3}, {"keep_within": 0}, {"keep_within": -5.0}, {"keep_within": float("inf")},
        {"keep_within": "7 days"}, {"keep_within": object()}, {"keep_best": ("loss", 0, "min")},
        {"keep_best": ("loss", 2, "best")}, {"keep_best": ("", 2, "min")}, {"keep_best": "loss"},
        {"keep_last": 3, "keep_tagged": "yes"},
    ]
    for kwargs in bad:
        with pytest.raises(InvalidArgumentError):
            rules.make_policy(**kwargs)


@pytest.mark.parametrize(("text", "seconds", "canonical"), [
    ("90m", 5400, "90m"), ("36h", 129600, "36h"), ("7d", 604800, "7d"), ("2w", 1209600, "14d"),
    ("45s", 45, "45s"), ("1.5h", 5400, "90m"), ("120", 120, "2m"), ("0.5", 0.5, "0.5s"),
])
def test_durations(text: str, seconds: float, canonical: str) -> None:
    assert rules.parse_duration(text) == seconds
    assert rules.format_duration(seconds) == canonical
    assert rules.parse_duration(rules.format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "0d", "-1h", "7x", "d", "inf", "nan", "1e400"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        rules.parse_duration(text)


@settings(max_examples=100, deadline=None)
@given(policy=policies())
def test_policy_json_round_trip(policy: RetentionPolicy) -> None:
    if all(getattr(policy, rule.name) is None for rule in rules.RULES if rule.keeps_alone):
        policy = replace(policy, keep_last=1)
    stored = json.loads(json.dumps(rules.policy_to_json(policy)))
    assert rules.policy_from_json(stored, "r") == policy


@pytest.mark.parametrize("stored", [[1], {"keep_last": 2, "keep_forever": True}, {"keep_last": -1},
                                    {"keep_tagged": True}])
def test_a_bad_stored_policy_is_a_catalog_error(stored: object) -> None:
    with pytest.raises(CatalogError):
        rules.policy_from_json(stored, "r")


# -- through a real store -------------------------------------------------------------------

RUN = "train"
DAY = 86400.0


def _state(i: int) -> dict[str, Any]:
    return {"w": torch.arange(64, dtype=torch.float32) * i, "own": torch.full((16,), float(i)), "i": i}


def _set_time(store: casckpt.Store, run: str, step: int, ts: float) -> None:
    run_id = select(s.runs.c.id).where(s.runs.c.name == run).scalar_subquery()
    with internals(store).catalog.write() as conn:
        conn.execute(update(s.versions).where(s.versions.c.run_id == run_id, s.versions.c.step == step)
                     .values(created_at=ts))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    """RUN at steps 0, 100, ... 700, one version a day; loss falls, but not at step 500."""
    with casckpt.open(tmp_path / "store") as st_:
        for i in range(8):
            st_.commit(_state(i), run=RUN, step=100 * i,
                       metrics={"loss": 1.0 / (i + 1) if i != 5 else 9.0})
            _set_time(st_, RUN, 100 * i, BASE + i * DAY)
        yield st_
    with casckpt.open(tmp_path / "store", create=False) as again:
        assert again.ops.check().ok


def _kept(plan: casckpt.types.RetentionPlan) -> list[int]:
    return [d.version.step for d in plan.decisions if d.keep]


def test_policy_round_trips_and_persists(store: casckpt.Store, tmp_path: Path) -> None:
    assert store.retention.get(RUN) is None
    policy = store.retention.set(RUN, keep_last=3, keep_within=timedelta(days=2),
                                 keep_best=("loss", 1, "min"), keep_tagged=False)
    assert store.retention.get(RUN) == policy == RetentionPolicy(
        keep_last=3, keep_within=2 * DAY, keep_best=("loss", 1, "min"), keep_tagged=False)
    store.close()
    with casckpt.open(tmp_path / "store", create=False) as again:
        assert again.retention.get(RUN) == policy
        daily = RetentionPolicy(keep_daily=7)
        assert again.retention.set(RUN, keep_daily=7) == again.retention.get(RUN) == daily
        again.retention.clear(RUN)
        again.retention.clear(RUN)
        assert again.retention.get(RUN) is None and again.retention.plan() == []


def test_policy_errors(store: casckpt.Store) -> None:
    with pytest.raises(RefNotFoundError, match="train"):
        store.retention.get("trian")
    with pytest.raises(RefNotFoundError):
        store.retention.clear("nope")
    with pytest.raises(RefNotFoundError):
        store.retention.plan("nope")
    with pytest.raises(InvalidArgumentError, match="at least one keep rule"):
        store.retention.set(RUN)
    with pytest.raises(InvalidArgumentError):
        store.retention.set(RUN, keep_last=0)
    with pytest.raises(casckpt.errors.InvalidNameError):
        store.retention.set("../x", keep_last=1)
    assert store.retention.get(RUN) is None  # nothing was stored


def test_a_policy_set_before_the_first_commit_applies(store: casckpt.Store) -> None:
    store.retention.set("later", keep_last=1)
    assert store.retention.get("later") == RetentionPolicy(keep_last=1)
    store.commit(_state(1), run="later", step=1)
    store.commit(_state(2), run="later", step=2)
    (plan,) = store.retention.plan("later")
    assert _kept(plan) == [2]


def test_plan_explains_every_version_and_writes_nothing(store: casckpt.Store) -> None:
    store.tag(f"{RUN}@100", "first-good")
    store.retention.set(RUN, keep_last=2, keep_every=400, keep_best=("loss", 1, "min"))
    before = store.log(RUN)
    (plan,) = store.retention.plan()
    assert store.retention.plan(RUN) == [plan]
    assert plan.run == RUN and plan.policy == store.retention.get(RUN)
    reasons = {d.version.step: d.reasons for d in plan.decisions}
    assert reasons == {
        700: ("last 2", "best 1 by loss (min)"), 600: ("last 2",), 500: (),
        400: ("every 400 steps (bucket 1)",), 300: (), 200: (), 100: ("tagged: first-good",),
        0: ("every 400 steps (bucket 0)",),
    }
    assert [v.step for v in plan.deleted] == [500, 300, 200]
    assert store.log(RUN) == before


def test_runs_without_a_policy_keep_everything(store: casckpt.Store) -> None:
    store.commit(_state(1), run="other", step=1)
    store.retention.set("other", keep_last=1)
    assert [p.run for p in store.retention.plan()] == ["other"]
    (plan,) = store.retention.plan(RUN)
    assert plan.policy is None and len(_kept(plan)) == 8
    assert {d.reasons for d in plan.decisions} == {(planner.NO_POLICY,)}


def test_keep_within_counts_from_the_newest_version_not_now(store: casckpt.Store) -> None:
    store.retention.set(RUN, keep_within="2d")  # BASE is in 2027: "now" would keep nothing
    (plan,) = store.retention.plan(RUN)
    assert _kept(plan) == [700, 600, 500]


def test_fork_points_of_live_runs_are_kept(store: casckpt.Store) -> None:
    store.retention.set(RUN, keep_last=1, keep_tagged=False)
    store.fork(f"{RUN}@200", "ft-a")
    (plan,) = store.retention.plan(RUN)
    assert _kept(plan) == [700, 200]  # a fresh fork is about to restore its fork point
    assert plan.decisions[5].reasons == ("fork point of run ft-a",)
    store.commit(_state(9), run="ft-a", step=1)
    store.fork(f"{RUN}@200", "ft-b")
    (plan,) = store.retention.plan(RUN)
    assert plan.decisions[5].reasons == ("fork point of run ft-a", "fork point of run ft-b")
    store.commit(_state(10), run="ft-b", step=1)
    store.delete("ft-a@1")
    store.delete("ft-b@1")  # both forks now have only deleted versions: the fork point is free
    (plan,) = store.retention.plan(RUN)
    assert _kept(plan) == [700]
    store.undelete("ft-b@1")
    store.delete(f"{RUN}@200")  # an explicit delete is the user's call
    assert store.restore("ft-b@latest")["i"] == 10


def test_delete_hides_a_version_everywhere(store: casckpt.Store) -> None:
    store.tag(f"{RUN}@700", "best")
    victim = store.resolve(f"{RUN}@700")
    assert store.delete("tag:best", reason="bad run") == victim
    assert [v.step for v in store.log(RUN)] == [600, 500, 400, 300, 200, 100, 0]
    assert store.resolve(f"{RUN}@latest").step == 600
    for ref in (f"{RUN}@700", "tag:best", victim.id, victim.id[:10]):
        with pytest.raises(RefNotFoundError):
            store.resolve(ref)
    assert store.ops.stats().versions == 7
    assert next(r for r in store.runs() if r.name == RUN).versions == 7
    with internals(store).catalog.read() as conn:
        row = conn.execute(select(s.versions.c.state, s.versions.c.deleted_reason, s.versions.c.deleted_at)
                           .where(s.versions.c.id == victim.id)).one()
    assert row.state == "deleted" and row.deleted_reason == "bad run" and row.deleted_at > 0
    with pytest.raises(RefNotFoundError):
        store.delete(victim.id)
    assert store.ops.check().ok


def test_undelete_restores_the_version_bit_exact(store: casckpt.Store) -> None:
    store.tag(f"{RUN}@300", "mid")
    original = store.resolve(f"{RUN}@300")
    tree = store.restore(original)
    for ref in (f"{RUN}@300", original.id, original.id[:8]):
        store.delete(original)
        with pytest.raises(RefNotFoundError, match="not deleted"):
            store.undelete(f"{RUN}@400")
        assert store.undelete(ref) == original
        assert store.resolve("tag:mid") == original
    back = store.restore(f"{RUN}@300")
    assert back.keys() == tree.keys() and back["i"] == 3
    for key in ("w", "own"):
        assert back[key].dtype == tree[key].dtype
        assert back[key].view(torch.int32).equal(tree[key].view(torch.int32))
    with pytest.raises(RefNotFoundError, match="not deleted"):
        store.undelete(original.id)
    for ref in ("zzzz", f"{RUN}@latest", f"{RUN}@~1", "nope@3", "abcd0123"):
        with pytest.raises(RefNotFoundError):
            store.undelete(ref)


def test_undelete_revives_condemned_chunks(store: casckpt.Store) -> None:
    victim = store.delete(f"{RUN}@600")
    ids = _own_chunks(store, victim.id)
    assert ids
    with internals(store).catalog.write() as conn:  # what GC's mark phase does to unreferenced chunks
        conn.execute(update(s.chunks).where(s.chunks.c.id.in_(ids))
                     .values(state="condemned", condemned_at=1.0))
    store.undelete(victim.id)
    with internals(store).catalog.read() as conn:
        states = set(conn.execute(select(s.chunks.c.state).where(s.chunks.c.id.in_(ids))).scalars())
    assert states == {"live"}
    assert store.restore(victim)["i"] == 6


def test_undelete_after_gc_swept_the_chunks_is_refused(store: casckpt.Store) -> None:
    victim = store.delete(f"{RUN}@600")
    ids = _own_chunks(store, victim.id)
    assert ids
    with internals(store).catalog.write() as conn:  # what GC's sweep does to unreferenced chunks
        conn.execute(s.chunks.delete().where(s.chunks.c.id.in_(ids)))
    with pytest.raises(VersionSweptError, match="GC already swept"):
        store.undelete(victim.id)
    with pytest.raises(RefNotFoundError):
        store.resolve(victim.id)  # still deleted, nothing changed


def _own_chunks(store: casckpt.Store, version_id: str) -> list[str]:
    """Chunks of a version that no other version references."""
    from casckpt.engine.versions.nodes import StoreNodes
    from casckpt.format.manifest import decode_manifest

    def chunks(vid: str) -> set[str]:
        catalog = internals(store).catalog
        manifest = decode_manifest(catalog.manifest(vid), vid, StoreNodes(catalog))
        return {c.hex() for c in manifest.chunk_ids()}

    others = set().union(*(chunks(v.id) for v in store.log()))
    return sorted(chunks(version_id) - others)


# -- the command line --------------------------------------------------------------------------


def cli(path: Path, *args: str) -> Result:
    return CliRunner().invoke(app, ["--store", str(path), *args])


def test_cli_retention_and_delete(store: casckpt.Store) -> None:
    path = store.path
    assert path is not None
    store.close()
    result = cli(path, "retention", "set", RUN, "--keep-last", "2", "--keep-best", "loss:1:min",
                 "--keep-within", "36h", "--no-keep-tagged", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"run": RUN, "policy": {
        "keep_last": 2, "keep_every": None, "keep_hourly": None, "keep_daily": None, "keep_weekly": None,
        "keep_within": 129600.0, "keep_best": ["loss", 1, "min"], "keep_tagged": False}}
    shown = cli(path, "retention", "show")
    assert shown.exit_code == 0 and "--keep-last 2 --keep-within 36h --keep-best loss:1:min" in shown.stdout
    assert json.loads(cli(path, "retention", "show", RUN, "--json").stdout)["policy"]["keep_last"] == 2

    plan = cli(path, "retention", "plan", RUN)
    assert plan.exit_code == 0, plan.output
    row = next(line for line in plan.stdout.splitlines() if line.split()[:1] == ["700"])
    assert "keep" in row and "last 2; within 36h of newest; best 1 by loss (min)" in row
    assert "delete" in next(line for line in plan.stdout.splitlines() if line.split()[:1] == ["300"])
    assert f"{RUN}: keep 2, delete 6" in plan.stdout
    plans = json.loads(cli(path, "retention", "plan", "--json").stdout)
    assert [(p["run"], p["keep"], p["delete"]) for p in plans] == [(RUN, 2, 6)]
    assert plans[0]["decisions"][0]["reasons"][0] == "last 2"

    deleted = cli(path, "delete", f"{RUN}@300", "--json")
    assert deleted.exit_code == 0, deleted.output
    vid = json.loads(deleted.stdout)["id"]
    assert vid not in cli(path, "log", RUN).stdout
    assert cli(path, "show", vid[:12]).exit_code == 3
    undone = cli(path, "undelete", vid[:12])
    assert undone.exit_code == 0 and f"({RUN}@300)" in undone.stdout
    assert cli(path, "show", vid[:12]).exit_code == 0

    assert cli(path, "undelete", vid[:12]).exit_code == 3
    assert cli(path, "retention", "set", RUN, "--keep-best", "loss:x").exit_code == 2
    assert cli(path, "retention", "set", RUN).exit_code == 2
    assert cli(path, "retention", "set", RUN, "--keep-within", "soon").exit_code == 2
    assert cli(path, "retention", "set", RUN, "--keep-last", "0").exit_code == 2
    assert cli(path, "retention", "show", "nope").exit_code == 3
    assert cli(path, "retention", "clear", RUN).exit_code == 0
    assert "no run has a retention policy" in cli(path, "retention", "plan").stderr


def test_parse_best() -> None:
    parse_best = rules.BEST.parse
    assert parse_best is not None
    assert parse_best("--keep-best", "val:loss:3:max") == ("val:loss", 3, "max")
    for bad in ("loss", "loss:3", ":3:min", "loss:-3:min", "loss:3:low"):
        with pytest.raises(InvalidArgumentError, match="--keep-best"):
            parse_best("--keep-best", bad)


# -- one declaration: the policy type, the CLI, the catalog and the docs read the same rules ---


def test_every_rule_is_a_policy_field_a_cli_option_and_a_docs_row() -> None:
    assert [rule.name for rule in rules.RULES] == [f.name for f in fields(RetentionPolicy)]
    help_text = CliRunner().invoke(app, ["retention", "set", "--help"], env={"COLUMNS": "300"}).stdout
    for rule in rules.RULES:
        assert rule.flag in help_text and rule.meaning.split(" (")[0] in help_text, rule.name
    usage = (Path(__file__).parents[3] / "docs" / "usage.md").read_text()
    assert rules.markdown_table() in usage, "docs/usage.md: paste the new rules.markdown_table()"


@settings(max_examples=60, deadline=None)
@given(policy=policies())
def test_the_cli_reads_back_the_line_describe_writes(policy: RetentionPolicy) -> None:
    """``describe`` writes a policy as CLI options; the options' parsing gives the policy back."""
    if all(getattr(policy, rule.name) is None for rule in rules.RULES if rule.keeps_alone):
        policy = replace(policy, keep_last=1)
    words = rules.describe(policy).split(" ")
    given: dict[str, Any] = {}
    for rule in rules.RULES:
        negated = rule.flag.replace("--", "--no-", 1)
        if rule.kind is rules.FLAG:
            given[rule.name] = negated not in words
        elif rule.flag in words:
            text = words[words.index(rule.flag) + 1]
            given[rule.name] = rule.kind.parse(rule.flag, text) if rule.kind.parse else int(text)
    assert rules.make_policy(**given) == policy


def test_an_unknown_rule_is_refused_by_name(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        with pytest.raises(InvalidArgumentError, match="keep_forever.*the rules are keep_last"):
            store.retention.set(RUN, keep_last=2, keep_forever=True)
        with pytest.raises(InvalidArgumentError, match="keep_tagged must be a bool"):
            store.retention.set(RUN, keep_last=2, keep_tagged=None)
        assert store.retention.set(RUN, keep_within="36h").keep_within == 129600.0


def test_retention_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "pg", catalog=pg_url) as store:
        for i in range(4):
            store.commit(_state(i), run=RUN, step=i, metrics={"loss": float(4 - i)})
        store.tag(f"{RUN}@0", "first")
        store.fork(f"{RUN}@1", "ft")
        store.retention.set(RUN, keep_last=1)
        (plan,) = store.retention.plan()
        assert [(d.version.step, d.reasons) for d in plan.decisions] == [
            (3, ("last 1",)), (2, ()), (1, ("fork point of run ft",)), (0, ("tagged: first",))]
        victim = store.delete(f"{RUN}@2")
        assert [v.step for v in store.log(RUN)] == [3, 1, 0]
        assert store.undelete(f"{RUN}@2") == victim
        store.retention.clear(RUN)
        assert store.retention.get(RUN) is None and store.retention.plan() == []
        assert store.ops.check().ok


def test_retention_show_prints_what_retention_set_takes_back(tmp_path: Path) -> None:
    """Every rule ``show`` prints, pasted into ``set`` (split as a shell splits it), gives the
    same policy: metric names with markup or spaces, and durations of any size."""
    import shlex

    store_path = tmp_path / "store"
    with casckpt.open(store_path) as store:
        store.commit({"a": 1}, run="r", step=1)
        store.retention.set("r", keep_best=("[bold]val loss[/bold]", 2, "min"), keep_within=1e-9,
                            keep_last=3)
        store.retention.set("q", keep_within=123456789.5)
    for run in ("r", "q"):
        shown = cli(store_path, "retention", "show", run)
        assert shown.exit_code == 0, shown.output
        line = shown.output.splitlines()[-1].split(None, 1)[1]
        again = cli(store_path, "retention", "set", f"{run}2", *shlex.split(line))
        assert again.exit_code == 0, again.output
        with casckpt.open(store_path, create=False) as store:
            assert store.retention.get(f"{run}2") == store.retention.get(run)


@pytest.mark.parametrize("text", ["loss:³:min", "loss:٣:min", "loss:-1:min", "loss:0:min"])
def test_a_malformed_keep_best_count_is_a_usage_error(tmp_path: Path, text: str) -> None:
    casckpt.open(tmp_path / "store").close()
    result = cli(tmp_path / "store", "retention", "set", "r", "--keep-best", text)
    assert result.exit_code == 2 and "keep" in result.output, result.output

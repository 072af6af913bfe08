"""The change hint's promise, checked: a tensor a commit reused on a hint carries a fingerprint
of the bytes the caller handed it, and ``check --read-data`` reports a version whose stored
bytes (the parent's) do not match it -- blocking and background commits, ``unchanged=`` and
``trust_versions=``. Honest hints and hashed tensors give no finding; nothing is repaired.

Real stores in tmp dirs; the only hook is a gate that holds the background worker back.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.engine.versions import refs
from casckpt.engine.write import commit as commit_engine
from casckpt.format.hintsample import BLOCK, WHOLE
from casckpt.format.manifest import Manifest
from casckpt.testing.internals import internals

BIG = 1 << 18  # fp32 elements: 1 MiB, sampled in blocks
SMALL = 8192  # 32 KiB: fingerprinted whole (above the size small tensors are packed at)
BLOCK_ELEMENTS = BLOCK // 4  # fp32 elements in a sampled block


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"big": torch.randn(BIG, generator=g), "small": torch.randn(SMALL, generator=g),
            "other": torch.randn(BIG, generator=g)}


def _manifest(store: casckpt.Store, ref: str) -> Manifest:
    catalog = internals(store).catalog
    return refs.load_manifest(catalog, refs.resolve(catalog, ref))


def _hint_findings(store: casckpt.Store) -> list[str]:
    report = store.ops.check(read_data=True)
    assert all(p.kind == "hint" for p in report.problems), report.problems
    return sorted(p.subject for p in report.problems)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "s", cache=tmp_path / "cache") as s:
        yield s


def test_a_wrong_unchanged_promise_in_a_blocking_commit_is_reported(store: casckpt.Store) -> None:
    state = _state()
    store.commit(state, run="r", step=1)
    before = state["big"].clone()
    state["big"].add_(1.0)  # a dense change: every sampled block differs
    state["small"].view(-1)[100] += 1.0  # one element: the whole tensor is the sample
    store.commit(state, run="r", step=2, unchanged=["big", "small", "other"])
    assert torch.equal(store.restore("r@2")["big"], before)  # what a wrong hint stores
    assert set(_manifest(store, "r@2").hinted) == {"big", "small", "other"}
    report = store.ops.check(read_data=True)
    assert sorted(p.subject for p in report.problems) == ["r@2:big", "r@2:small"]
    detail = report.problems[0].detail
    assert "change hint was wrong" in detail and "step 2" in detail and "without" in detail
    assert store.ops.check().ok  # metadata alone cannot tell
    assert torch.equal(store.restore("r@2")["big"], before)  # check changed nothing


def test_counters_a_write_bypassed_are_reported(store: casckpt.Store) -> None:
    state = _state()
    store.commit(state, run="r", step=1, trust_versions=True)
    state["big"].data.mul_(2.0)  # through .data: the tensor's counter does not move
    store.commit(state, run="r", step=2, trust_versions=True)
    assert set(_manifest(store, "r@2").hinted) == {"big", "small", "other"}
    assert _hint_findings(store) == ["r@2:big"]


def test_background_commit_with_counters_a_write_bypassed_is_reported(store: casckpt.Store) -> None:
    """The staging does not copy a tensor its counters vouch for: the fingerprint is taken
    from the live tensor on the caller's thread."""
    state = _state()
    store.commit(state, run="r", step=1, block=False, trust_versions=True).wait()
    state["big"].data.add_(3.0)
    handle = store.commit(state, run="r", step=2, block=False, trust_versions=True)
    handle.wait()
    assert set(_manifest(store, "r@2").hinted) >= {"big", "other"}
    assert _hint_findings(store) == ["r@2:big"]


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_a_dense_wrong_hint_on_a_small_conjugate_view_is_reported_in_the_background(
        store: casckpt.Store, view: str) -> None:
    """A conjugate or negative view is never packed, small as it is: the caller's thread
    samples it like any tensor the staging skipped, so the worker does not fingerprint the
    stale staged copy (which matches the parent and would hide the wrong hint)."""
    base = torch.randn(512, dtype=torch.complex64)  # 4 KiB: below the size tensors are packed at
    state = {"z": base.conj() if view == "conj" else torch._neg_view(base), "big": _state()["big"]}
    store.commit(state, run="r", step=1, block=False, trust_versions=True).wait()
    base.data.mul_(2.0)  # every byte changes; the counter does not move
    store.commit(state, run="r", step=2, block=False, trust_versions=True).wait()
    assert "z" in _manifest(store, "r@2").hinted
    assert _hint_findings(store) == ["r@2:z"]


def test_trusted_counters_after_a_blocking_commit_of_other_bytes_store_the_state(
        store: casckpt.Store) -> None:
    """Counters vouch for a tensor since the run's last staging. A blocking commit of other
    bytes at the same path comes between two trusted background commits: the second one's
    parent is that blocking version, so it must not reuse the parent's ids (the staging is
    copied again), and an honest hint gives no finding."""
    g = torch.Generator().manual_seed(11)
    a, b = {"w": torch.randn(BIG, generator=g)}, {"w": torch.randn(BIG, generator=g)}
    store.commit(a, run="r", step=1, block=False, trust_versions=True).wait()
    store.commit(b, run="r", step=2)
    store.commit(a, run="r", step=3, block=False, trust_versions=True).wait()
    assert torch.equal(store.restore("r@3")["w"], a["w"])
    assert _hint_findings(store) == []


def test_trusted_counters_after_another_handles_commit_store_the_state(tmp_path: Path) -> None:
    """The same with the version between them made by another handle of the store, which
    this handle's committer never sees: its worker finds the parent is not the version its
    last staging made, and hashes the staged bytes (current, as the counters vouch)."""
    g = torch.Generator().manual_seed(12)
    a, b = {"w": torch.randn(BIG, generator=g)}, {"w": torch.randn(BIG, generator=g)}
    with casckpt.open(tmp_path / "s", cache=tmp_path / "cache") as store, \
            casckpt.open(tmp_path / "s", cache=tmp_path / "cache") as other:
        store.commit(a, run="r", step=1, block=False, trust_versions=True).wait()
        other.commit(b, run="r", step=2)
        store.commit(a, run="r", step=3, block=False, trust_versions=True).wait()
        assert torch.equal(store.restore("r@3")["w"], a["w"])
        assert _hint_findings(store) == []


def test_background_commit_with_a_wrong_unchanged_promise_is_reported(store: casckpt.Store) -> None:
    state = _state()
    store.commit(state, run="r", step=1, block=False).wait()
    state["other"].mul_(-1.0)
    store.commit(state, run="r", step=2, block=False, unchanged=["big", "other"]).wait()
    assert set(_manifest(store, "r@2").hinted) == {"big", "other"}
    assert _hint_findings(store) == ["r@2:other"]


def test_a_background_fingerprint_is_taken_before_commit_returns(store: casckpt.Store,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What the hint vouched for is the state when ``commit`` returned: a mutation made after
    it (counted, so the next commit sees it) is neither stored nor reported."""
    gate = threading.Event()
    real = commit_engine.snapshot

    def held(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(30)
        return real(*args, **kwargs)

    state = _state()
    store.commit(state, run="r", step=1, block=False, trust_versions=True).wait()
    monkeypatch.setattr(commit_engine, "snapshot", held)
    handle = store.commit(state, run="r", step=2, block=False, trust_versions=True)
    expected = state["big"].clone()
    state["big"].add_(5.0)  # after return, before the worker hashes anything
    gate.set()
    handle.wait()
    assert torch.equal(store.restore("r@2")["big"], expected)
    assert _hint_findings(store) == []


def test_honest_hints_give_no_finding(store: casckpt.Store) -> None:
    state = _state()
    store.commit(state, run="r", step=1, trust_versions=True)
    state["other"].add_(1.0)
    store.commit(state, run="r", step=2, unchanged=["big", "small"], trust_versions=True)
    store.commit(state, run="r", step=3, block=False, trust_versions=True).wait()
    state["small"].add_(1.0)
    store.commit(state, run="r", step=4, block=False, trust_versions=True, unchanged=["big"]).wait()
    assert set(_manifest(store, "r@2").hinted) == {"big", "small"}
    assert set(_manifest(store, "r@4").hinted) >= {"big"}
    assert _hint_findings(store) == []


def test_tensors_reused_by_their_hash_get_no_fingerprint(store: casckpt.Store) -> None:
    state = _state()
    store.commit(state, run="r", step=1)
    store.commit(state, run="r", step=2)  # unchanged, found by hashing
    state["tiny"] = torch.ones(16)  # packed with small neighbours: never reused on a hint
    store.commit(state, run="r", step=3, unchanged=["tiny"])
    for step in (1, 2, 3):
        assert _manifest(store, f"r@{step}").hinted == {}
    assert store.ops.check(read_data=True).ok


def test_a_wrong_hint_on_a_delta_coded_parent_is_reported(tmp_path: Path) -> None:
    """The check reads the stored chunks through the reader: deltas are decoded first."""
    g = torch.Generator().manual_seed(3)
    with casckpt.open(tmp_path / "s", cache=tmp_path / "c") as store:
        store.ops.set_delta_policy("max")
        w = torch.randn(BIG, generator=g)
        store.commit({"w": w}, run="r", step=1)
        w.view(-1)[::97] += 1e-3
        store.commit({"w": w}, run="r", step=2)
        w.mul_(0.5)
        store.commit({"w": w}, run="r", step=3, unchanged="*")
        assert _hint_findings(store) == ["r@3:w"]


def test_an_encrypted_store_checks_its_keyed_fingerprints(tmp_path: Path) -> None:
    key = tmp_path / "store.key"
    casckpt.generate_key_file(key)
    state = _state()
    with casckpt.open(tmp_path / "s", key_file=key) as store:
        store.commit(state, run="r", step=1)
        state["small"].add_(1.0)
        store.commit(state, run="r", step=2, unchanged="*")
        assert _hint_findings(store) == ["r@2:small"]


def test_the_cli_reports_a_wrong_hint_and_exits_non_zero(tmp_path: Path) -> None:
    state = _state()
    with casckpt.open(tmp_path / "s") as store:
        store.commit(state, run="r", step=1)
        state["big"].add_(1.0)
        store.commit(state, run="r", step=2, unchanged=["big"])
    runner = CliRunner()
    table = runner.invoke(app, ["--store", str(tmp_path / "s"), "check", "--read-data"])
    assert table.exit_code == 1, table.output
    assert "hint" in table.stdout and "r@2:big" in table.stdout
    out = runner.invoke(app, ["--store", str(tmp_path / "s"), "check", "--read-data", "--json"])
    assert out.exit_code == 1
    report = json.loads(out.stdout)
    assert not report["ok"]
    assert [(p["kind"], p["subject"]) for p in report["problems"]] == [("hint", "r@2:big")]
    clean = runner.invoke(app, ["--store", str(tmp_path / "s"), "check"])
    assert clean.exit_code == 0, clean.output  # without --read-data nothing is read


def test_a_sparse_change_outside_the_sample_is_missed(store: casckpt.Store) -> None:
    """The documented limit: a fingerprint is a sample; a change no sampled block holds
    passes (here one element of a block the sample of r@2 leaves out)."""
    from casckpt.format.hintsample import sample_spans

    state = _state()
    store.commit(state, run="r", step=1)
    nbytes = BIG * 4
    sampled = {start // BLOCK for start, _ in sample_spans("r", 2, "big", nbytes)}
    outside = next(b for b in range(nbytes // BLOCK) if b not in sampled)
    state["big"].view(-1)[outside * BLOCK // 4] += 1.0
    store.commit(state, run="r", step=2, unchanged=["big"])
    assert _hint_findings(store) == []
    assert nbytes > WHOLE


@pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
def test_a_wrong_hint_on_a_device_tensor_is_reported(tmp_path: Path) -> None:
    """A device tensor's sampled blocks are gathered on the device (blocking and background)."""
    state = {name: t.cuda() for name, t in _state().items()}
    with casckpt.open(tmp_path / "s", chunk_size=1 << 16, staging_memory=1 << 18) as store:
        store.commit(state, run="r", step=1, trust_versions=True)
        state["big"].data.add_(1.0)
        store.commit(state, run="r", step=2, trust_versions=True)
        # the first background commit has no staged counters yet: it copies and hashes all
        store.commit(state, run="r", step=3, block=False, trust_versions=True).wait()
        state["other"].data.add_(1.0)  # staging skips it: sampled on the device, caller's thread
        store.commit(state, run="r", step=4, block=False, trust_versions=True).wait()
        assert _hint_findings(store) == ["r@2:big", "r@4:other"]


def test_each_chunk_is_read_once_for_every_version_that_samples_it(store: casckpt.Store,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen tensor's chunks serve every version: the check reads each once (per group)."""
    from casckpt.engine.maintenance import checkhint

    state = _state()
    store.commit(state, run="r", step=1)
    for step in range(2, 7):
        state["other"].add_(1.0)
        store.commit(state, run="r", step=step, unchanged=["big", "small"])
    asked: list[bytes] = []
    real = checkhint.read_chunks

    def counting(ctx: Any, wanted: Any, *args: Any, **kwargs: Any) -> int:
        asked.extend(wanted)
        return real(ctx, wanted, *args, **kwargs)

    monkeypatch.setattr(checkhint, "read_chunks", counting)
    assert _hint_findings(store) == []
    assert asked and len(asked) == len(set(asked))


def test_verdicts_hold_when_samples_and_reads_are_split_finely(store: casckpt.Store,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.engine.maintenance import checkhint

    monkeypatch.setattr(checkhint, "SAMPLES", 1)  # one fingerprint per group
    monkeypatch.setattr(checkhint, "READ", 1)  # one chunk per read
    state = _state()
    store.commit(state, run="r", step=1)
    state["other"].view(-1)[: BIG // 2] += 1.0
    store.commit(state, run="r", step=2, unchanged="*")
    state["big"].add_(1.0)
    store.commit(state, run="r", step=3, unchanged=["big", "small"])
    assert _hint_findings(store) == ["r@2:other", "r@3:big"]


def test_a_corrupt_chunk_is_reported_as_corrupt_not_as_a_wrong_hint(tmp_path: Path) -> None:
    state = _state()
    root = tmp_path / "s"
    with casckpt.open(root) as store:
        store.commit(state, run="r", step=1)
        store.commit(state, run="r", step=2, unchanged="*")  # honest
    packs = [p for p in (root / "packs").rglob("*") if p.is_file()]
    for pack in packs:
        data = bytearray(pack.read_bytes())
        for at in range(len(data) // 8, len(data), len(data) // 8):
            data[at] ^= 0x40
        pack.write_bytes(bytes(data))
    with casckpt.open(root, create=False) as store:
        problems = store.ops.check(read_data=True).problems
    assert problems and not [p for p in problems if p.kind == "hint"]


def test_a_wrong_unchanged_promise_about_a_numpy_array_is_reported(store: casckpt.Store) -> None:
    import numpy as np

    state: dict[str, Any] = {"arr": np.arange(BIG, dtype=np.float32), "t": torch.ones(SMALL)}
    store.commit(state, run="r", step=1)
    state["arr"] *= 2.0
    store.commit(state, run="r", step=2, unchanged="*")
    assert set(_manifest(store, "r@2").hinted) == {"arr", "t"}
    assert _hint_findings(store) == ["r@2:arr"]


_change = st.sampled_from(["none", "dense", "one element", "one block"])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), sizes=st.lists(st.integers(SMALL, 3 * WHOLE // 4), min_size=1, max_size=4),
       plans=st.lists(st.tuples(st.lists(_change, min_size=4, max_size=4), st.booleans()),
                      min_size=1, max_size=3))
def test_findings_are_exactly_the_versions_whose_sampled_bytes_differ(
        tmp_path_factory: pytest.TempPathFactory, seed: int, sizes: list[int],
        plans: list[tuple[list[str], bool]]) -> None:
    """Whatever a hint wrongly vouches for, and however a commit runs (blocking or in the
    background), the check reports exactly the hinted tensors whose sampled bytes, as the
    caller handed them, differ from what the version stores."""
    from casckpt.engine.write.hint import sample

    g = torch.Generator().manual_seed(seed)
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    expected: list[str] = []
    with casckpt.open(tmp_path_factory.mktemp("s") / "s") as store:
        store.commit(state, run="r", step=0, trust_versions=True)
        for step, (changes, background) in enumerate(plans, 1):
            for name, how in zip(list(state), changes, strict=False):
                flat = state[name].data.view(-1)  # through .data: the counters do not see it
                if how == "dense":
                    flat.add_(1.0)
                elif how == "one element":
                    flat[int(torch.randint(flat.numel(), (1,), generator=g))] += 1.0
                elif how == "one block":
                    flat[: BLOCK_ELEMENTS] += 1.0
            handed = {name: t.clone() for name, t in state.items()}
            if background:
                store.commit(state, run="r", step=step, block=False, trust_versions=True).wait()
            else:
                store.commit(state, run="r", step=step, trust_versions=True)
            restored = store.restore(f"r@{step}")
            expected += [f"r@{step}:{name}" for name in _manifest(store, f"r@{step}").hinted
                         if sample("r", step, name, handed[name]) != sample("r", step, name, restored[name])]
        assert _hint_findings(store) == sorted(expected)


def test_a_catalog_rebuilt_from_the_locations_still_tells_the_wrong_hint(tmp_path: Path) -> None:
    """The fingerprints live in the manifest objects, not in catalog rows."""
    root, blobs = tmp_path / "s", tmp_path / "blobs"
    state = _state()
    with casckpt.open(root, blobs=str(blobs), cache=tmp_path / "c") as store:
        store.commit(state, run="r", step=1)
        state["small"].add_(1.0)
        store.commit(state, run="r", step=2, unchanged="*")
    for file in root.glob("catalog.db*"):
        file.unlink()
    with casckpt.open(root, blobs=str(blobs), cache=tmp_path / "c2", recover=True) as store:
        assert store.ops.rebuild_catalog().versions == 2
        assert _hint_findings(store) == ["r@2:small"]


def test_a_manifest_claiming_a_huge_chunk_is_reported_without_allocating_it(store: casckpt.Store) -> None:
    """A damaged (validly hashed) manifest whose hinted tensor's extent claims one 1 TiB chunk:
    the check compares the claimed length with the catalog's before it allocates anything, and
    reports the sample unverified."""
    from dataclasses import replace

    from casckpt.engine.maintenance import checkhint
    from casckpt.engine.maintenance.checkmeta import Findings
    from casckpt.format.manifest import ExtentEntry

    state = {"w": torch.randn(1 << 16)}
    store.commit(state, run="r", step=1)
    store.commit(state, run="r", step=2, unchanged=["w"])
    manifest = _manifest(store, "r@2")
    extent = manifest.extents[manifest.tensors[0].extent]
    huge = 1 << 40
    damaged = replace(manifest, tensors=(replace(manifest.tensors[0], shape=(huge // 4,)),),
                      extents=(ExtentEntry(huge, huge, extent.chunks[:1], 0),))
    found = Findings()
    found.manifests.append(("0" * 64, damaged))
    checkhint.check_hints(internals(store).context, found)
    assert [(p.kind, p.subject) for p in found.problems] == [("hint", "r@2:w")]
    assert "the manifest is damaged" in found.problems[0].detail

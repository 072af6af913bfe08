"""The disaster-recovery copies of manifests are checked and repaired (issue 13, case 3).

Flipped, truncated or swapped files under ``manifests/`` on a location used
to pass ``check --read-data``, and a later ``catalog rebuild`` skipped those
versions. Now ``check --read-data`` reads every copy and compares it with the
catalog's, ``repair`` writes the damaged ones again, and a catalog rebuilt
from that location alone has every version.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import casckpt

CHUNK = 4096


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3000,), float(step))}


def _damage(manifests: list[Path], how: str) -> set[str]:
    """Damage the copies; returns the version ids damaged."""
    a, b = manifests[0], manifests[1]
    if how == "flip":
        data = bytearray(a.read_bytes())
        data[len(data) // 2] ^= 0x10
        a.write_bytes(bytes(data))
        return {a.name}
    if how == "truncate":
        a.write_bytes(a.read_bytes()[:7])
        return {a.name}
    data_a, data_b = a.read_bytes(), b.read_bytes()  # swap two versions' copies
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    return {a.name, b.name}


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
def test_damaged_manifest_copies_are_found_repaired_and_rebuild_from_them(tmp_path: Path, how: str) -> None:
    root, dirs = tmp_path / "store", [tmp_path / "d0", tmp_path / "d1"]
    with casckpt.open(root, blobs=[str(d) for d in dirs], redundancy="replicate:2",
                      chunk_size=CHUNK) as store:
        for step in (1, 2, 3):
            store.commit(_state(step), run="r", step=step)
        assert store.ops.check(read_data=True).ok
        damaged = _damage(sorted((dirs[0] / "manifests").iterdir()), how)
        listed = store.ops.check()  # a copy of another size is found from the listing alone
        assert {p.subject for p in listed.problems} <= damaged
        assert how != "truncate" or {p.subject for p in listed.problems} == damaged
        found = store.ops.check(read_data=True)
        assert {p.subject for p in found.problems} == damaged and {p.kind for p in found.problems} == {
            "manifest"}, found.problems
        assert store.ops.repair().manifests_written == len(damaged)
        assert store.ops.check(read_data=True).ok
    shutil.rmtree(dirs[1])  # the other location is lost too: d0's copies are all there is
    for file in root.glob("catalog.db*"):
        file.unlink()
    config = root / "casckpt.toml"  # and the operator drops it from the config
    blocks = config.read_text().split("\n[[locations]]\n")
    config.write_text("\n[[locations]]\n".join(b for b in blocks if str(dirs[1]) not in b))
    with casckpt.open(root, recover=True) as store:
        report = store.ops.rebuild_catalog()
        assert report.versions == 3 and report.skipped == ()
        for step in (1, 2, 3):
            assert torch.equal(store.restore(f"r@{step}")["w"], _state(step)["w"])

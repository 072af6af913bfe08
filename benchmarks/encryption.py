"""The ``encryption`` workload: an encrypted store against a plain one (issue 19).

Target: "Encrypted commit and restore <= 1.15x unencrypted (dense 1 GiB, same run);
unchanged re-commit of an encrypted store still writes 0 new bytes."

Everything in one process, one work directory, one run. The state is the ``dense``
workload's (the decoder + AdamW moments, ~1 GiB at scale 1.0), committed as it is
(no interval). Two kinds of store with the same settings (the defaults), one plain and
one encrypted (``casckpt.open(..., key_file=...)``: every object sealed with
AES-256-GCM in 256 KiB segments, chunk ids keyed BLAKE3).

Each of ``REPEATS`` repetitions creates a **fresh store of each kind** (so every first
commit writes every chunk; the store is made before the clock starts) and, in it:

* **commit**: a blocking first commit of the state (``run="r", step=0``);
* **restore**: ``restore("r@0")`` of the whole state (the packs just written, so
  mostly from the page cache, for both kinds alike);
* **re-commit**: a blocking commit of the same, unchanged state (``step=1``), no hints:
  its ``new_bytes`` must be 0.

The two kinds alternate, and which goes first alternates per repetition, to cancel
drift; every figure is the median of the repetitions. Every restore is compared with
the state byte for byte (BLAKE3 of each tensor's raw bytes, plus the tree's plain
values). Each repetition's stores are deleted before the next one.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from rich.table import Table

import casckpt
from benchmarks import measure
from benchmarks.workloads import build

Log = Callable[[str], None]

NAME = "encryption"
REPEATS = 3
KINDS = ("plain", "encrypted")


@dataclass(frozen=True)
class EncryptionResult:
    """Raw numbers of the ``encryption`` workload (seconds: medians of ``REPEATS``).

    ``recommit_new_bytes``: the largest ``new_bytes`` of an unchanged re-commit over the
    repetitions, per kind. ``disk_bytes``: the store directory's size after the
    re-commit (first repetition), per kind. ``restores_match``: every restore of both
    kinds equal to the state byte for byte.
    """

    name: str
    logical_bytes: int
    commit_s: dict[str, float]
    restore_s: dict[str, float]
    recommit_s: dict[str, float]
    recommit_new_bytes: dict[str, int]
    disk_bytes: dict[str, int]
    restores_match: bool
    samples: dict[str, list[float]]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


def _clock(fn: Callable[[], Any]) -> tuple[Any, float]:
    measure.release_memory()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _bit_exact(state: Any, digests: dict[str, tuple[int, bytes]], restored: Any) -> bool:
    return measure.tensor_digests(restored) == digests and measure.trees_equal(state, restored)


def _one(kind: str, root: Path, key_file: Path, state: Any, digests: dict[str, tuple[int, bytes]],
         samples: dict[str, list[float]]) -> tuple[int, int, bool]:
    """One repetition on a fresh store of ``kind``: (re-commit new bytes, disk bytes, match)."""
    with casckpt.open(root, key_file=key_file if kind == "encrypted" else None) as store:
        _, seconds = _clock(lambda: store.commit(state, run="r", step=0))
        samples[f"commit_{kind}"].append(seconds)
        restored, seconds = _clock(lambda: store.restore("r@0"))
        samples[f"restore_{kind}"].append(seconds)
        match = _bit_exact(state, digests, restored)
        del restored
        again, seconds = _clock(lambda: store.commit(state, run="r", step=1))
        samples[f"recommit_{kind}"].append(seconds)
    return again.new_bytes, measure.path_bytes(root), match


def run_encryption(scale: float, workdir: Path, log: Log) -> EncryptionResult:
    """Measure the ``encryption`` workload at ``scale`` in the empty directory ``workdir``."""
    state = build("dense", scale).state()
    logical = measure.logical_bytes(state)
    digests = measure.tensor_digests(state)
    key_file = workdir / "store.key"
    casckpt.generate_key_file(key_file)
    samples: dict[str, list[float]] = {f"{op}_{kind}": [] for op in ("commit", "restore", "recommit")
                                       for kind in KINDS}
    new_bytes = dict.fromkeys(KINDS, 0)
    disk = dict.fromkeys(KINDS, 0)
    matches = True
    log(f"{NAME}: dense ({measure.fmt_bytes(logical)}): plain vs encrypted store, fresh stores, "
        f"commit / restore / unchanged re-commit, x{REPEATS}")
    for i in range(REPEATS):
        for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
            root = workdir / f"{kind}-{i}"
            wrote, size, match = _one(kind, root, key_file, state, digests, samples)
            new_bytes[kind] = max(new_bytes[kind], wrote)
            disk[kind] = disk[kind] or size
            matches = matches and match
            measure.remove(root)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return EncryptionResult(
        NAME, logical,
        {k: med[f"commit_{k}"] for k in KINDS}, {k: med[f"restore_{k}"] for k in KINDS},
        {k: med[f"recommit_{k}"] for k in KINDS}, new_bytes, disk, matches, samples,
    )


def _ratio(op: str) -> Callable[[EncryptionResult], float | None]:
    def compute(r: EncryptionResult) -> float | None:
        times: dict[str, float] = getattr(r, f"{op}_s")
        return times["encrypted"] / times["plain"] if times["plain"] else None
    return compute


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Literal["ratio", "fraction", "seconds", "mb_per_s"]
    compute: Callable[[EncryptionResult], float | None]


MEASURES: tuple[Measure, ...] = (
    Measure("commit_encrypted_vs_plain", "first commit, encrypted / plain store", "ratio", _ratio("commit")),
    Measure("restore_encrypted_vs_plain", "restore, encrypted / plain store", "ratio", _ratio("restore")),
    Measure("recommit_encrypted_vs_plain", "unchanged re-commit, encrypted / plain store", "ratio",
            _ratio("recommit")),
    Measure("recommit_new_encrypted_of_logical", "unchanged re-commit, encrypted: new bytes / logical",
            "fraction", lambda r: r.recommit_new_bytes["encrypted"] / r.logical_bytes),
    Measure("disk_encrypted_vs_plain", "store size on disk, encrypted / plain", "ratio",
            lambda r: r.disk_bytes["encrypted"] / r.disk_bytes["plain"] if r.disk_bytes["plain"] else None),
)

TARGETS: dict[str, float] = {  # issue 19
    "commit_encrypted_vs_plain": 1.15,
    "restore_encrypted_vs_plain": 1.15,
    "recommit_new_encrypted_of_logical": 0.0,
}

NOTES = (f"see benchmarks/encryption.py; the dense state at --scale, a fresh plain and a fresh "
         f"encrypted store per repetition (same defaults), kinds alternating, medians of {REPEATS}; "
         "restores compared byte for byte")


def raw_table(outcomes: Mapping[str, EncryptionResult]) -> Table:
    """The encryption workload's raw medians, one row per kind of store."""
    table = Table(title=f"encryption: plain vs encrypted store, dense state (medians of {REPEATS})")
    for column in ("store", "logical", "commit", "restore", "unchanged re-commit", "re-commit new",
                   "on disk", "bit-exact"):
        table.add_column(column, justify="left" if column == "store" else "right")

    def ms(s: float) -> str:
        return f"{s * 1000:.1f} ms"

    for r in outcomes.values():
        for kind in KINDS:
            table.add_row(kind, measure.fmt_bytes(r.logical_bytes), ms(r.commit_s[kind]),
                          ms(r.restore_s[kind]), ms(r.recommit_s[kind]),
                          measure.fmt_bytes(r.recommit_new_bytes[kind]),
                          measure.fmt_bytes(r.disk_bytes[kind]),
                          "yes" if r.restores_match else "[red]NO[/]")
    return table

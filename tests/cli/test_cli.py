"""The ``casckpt`` command line, driven through typer's CliRunner and once as a real process."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from doubles import ForkedPython
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner, Result

import casckpt
from casckpt import errors
from casckpt.cli.main import app, exit_code_for
from casckpt.cli.progress import progress_bars

RUN = "demo-run"


def make_state() -> dict[str, Any]:
    return {
        "model": {
            "weight": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
            "bias": torch.tensor([1.5, -2.0, float("nan")], dtype=torch.bfloat16),
        },
        "optim": {"lr": 0.001, "betas": (0.9, 0.999), "state": {0: {"step": 7}}},
        "epoch": 3,
        "name": "warmup",
        "blob": b"\x00\xffraw",
        "done": None,
        "counts": np.arange(5, dtype=np.int16),
    }


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A store with two versions of RUN, for tests that only read."""
    path = tmp_path_factory.mktemp("shared") / "store"
    _fill(path)
    yield path
    _assert_store_ok(path)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    """A fresh store with two versions of RUN, for tests that write or corrupt."""
    path = tmp_path / "store"
    _fill(path)
    yield path


def _fill(path: Path) -> None:
    with casckpt.open(path) as s:
        s.commit(make_state(), run=RUN, step=100, metrics={"loss": 0.5}, message="first")
        s.commit({**make_state(), "epoch": 4}, run=RUN, step=200, metrics={"loss": 0.25})


def _assert_store_ok(path: Path) -> None:
    with casckpt.open(path, create=False) as s:
        assert s.ops.check().ok


def _version(path: Path, ref: str) -> casckpt.Version:
    with casckpt.open(path, create=False) as s:
        return s.resolve(ref)


def cli(store: Path | None, *args: str, env: dict[str, str | None] | None = None) -> Result:
    prefix = ["--store", str(store)] if store is not None else []
    return CliRunner().invoke(app, [*prefix, *args], env=env)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_runs_table_lists_the_run(shared_store: Path) -> None:
    result = cli(shared_store, "runs")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if RUN in line)
    assert "200" in row and _version(shared_store, f"{RUN}@200").short_id in row


def test_log_table_shows_versions_newest_first(shared_store: Path) -> None:
    result = cli(shared_store, "log", RUN)
    assert result.exit_code == 0, result.output
    old, new = (_version(shared_store, f"{RUN}@{s}").short_id for s in (100, 200))
    assert result.stdout.index(new) < result.stdout.index(old)
    assert "loss=0.5" in result.stdout and "first" in result.stdout


def test_log_json_respects_limit(shared_store: Path) -> None:
    result = cli(shared_store, "log", "--json", "--limit", "1")
    assert result.exit_code == 0, result.output
    entries = json.loads(result.stdout)
    assert [e["step"] for e in entries] == [200]
    assert entries[0]["id"] == _version(shared_store, f"{RUN}@latest").id


def test_show_table_lists_tensors_and_values(shared_store: Path) -> None:
    result = cli(shared_store, "show", f"{RUN}@100", "--tensors")
    assert result.exit_code == 0, result.output
    for text in (
        "model.weight",
        "model.bias",
        "counts",
        "optim.lr",
        "'warmup'",
        "first",
        _version(shared_store, f"{RUN}@100").id,
    ):
        assert text in result.stdout


def test_show_summarises_tensors_by_group_unless_asked_for_each(shared_store: Path) -> None:
    result = cli(shared_store, "show", f"{RUN}@100")
    assert result.exit_code == 0, result.output
    assert "3 tensor(s)" in result.stdout and "model.weight" not in result.stdout
    groups = [line.split()[:2] for line in result.stdout.splitlines()
              if line.split()[:1] in (["model"], ["counts"])]
    assert groups == [["counts", "1"], ["model", "2"]]


def test_show_lists_tensors_in_natural_order(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with casckpt.open(path) as store:
        store.commit({f"layers.{i}.w": torch.zeros(1) for i in (10, 2, 1)}, run="r", step=1)
    listed = cli(path, "show", "r@1", "--tensors")
    paths = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("layers.")]
    assert paths == ["layers.1.w", "layers.2.w", "layers.10.w"]
    as_json = json.loads(cli(path, "show", "r@1", "--json").stdout)
    assert [t["path"] for t in as_json["tensors"]] == paths


def test_show_json_has_step_tensors_and_values(shared_store: Path) -> None:
    result = cli(shared_store, "show", f"{RUN}@100", "--json")
    assert result.exit_code == 0, result.output
    detail = json.loads(result.stdout)
    assert detail["version"]["step"] == 100
    assert detail["version"]["id"] == _version(shared_store, f"{RUN}@100").id
    assert {t["path"] for t in detail["tensors"]} == {"model.weight", "model.bias", "counts"}
    assert detail["values"]["blob"] == base64.b64encode(b"\x00\xffraw").decode()
    assert detail["values"]["epoch"] == 3


def test_stats(shared_store: Path) -> None:
    as_json = cli(shared_store, "stats", "--json")
    assert as_json.exit_code == 0, as_json.output
    numbers = json.loads(as_json.stdout)
    assert (numbers["runs"], numbers["versions"]) == (1, 2)
    assert numbers["dedup_ratio"] >= 1.9  # the second version shares every tensor chunk
    table = cli(shared_store, "stats")
    assert table.exit_code == 0 and "dedup ratio" in table.stdout


def test_tag_then_show_by_tag(store: Path) -> None:
    tagged = cli(store, "tag", f"{RUN}@100", "best", "--json")
    assert tagged.exit_code == 0, tagged.output
    assert json.loads(tagged.stdout)["step"] == 100
    shown = cli(store, "show", "tag:best", "--json")
    assert shown.exit_code == 0, shown.output
    version = json.loads(shown.stdout)["version"]
    assert version["step"] == 100 and "best" in version["tags"]
    bad = cli(store, "tag", f"{RUN}@100", "../escape")
    assert bad.exit_code == 2, bad.output


def test_tags_lists_every_tag_with_its_version(store: Path) -> None:
    assert cli(store, "tags").exit_code == 0 and "no tags yet" in cli(store, "tags").output
    for ref, name in ((f"{RUN}@100", "first"), (f"{RUN}@200", "best"), (f"{RUN}@200", "release")):
        assert cli(store, "tag", ref, name).exit_code == 0
    assert cli(store, "tag", f"{RUN}@100", "best").exit_code == 0  # moved
    table = cli(store, "tags")
    assert table.exit_code == 0, table.output
    names = (["best"], ["first"], ["release"])
    lines = [line.split() for line in table.stdout.splitlines() if line.split()[:1] in names]
    assert [(w[0], w[2], w[3]) for w in lines] == [("best", RUN, "100"), ("first", RUN, "100"),
                                                   ("release", RUN, "200")]
    listed = json.loads(cli(store, "tags", RUN, "--json").stdout)
    assert [(t["name"], t["version"]["step"]) for t in listed] == [("best", 100), ("first", 100),
                                                                   ("release", 200)]
    assert listed[0]["version"]["id"] == _version(store, f"{RUN}@100").id
    unknown = cli(store, "tags", "no-such-run")
    assert unknown.exit_code == 3 and "no run" in unknown.output


def test_restore_round_trips_bit_exact(shared_store: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    result = cli(shared_store, "restore", f"{RUN}@100", "--to", str(target))
    assert result.exit_code == 0, result.output
    state = make_state()
    loaded = load_file(str(target))
    expected = {
        "model.weight": state["model"]["weight"],
        "model.bias": state["model"]["bias"],
        "counts": torch.from_numpy(state["counts"]),
    }
    assert loaded.keys() == expected.keys()
    for path, tensor in expected.items():
        assert loaded[path].dtype == tensor.dtype and loaded[path].shape == tensor.shape
        assert _bits(loaded[path]) == _bits(tensor), path
    with safe_open(str(target), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["casckpt.version"] == _version(shared_store, f"{RUN}@100").id
    assert json.loads(metadata["casckpt.values"]) == {
        "optim.lr": 0.001,
        "optim.betas.0": 0.9,
        "optim.betas.1": 0.999,
        "optim.state.0.step": 7,
        "epoch": 3,
        "name": "warmup",
        "blob": base64.b64encode(b"\x00\xffraw").decode(),
        "done": None,
    }


def test_restore_refuses_to_overwrite_without_force(shared_store: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    target.write_bytes(b"keep me")
    refused = cli(shared_store, "restore", f"{RUN}@100", "--to", str(target))
    assert refused.exit_code == 2 and "--force" in refused.stderr
    assert target.read_bytes() == b"keep me"
    forced = cli(shared_store, "restore", f"{RUN}@100", "--to", str(target), "--force", "--json")
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.stdout)["tensors"] == 3


def test_restore_exports_tensors_sharing_storage(tmp_path: Path) -> None:
    base = torch.arange(10, dtype=torch.float32)
    with casckpt.open(tmp_path / "s") as s:
        s.commit({"full": base, "tail": base[4:], "again": base}, run="views", step=1)
    target = tmp_path / "views.safetensors"
    result = cli(tmp_path / "s", "restore", "views@1", "--to", str(target))
    assert result.exit_code == 0, result.output
    loaded = load_file(str(target))
    assert torch.equal(loaded["full"], base) and torch.equal(loaded["again"], base)
    assert torch.equal(loaded["tail"], base[4:])


def test_restore_writes_large_values_to_a_sidecar(tmp_path: Path) -> None:
    big = "x" * (70 * 1024)
    with casckpt.open(tmp_path / "s") as s:
        s.commit({"w": torch.ones(2), "notes": big}, run="big", step=1)
    target = tmp_path / "big.safetensors"
    result = cli(tmp_path / "s", "restore", "big@1", "--to", str(target))
    assert result.exit_code == 0, result.output
    sidecar = tmp_path / "big.values.json"
    assert str(sidecar) in result.stderr
    assert json.loads(sidecar.read_text(encoding="utf-8")) == {"notes": big}
    with safe_open(str(target), framework="pt") as f:
        metadata = f.metadata()
    assert "casckpt.values" not in metadata
    assert metadata["casckpt.values_file"] == sidecar.name


def test_check_passes_then_finds_a_flipped_pack_byte(store: Path) -> None:
    clean = cli(store, "check", "--read-data", "--json")
    assert clean.exit_code == 0, clean.output
    assert json.loads(clean.stdout)["ok"] is True
    packs = [p for p in (store / "packs").rglob("*") if p.is_file()]
    assert packs, "the store wrote no pack file"
    pack = max(packs, key=lambda p: p.stat().st_size)
    data = bytearray(pack.read_bytes())
    data[len(data) // 3] ^= 0x40
    pack.write_bytes(bytes(data))
    dirty = cli(store, "check", "--read-data")
    assert dirty.exit_code == 1, dirty.output
    assert "problem" in dirty.stdout
    dirty_json = cli(store, "check", "--read-data", "--json")
    assert dirty_json.exit_code == 1
    assert json.loads(dirty_json.stdout)["problems"]


def test_unknown_ref_exits_3_with_one_line_message(shared_store: Path) -> None:
    result = cli(shared_store, "show", f"{RUN}@999")
    assert result.exit_code == 3
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("casckpt: error:") and "@999" in lines[0]
    assert "Traceback" not in result.output


def test_missing_store_exits_3(tmp_path: Path) -> None:
    result = cli(tmp_path / "nowhere", "log")
    assert result.exit_code == 3
    assert "casckpt: error:" in result.stderr and "Traceback" not in result.output


def test_no_store_given_is_a_usage_error() -> None:
    result = cli(None, "runs", env={"CASCKPT_STORE": None})
    assert result.exit_code == 2
    assert "CASCKPT_STORE" in result.stderr


def test_store_from_environment(shared_store: Path) -> None:
    result = cli(None, "runs", "--json", env={"CASCKPT_STORE": str(shared_store)})
    assert result.exit_code == 0, result.output
    assert [r["name"] for r in json.loads(result.stdout)] == [RUN]


def test_init_creates_then_leaves_a_store(tmp_path: Path) -> None:
    path = tmp_path / "fresh"
    created = cli(None, "init", str(path))
    assert created.exit_code == 0, created.output
    assert "Created" in created.stdout
    again = cli(path, "init")
    assert again.exit_code == 0 and "already exists" in again.stdout
    assert json.loads(cli(path, "runs", "--json").stdout) == []


def test_migrate_opens_and_reports(shared_store: Path) -> None:
    result = cli(shared_store, "migrate")
    assert result.exit_code == 0, result.output
    assert "up to date" in result.stdout


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.InvalidNameError("x"), 2),
        (errors.RestoreTargetError("x"), 2),
        (errors.UnsupportedStateError("x"), 2),
        (errors.NotAStoreError("x"), 3),
        (errors.RefNotFoundError("a@1", "no such step"), 3),
        (errors.AmbiguousRefError("x"), 3),
        (errors.CorruptChunkError("x"), 4),
        (errors.MissingDataError("x"), 4),
        (errors.StorageError("x"), 5),
        (errors.SchemaTooNewError("x"), 5),
        (errors.InvalidConfigError("x"), 2),
        (errors.StorageFullError("x"), 5),
        (errors.UnsafeObjectError("x"), 5),
        (errors.StoreIdentityError("x"), 5),
        (errors.CatalogUnavailableError("x"), 5),
        (errors.VersionMismatchError("x"), 4),
        (errors.GCRunningError("x"), 6),
        (errors.GCRefusedError("x"), 7),
        (errors.StoreUnavailableError("x"), 9),
        (errors.RetryableStorageError("x"), 5),
        (errors.ReadOnlyStoreError("x"), 8),
        (errors.AccessDeniedError("x"), 8),
        (errors.StoreKeyError("x"), 8),
        (errors.KeyRequiredError("x"), 8),
        (errors.CatalogError("x"), 5),
    ],
)
def test_exit_codes(error: errors.CasckptError, code: int) -> None:
    assert exit_code_for(error) == code


def test_help_documents_exit_codes() -> None:
    from casckpt.cli.shared import EXIT_CODES

    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.replace("│", " ").split())
    for entry in EXIT_CODES:
        assert f"{entry.code} {' '.join(entry.meaning.split())}" in text, entry
    assert "commands that write fail (exit 8)" in text  # --read-only: a ReadOnlyStoreError exits 8


def test_the_troubleshooting_guide_tables_the_exit_codes_the_cli_uses() -> None:
    """The guide's table is generated from EXIT_CODES: regenerate it when they change, with
    ``python -c "from casckpt.cli.shared import exit_codes_markdown; print(exit_codes_markdown())"``."""
    from casckpt.cli.shared import exit_codes_markdown

    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "troubleshooting.md").read_text()
    assert exit_codes_markdown() in guide
    assert "| 8 | denied" in guide


def _one_error_line(result: Result, *words: str) -> None:
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("casckpt: error:"), result.stderr
    for word in words:
        assert word in lines[0], f"{word!r} missing from {lines[0]!r}"


@pytest.mark.parametrize("text", [
    b"[store]\nformat = 1\n# caf\xe9\n",  # used to exit 1 ("check found problems") with a traceback
    b"[store\nformat = 1\n",
    b'[store]\nformat = 1\nwrite_quorum = "2"\n',
    b'[store]\nformat = 1\n[s3]\nendpoint = "http://x"\n',
], ids=["not-utf8", "not-toml", "wrong-type", "unknown-s3-option"])
def test_bad_config_file_exits_2_with_one_line(store: Path, text: bytes) -> None:
    (store / "casckpt.toml").write_bytes(text)
    result = cli(store, "log")
    assert result.exit_code == 2, result.output
    _one_error_line(result, str(store / "casckpt.toml"))


def test_bad_config_file_in_a_real_process(store: Path, forked_python: ForkedPython) -> None:
    (store / "casckpt.toml").write_bytes(b"[store]\nformat = 1\n# caf\xe9\n")
    done = forked_python.run(["-m", "casckpt.cli.main", "--store", str(store), "runs"], timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("casckpt: error:") and "UTF-8" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unexpected_error_exits_70_with_its_traceback(shared_store: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: casckpt.Store) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(casckpt.Store, "runs", broken)
    result = cli(shared_store, "runs")
    assert result.exit_code == 70, result.output  # never 1: that means "check found problems"
    assert "Traceback" in result.stderr and "ZeroDivisionError: a bug" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("casckpt: error: internal error") and "report" in last


def test_interrupt_exits_130(shared_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(self: casckpt.Store) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(casckpt.Store, "runs", interrupted)
    result = cli(shared_store, "runs")
    assert result.exit_code == 130, result.output
    _one_error_line(result, "interrupted")


def test_usage_errors_keep_their_code(shared_store: Path) -> None:
    for args in (["runs", "--no-such-option"], ["no-such-command"], ["show"]):
        result = cli(shared_store, *args)
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output


def test_stdout_closed_early_exits_141_quietly(shared_store: Path) -> None:
    env = {**os.environ, "CASCKPT_STORE": str(shared_store)}
    with subprocess.Popen([sys.executable, "-m", "casckpt.cli.main", "log", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # as `casckpt log | head -0` would
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141, stderr
    assert stderr == ""


def test_progress_bars_draw_each_phase() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with progress_bars(console) as update:
        assert update is not None
        update("read", 512, 2048)
        update("check", 3, 4)
    assert "read" in out.getvalue() and "check" in out.getvalue()
    with progress_bars() as none:  # pytest's stderr is not a terminal
        assert none is None


def test_console_entry_point_in_a_subprocess(shared_store: Path, forked_python: ForkedPython) -> None:
    env = {**os.environ, "CASCKPT_STORE": str(shared_store)}
    missing = forked_python.run(["-m", "casckpt.cli.main", "show", f"{RUN}@999", "--json"], env=env,
                                timeout=120)
    assert missing.returncode == 3, missing.stderr
    assert missing.stdout == ""
    assert missing.stderr.startswith("casckpt: error:") and "Traceback" not in missing.stderr


def test_init_records_s3_and_postgres_so_the_path_alone_opens_the_store(
    tmp_path: Path, pg_url: str, s3_bucket_url: Any, moto_endpoint: str
) -> None:
    root = tmp_path / "team-store"
    blobs = s3_bucket_url()
    result = cli(None, "init", str(root), "--blobs", blobs, "--catalog", pg_url,
                 "--s3-endpoint", moto_endpoint, "--sse", "AES256")
    assert result.exit_code == 0, result.output
    config = (root / "casckpt.toml").read_text()
    assert blobs in config and "postgresql+psycopg" in config and moto_endpoint in config
    state = make_state()
    with casckpt.open(root, create=False) as store:  # the path alone: S3 + PostgreSQL
        version = store.commit(state, run=RUN, step=5)
    listed = json.loads(cli(root, "log", RUN, "--json").stdout)
    assert [v["id"] for v in listed] == [version.id]
    assert not any(p.is_dir() and p.name == "packs" for p in root.iterdir())  # packs went to S3


# -- absurd numbers: every numeric option gives a typed error or works, never exit 70 -----------

_NUMERIC_METAVARS = {"N", "K", "S", "STEP", "SIZE", "AGE", "TIME", "SECONDS", "P%", "NAME=NUMBER",
                     "METRIC:N:min|max"}
"""The metavars of options that take a number (or a number with a unit)."""

_NUMERIC_CASES: list[tuple[tuple[str, ...], str]] = [
    # (the words before the value, where "{n}" is a fresh name; a template for the value)
    (("init", "{tmp}/new{n}", "--fast-tier", "{tmp}/tier{n}", "--fast-tier-bytes"), "{}"),
    (("check", "--read-data-subset"), "{}"),
    (("gc", "--dry-run", "--grace"), "{}"), (("gc", "--history", "--since"), "{}"),
    (("log", "--since"), "{}"), (("log", "--until"), "{}"), (("log", "--min-step"), "{}"),
    (("log", "--max-step"), "{}"), (("log", "--limit"), "{}"), (("log", RUN, "--where"), "loss>{}"),
    (("audit", "--since"), "{}"), (("audit", "--until"), "{}"), (("audit", "--limit"), "{}"),
    (("drain", "--timeout"), "{}"),
    (("import", "{tmp}/in.pt", "--run", "imported", "--step"), "{}"),
    (("add", "{tmp}/tree", "--run", "trees", "--step"), "{}"),
    (("add", "{tmp}/tree", "--run", "trees", "--step", "{n}", "--metric"), "m={}"),
    (("drill", "--run", RUN, "--count"), "{}"), (("drill", "--run", RUN, "--count", "1", "--seed"), "{}"),
    (("drill", "--limit"), "{}"),
    (("advise", RUN, "--mtbf"), "{}"), (("advise", RUN, "--mtbf", "1h", "--restart"), "{}"),
    (("retention", "set", RUN, "--keep-last"), "{}"), (("retention", "set", RUN, "--keep-every"), "{}"),
    (("retention", "set", RUN, "--keep-hourly"), "{}"), (("retention", "set", RUN, "--keep-daily"), "{}"),
    (("retention", "set", RUN, "--keep-weekly"), "{}"), (("retention", "set", RUN, "--keep-within"), "{}"),
    (("retention", "set", RUN, "--keep-best"), "loss:{}:min"),
    *((("mirror", "add", "{n}", "--to", "{tmp}/mirror{n}", "--run", RUN, flag), "{}") for flag in (
        "--keep-last", "--keep-every", "--keep-hourly", "--keep-daily", "--keep-weekly", "--keep-within")),
    (("mirror", "add", "{n}", "--to", "{tmp}/mirror{n}", "--run", RUN, "--keep-best"), "loss:{}:min"),
    (("location", "list", "--timeout"), "{}"),
    (("delta", "set"), "{}"), (("delta", "set", "--run", RUN), "{}"),
    (("show",), RUN + "@{}"), (("show",), RUN + "@~{}"),
]

_ABSURD = ["99999999999999999999999", "-99999999999999999999999", "9223372036854775807",
           "9223372036854775808", "-9223372036854775809", "1e309", "-1e309", "1e18", "nan", "inf",
           "-inf", "-0", "0", "-1", "1_000", "0x10", ""]


def _numbers() -> Any:
    from hypothesis import strategies as st

    number = st.one_of(
        st.sampled_from(_ABSURD),
        st.integers(min_value=-(10**40), max_value=10**40).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
    )
    unit = st.sampled_from(["", "", "s", "m", "h", "d", "w", "y", "%", "KiB", "GiB", "EiB", "B"])
    return st.tuples(number, unit).map("".join)


def _numeric_options() -> set[tuple[str, str]]:
    """(command, option) for every option of the CLI whose metavar says it takes a number."""
    import typer

    found: set[tuple[str, str]] = set()

    def walk(command: Any, words: tuple[str, ...]) -> None:
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, (*words, name))
        for param in command.params:
            if param.param_type_name == "option" and param.metavar in _NUMERIC_METAVARS:
                found.add((" ".join(words), param.opts[0]))

    walk(typer.main.get_command(app), ())
    return found


def test_the_numeric_fuzz_covers_every_numeric_option() -> None:
    covered = set()
    for words, _ in _NUMERIC_CASES:
        command: list[str] = []
        for word in words:
            if word.startswith(("--", "{")) or word == RUN:
                break
            command.append(word)
        covered.add((" ".join(command), words[-1]))
    assert _numeric_options() <= covered, _numeric_options() - covered


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A store with versions, metrics and a drill, plus a checkpoint file and a directory to add."""
    root = tmp_path_factory.mktemp("numeric-fuzz")
    _fill(root / "store")
    torch.save({"w": torch.zeros(3)}, root / "in.pt")
    (root / "tree").mkdir()
    (root / "tree" / "a.txt").write_text("a")
    yield root / "store"


def test_absurd_numbers_on_the_command_line_give_typed_errors(
        fuzz_store: Path, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every numeric option, given huge, negative, NaN, infinite or malformed numbers, either
    works or exits with a documented code and one line: never 70 (a bug), never a traceback."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    from casckpt.cli.shared import EXIT_INTERNAL

    monkeypatch.chdir(fuzz_store.parent)  # nothing a command writes leaves the test's directory
    counter = iter(range(10**9))

    @settings(max_examples=100, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=st.sampled_from(_NUMERIC_CASES), value=_numbers())
    @example(case=(("log", "--limit"), "{}"), value="99999999999999999999999")
    @example(case=(("audit", "--limit"), "{}"), value="9223372036854775808")
    @example(case=(("location", "list", "--timeout"), "{}"), value="1e18")
    @example(case=(("delta", "set"), "{}"), value="99999999999999999999999")
    def check(case: tuple[tuple[str, ...], str], value: str) -> None:
        words, template = case
        n = str(next(counter))
        args = [w.replace("{tmp}", str(fuzz_store.parent)).replace("{n}", n) for w in words]
        result = cli(fuzz_store, *args, template.format(value))
        assert result.exit_code in range(9), (args, value, result.output)
        assert result.exit_code != EXIT_INTERNAL and "Traceback" not in result.output, (args, value)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception

    check()

"""casckpt.cli.params: command-line values converted as typer converts them, without pydantic.

Behaviour only: the listing commands run in a fresh interpreter without importing pydantic
(nor numpy); a value typer would refuse is refused with a usage error (exit 2) naming it;
every parameter of every command is either converted here or left to typer on purpose.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer.main
from typer import BadParameter
from typer.testing import CliRunner

import casckpt
from casckpt.cli import params
from casckpt.cli.main import app

RUN = "params"
runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("params") / "store"
    with casckpt.open(root) as s:
        for step in range(3):
            s.commit({"w": torch.full((4,), float(step))}, run=RUN, step=step, metrics={"loss": 1.0})
    return root


def test_listing_commands_import_neither_pydantic_nor_numpy(store: Path) -> None:
    code = """
import json, sys
from casckpt.cli.main import app
codes = []
for args in json.loads(sys.argv[1]):
    try:
        app(args, standalone_mode=False)
        codes.append(0)
    except SystemExit as exc:
        codes.append(exc.code)
print("\\n" + json.dumps([codes, [m for m in ("pydantic", "numpy") if m in sys.modules]]))
"""
    commands = [["--store", str(store), "runs"], ["--store", str(store), "log", RUN, "-n", "2"],
                ["--store", str(store), "lineage"], ["--help"], ["log", "--help"]]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    codes, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == [0] * len(commands)
    assert loaded == []


@pytest.mark.parametrize(("value", "said"), [("x", "'x' is not a valid integer"),
                                             ("1.5", "'1.5' is not a valid integer"),
                                             ("0", "0 is below the least value allowed, 1")])
def test_a_bad_number_is_a_usage_error_naming_it(store: Path, value: str, said: str) -> None:
    result = runner.invoke(app, ["--store", str(store), "log", RUN, "-n", value])
    assert result.exit_code == 2
    assert said in " ".join(result.output.split()).replace("│ ", "")


def test_values_arrive_with_their_types(store: Path) -> None:
    result = runner.invoke(app, ["--store", str(store), "log", RUN, "-n", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert [v["step"] for v in json.loads(result.output)] == [2, 1]
    result = runner.invoke(app, ["--store", str(store), "runs", "--json"])
    assert result.exit_code == 0, result.output


def test_a_flag_from_the_environment_is_read_as_typer_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    small = typer.Typer()
    seen: list[object] = []

    @small.command()
    def show(flag: bool = typer.Option(False, envvar="PARAMS_FLAG")) -> None:
        seen.append(flag)

    command = typer.main.get_command(small)
    params.convert_here(command)
    for text in ("yes", "TRUE", "0", "off"):
        monkeypatch.setenv("PARAMS_FLAG", text)
        command.main([], standalone_mode=False)
    assert seen == [True, True, False, False]
    monkeypatch.setenv("PARAMS_FLAG", "maybe")
    with pytest.raises(BadParameter, match="'maybe' is not a valid boolean"):
        command.main([], standalone_mode=False)


def test_a_path_keeps_typers_checks(store: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    result = runner.invoke(app, ["--store", str(store), "--fast-tier", str(a_file), "runs"])
    assert result.exit_code == 2
    assert "is a file" in result.output


def test_every_parameter_is_converted_here_or_left_to_typer_on_purpose() -> None:
    command = typer.main.get_command(app)
    params.convert_here(command)
    left: list[tuple[str, object]] = []

    def walk(cmd: object) -> None:
        for param in cmd.params:  # type: ignore[attr-defined]
            if not params.converted_here(param):
                left.append((param.name, param.type_descriptor.annotation))
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(command)
    assert left == []

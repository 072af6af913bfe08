"""Invariant 7: bad input gets a typed CasckptError subclass that says what to do.

Every error here is checked three ways: its casckpt type, the builtin it also
is (so callers can catch either), and key words of its message. Errors raised
on commit must leave nothing behind: no version, no pack, no manifest.
"""

from __future__ import annotations

import enum
import sqlite3
import warnings
from collections import namedtuple
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import casckpt
from casckpt.errors import (
    AmbiguousRefError,
    CasckptError,
    InvalidArgumentError,
    InvalidNameError,
    NotAStoreError,
    RefNotFoundError,
    RestoreTargetError,
    TensorNotFoundError,
    UnsupportedStateError,
    VersionExistsError,
)


def _files(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for sub in ("packs", "manifests", "tmp", "cache/staging")
        for p in (root / sub).rglob("*") if p.is_file()
    )


class Unchanged:
    """Asserts on exit that a store holds exactly what it held on entry."""

    def __init__(self, store: casckpt.Store) -> None:
        self.store = store
        assert store.path is not None
        self.root = store.path

    def __enter__(self) -> Unchanged:
        self.before = (self.store.ops.stats(), _files(self.root))
        return self

    def __exit__(self, *exc: object) -> None:
        after = (self.store.ops.stats(), _files(self.root))
        assert after == self.before, "a refused call changed the store"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path / "store", chunk_size=4096) as s:
        s.commit({"w": torch.arange(5000, dtype=torch.float32)}, run="base", step=0)
        yield s
        assert s.ops.check(read_data=True).ok


def _refused(store: casckpt.Store, exc: type[BaseException], state: object = None,
             **kwargs: Any) -> BaseException:
    """Commit, expect ``exc``, and check nothing was written; returns the error."""
    args: dict[str, Any] = {"run": "r", "step": 1, **kwargs}
    with Unchanged(store), pytest.raises(exc) as info:
        store.commit({"w": torch.ones(3)} if state is None else state, **args)
    assert isinstance(info.value, CasckptError)
    return info.value


# -- unsupported objects -------------------------------------------------------------------


class Custom:
    pass


@pytest.mark.parametrize(("state", "path", "type_name"), [
    ({"s": {1, 2}}, "s", "set"),
    ({"obj": Custom()}, "obj", "Custom"),
    ({"dev": torch.device("cpu")}, "dev", "torch.device"),
    ({"dtype": torch.float16}, "dtype", "torch.dtype"),
    ({"fn": len}, "fn", "builtin_function_or_method"),
    ({"np32": np.float32(1.0)}, "np32", "numpy.float32"),
    ({"model": {"layers": [{"w": torch.ones(2)}, {"w": torch.ones(2), "act": torch.nn.ReLU()}]}},
     "model.layers.1.act", "ReLU"),
    ([torch.ones(4), ({"deep": [[[{"x": object()}]]]},)], "1.0.deep.0.0.0.x", "object"),
])
def test_unsupported_object_named_by_path(store: casckpt.Store, state: object, path: str,
                                         type_name: str) -> None:
    err = _refused(store, UnsupportedStateError, state)
    assert isinstance(err, TypeError)
    assert repr(path) in str(err), f"path {path!r} not named: {err}"
    assert type_name in str(err) and "Convert" in str(err)


@pytest.mark.parametrize(("state", "words"), [
    ({"sparse": torch.eye(3).to_sparse()}, ["'sparse'", "dense"]),
    ({"meta": torch.empty(3, device="meta")}, ["'meta'", "meta device"]),
    ({"objs": np.array([1, "a"], dtype=object)}, ["'objs'", "dtype object"]),
    ({"keys": {(1, 2): torch.ones(1)}}, ["(1, 2)", "str or int"]),
])
def test_unsupported_tensor_kinds_and_keys(store: casckpt.Store, state: object,
                                           words: list[str]) -> None:
    err = _refused(store, UnsupportedStateError, state)
    for word in words:
        assert word in str(err), f"{word!r} missing from: {err}"


class _TensorSubclass(torch.Tensor):
    pass


def _tensor_kind(kind: str) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested, sparse compressed and quantized tensors warn
        if kind == "nested":
            return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        if kind == "nested-jagged":
            return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        if kind in ("csr", "csc"):
            return getattr(torch.eye(4), f"to_sparse_{kind}")()
        if kind in ("bsr", "bsc"):
            return getattr(torch.eye(4), f"to_sparse_{kind}")((2, 2))
        if kind == "mkldnn":
            return torch.ones(3).to_mkldnn()
        if kind == "quantized":
            return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)
        if kind == "subclass":
            return torch.ones(3).as_subclass(_TensorSubclass)
        assert kind == "uninitialized"
        return torch.nn.parameter.UninitializedParameter()


@pytest.mark.parametrize(("kind", "words"), [
    # a nested tensor used to escape as torch's "NestedTensorImpl doesn't support sizes"
    ("nested", ["nested", "unbind()"]),
    ("nested-jagged", ["nested", "unbind()"]),
    ("csr", ["torch.sparse_csr", "to_dense()"]),
    ("csc", ["torch.sparse_csc", "to_dense()"]),
    ("bsr", ["torch.sparse_bsr", "to_dense()"]),
    ("bsc", ["torch.sparse_bsc", "to_dense()"]),
    ("mkldnn", ["torch._mkldnn", "to_dense()"]),
    ("quantized", ["quantized", "int_repr()"]),
    ("subclass", ["_TensorSubclass", "plain torch.Tensor"]),
    ("uninitialized", ["UninitializedParameter", "plain torch.Tensor"]),
])
def test_tensor_kinds_that_are_not_plain_dense_are_refused_before_writing(
    store: casckpt.Store, kind: str, words: list[str],
) -> None:
    err = _refused(store, UnsupportedStateError, {"w": torch.ones(2), "model": {"t": _tensor_kind(kind)}},
                   block=False)
    assert "'model.t'" in str(err)
    for word in words:
        assert word in str(err), f"{word!r} missing from: {err}"


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_tensors_and_their_lazy_views_are_stored_as_they_read(store: casckpt.Store,
                                                                     dtype: torch.dtype) -> None:
    c = torch.randn(5, dtype=dtype)
    state = {"c": c, "conj": c.conj(), "imag_neg": c.conj().imag}
    out = store.restore(store.commit(state, run="complex", step=0))
    for key, value in state.items():
        expected = value.resolve_conj().resolve_neg()
        assert out[key].dtype == value.dtype and torch.equal(out[key], expected), key


def test_cycle_is_refused(store: casckpt.Store) -> None:
    state: dict[str, Any] = {"w": torch.ones(2), "inner": {}}
    state["inner"]["loop"] = state
    err = _refused(store, UnsupportedStateError, state)
    assert "cycle" in str(err) and "inner.loop" in str(err)


class Mode(enum.IntEnum):
    TRAIN = 1


Pair = namedtuple("Pair", "first second")


@pytest.mark.parametrize("value", [np.float64(0.5), Mode.TRAIN, Pair(1, 2)],
                         ids=["np.float64", "IntEnum", "namedtuple"])
def test_subclass_of_plain_value_is_kept_or_refused(store: casckpt.Store, value: object) -> None:
    """DESIGN: what the tree cannot represent is refused, never silently turned into its base type."""
    try:
        with Unchanged(store):
            store.commit({"m": {"v": value}}, run="sub", step=0)
    except UnsupportedStateError as err:
        assert "'m.v'" in str(err) and type(value).__name__ in str(err)
        return
    restored = store.restore("sub@0")["m"]["v"]
    assert type(restored) is type(value), f"{type(value).__name__} came back as {type(restored).__name__}"


@pytest.mark.parametrize("state", [
    {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}},
    {0: torch.ones(2), "0": torch.zeros(3)},
], ids=["dotted-key", "int-and-str-key"])
def test_colliding_tensor_paths_refused_up_front(store: casckpt.Store, state: object) -> None:
    # Used to pass validation, write chunks and the manifest, then fail in the catalog with a
    # raw UNIQUE-constraint error.
    err = _refused(store, (InvalidNameError, UnsupportedStateError), state)
    assert "'a.b'" in str(err) or "'0'" in str(err)


# -- names ---------------------------------------------------------------------------------

BAD_NAMES = ["../x", "a/b", "", ".", "..", "x" * 200, "-x", "a..b", "a\x00b", "tab\tname",
             "a\\b", None, 5]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_run_name(store: casckpt.Store, name: Any) -> None:
    err = _refused(store, InvalidNameError, run=name)
    assert isinstance(err, ValueError)
    assert "invalid run name" in str(err) and "letters, digits" in str(err)
    if isinstance(name, str):
        with pytest.raises(InvalidNameError):
            store.log(name)


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_tag_name(store: casckpt.Store, name: Any) -> None:
    err = _refused(store, InvalidNameError, tags=[name])
    assert "invalid tag name" in str(err)
    with Unchanged(store), pytest.raises(InvalidNameError):
        store.tag("base@0", name)
    assert store.resolve("base@0").tags == ()


def test_long_but_legal_names(store: casckpt.Store) -> None:
    name = "r" * 128
    version = store.commit({"w": torch.ones(1)}, run=name, step=1, tags=[name])
    assert store.resolve(f"tag:{name}").id == version.id == store.resolve(f"{name}@1").id
    _refused(store, InvalidNameError, run="r" * 129)


@pytest.mark.parametrize("key", ["../../etc/passwd", "a/b", "..", ".", "", "a\\b", "x\n", "\x7f"],
                         ids=repr)
def test_state_keys_that_could_escape(store: casckpt.Store, key: str) -> None:
    err = _refused(store, InvalidNameError, {"model": {"ok": torch.ones(1), key: torch.ones(1)}})
    assert repr(key) in str(err) and "'model'" in str(err) and "Rename the key" in str(err)


# -- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", None, float("nan")], ids=repr)
def test_bad_step(store: casckpt.Store, step: Any) -> None:
    err = _refused(store, InvalidArgumentError, step=step)
    assert isinstance(err, ValueError)
    assert "step must be a non-negative int" in str(err) and repr(step) in str(err)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "fast", True, None],
                         ids=repr)
def test_bad_metric(store: casckpt.Store, value: Any) -> None:
    err = _refused(store, InvalidArgumentError, metrics={"loss": value})
    assert "'loss'" in str(err) and ("finite" in str(err) or "number" in str(err))


@pytest.mark.parametrize("metadata", [{"x": object()}, {"x": float("nan")}, {1: 2}, [1, 2]],
                         ids=["object", "nan", "int-key", "list"])
def test_bad_metadata(store: casckpt.Store, metadata: Any) -> None:
    err = _refused(store, InvalidArgumentError, metadata=metadata)
    assert "metadata must be" in str(err)


def test_step_too_large_for_the_catalog(store: casckpt.Store) -> None:
    # The catalog stores 64-bit steps; a bigger one used to escape as a bare OverflowError
    # from SQLite after the chunks and manifest were written.
    err = _refused(store, InvalidArgumentError, step=2**63)
    assert "2**63" in str(err) or str(2**63) in str(err)
    version = store.commit({"w": torch.ones(1)}, run="r", step=2**63 - 1)
    assert store.resolve(f"r@{2**63 - 1}").id == version.id


def test_metric_too_large_for_a_float(store: casckpt.Store) -> None:
    # float(10**400) raises OverflowError, which used to escape check_metrics untyped.
    err = _refused(store, InvalidArgumentError, metrics={"loss": 10**400})
    assert "'loss'" in str(err)


def test_same_step_twice(store: casckpt.Store) -> None:
    first = store.commit({"w": torch.full((3000,), 1.0), "n": 1}, run="r", step=5,
                         metrics={"loss": 1.0}, tags=["keep"])
    with pytest.raises(VersionExistsError) as info:
        store.commit({"w": torch.full((3000,), 2.0), "n": 2}, run="r", step=5,
                     metrics={"loss": 2.0}, tags=["keep", "other"])
    assert isinstance(info.value, ValueError)
    assert "'r'" in str(info.value) and "step 5" in str(info.value) and first.id[:12] in str(info.value)
    assert [v.id for v in store.log("r")] == [first.id]
    assert store.resolve("tag:keep").id == first.id
    with pytest.raises(RefNotFoundError):
        store.resolve("tag:other")
    restored = store.restore("r@5")
    assert torch.equal(restored["w"], torch.full((3000,), 1.0)) and restored["n"] == 1
    assert store.resolve("r@5").metrics == {"loss": 1.0}


# -- refs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refs_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[casckpt.Store]:
    with casckpt.open(tmp_path_factory.mktemp("refs") / "store") as s:
        for step in (0, 100, 200, 300):
            s.commit({"w": torch.full((4,), float(step))}, run="llama-ft", step=step)
        s.commit({"w": torch.zeros(4)}, run="resnet", step=1)
        s.tag("llama-ft@300", "best")
        s.tag("llama-ft@100", "baseline")
        yield s


def _not_found(store: casckpt.Store, ref: str) -> RefNotFoundError:
    with pytest.raises(RefNotFoundError) as info:
        store.resolve(ref)
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, CasckptError)
    assert err.ref == ref and repr(ref) in str(err)
    with pytest.raises(RefNotFoundError):
        store.restore(ref)
    return err


def test_unknown_run_suggests_near_names(refs_store: casckpt.Store) -> None:
    err = _not_found(refs_store, "llama-fx@latest")
    assert "no run named 'llama-fx'" in str(err)
    assert err.near == ("llama-ft@latest",) and "Did you mean: llama-ft@latest?" in str(err)
    err = _not_found(refs_store, "lama-ft@100")
    assert "llama-ft@latest" in err.near


def test_unknown_step_suggests_nearest_steps(refs_store: casckpt.Store) -> None:
    err = _not_found(refs_store, "llama-ft@190")
    assert "no version at step 190" in str(err)
    assert err.near[:2] == ("llama-ft@200", "llama-ft@100")
    assert all(n in str(err) for n in err.near)


def test_too_far_back(refs_store: casckpt.Store) -> None:
    err = _not_found(refs_store, "llama-ft@~4")
    assert "fewer than 5 versions" in str(err)
    assert refs_store.resolve("llama-ft@~3").step == 0


@pytest.mark.parametrize("ref", ["llama-ft@abc", "llama-ft@~x", "llama-ft@"])
def test_bad_selector(refs_store: casckpt.Store, ref: str) -> None:
    err = _not_found(refs_store, ref)
    assert "llama-ft@latest" in err.near or "llama-ft@~1" in err.near


def test_unknown_tag_suggests_near_tags(refs_store: casckpt.Store) -> None:
    err = _not_found(refs_store, "tag:bestt")
    assert "no tag 'bestt'" in str(err) and err.near == ("tag:best",)


def test_bare_run_name_is_not_a_ref(refs_store: casckpt.Store) -> None:
    err = _not_found(refs_store, "resnet")
    assert "bare run name" in str(err) and err.near == ("resnet@latest",)


def test_unknown_word_lists_ref_syntax(refs_store: casckpt.Store) -> None:
    err = _not_found(refs_store, "nothing-like-this")
    assert "run@step" in str(err) and "tag:NAME" in str(err)


def test_id_prefix(refs_store: casckpt.Store) -> None:
    latest = refs_store.resolve("llama-ft@latest")
    assert refs_store.resolve(latest.id[:12]).id == latest.id
    assert refs_store.resolve(latest.id).id == latest.id
    ids = {v.id for v in refs_store.log()}
    unused = next(p for p in (f"{i:04x}" for i in range(1 << 16)) if not any(i.startswith(p) for i in ids))
    _not_found(refs_store, unused)


@pytest.mark.parametrize("ref", [5, None, b"llama-ft@latest", ""], ids=repr)
def test_ref_of_wrong_type(refs_store: casckpt.Store, ref: Any) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        refs_store.resolve(ref)
    assert "a ref must be a non-empty str" in str(info.value)


@pytest.mark.parametrize("ref", ["llama-ft@" + "9" * 30, "llama-ft@-" + "9" * 30,
                                 "llama-ft@~" + "9" * 30])
def test_ref_with_huge_number(refs_store: casckpt.Store, ref: str) -> None:
    # Numbers beyond 64 bits used to reach SQLite and escape as a bare OverflowError.
    err = _not_found(refs_store, ref)
    assert err.near and all(n.startswith("llama-ft@") for n in err.near)


def test_ambiguous_id_prefix(tmp_path: Path) -> None:
    # Two real ids share 4 hex digits only after ~300 commits (birthday bound on 16 bits), too
    # slow here; so a second version's id is rewritten in the catalog to share a 6-digit prefix.
    root = tmp_path / "store"
    with casckpt.open(root) as s:
        a = s.commit({"x": 1}, run="r", step=1)
        b = s.commit({"x": 2}, run="r", step=2)
    forged = a.id[:6] + b.id[6:]
    with closing(sqlite3.connect(root / "catalog.db")) as conn, conn:
        conn.execute("UPDATE versions SET id = ? WHERE id = ?", (forged, b.id))
    with casckpt.open(root, create=False) as s:
        for prefix in (a.id[:4], a.id[:6]):
            with pytest.raises(AmbiguousRefError) as info:
                s.resolve(prefix)
            assert isinstance(info.value, KeyError)
            message = str(info.value)
            assert "matches several versions" in message and "more digits" in message
            assert a.id[:12] in message and forged[:12] in message
        assert s.resolve(a.id[:7] if a.id[6] != forged[6] else a.id[:8]).id == a.id
        assert s.restore(a.id[:10]) == {"x": 1}


# -- stores --------------------------------------------------------------------------------


def test_non_empty_directory_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(NotAStoreError) as info:
        casckpt.open(tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    assert "casckpt.toml" in str(info.value) and "empty directory" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "the directory was touched"


def test_file_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"x")
    with pytest.raises(NotAStoreError) as info:
        casckpt.open(path)
    assert "is a file" in str(info.value)
    assert path.read_bytes() == b"x"


def test_missing_store_without_create(tmp_path: Path) -> None:
    for path in (tmp_path / "missing", tmp_path / "empty"):
        if path.name == "empty":
            path.mkdir()
        with pytest.raises(NotAStoreError) as info:
            casckpt.open(path, create=False)
        assert "casckpt init" in str(info.value)
    assert not (tmp_path / "missing").exists() and not any((tmp_path / "empty").iterdir())


def test_store_of_a_newer_format(tmp_path: Path) -> None:
    casckpt.open(tmp_path / "s").close()
    (tmp_path / "s" / "casckpt.toml").write_text("[store]\nformat = 2\n")
    with pytest.raises(NotAStoreError) as info:
        casckpt.open(tmp_path / "s")
    assert "format 2" in str(info.value) and "Upgrade casckpt" in str(info.value)


def test_open_without_a_location() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        casckpt.open()
    assert "blobs=" in str(info.value) and "catalog=" in str(info.value)


@pytest.mark.parametrize("knob", ["chunk_size", "pack_size", "workers"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "big", True], ids=repr)
def test_bad_tuning_knob(tmp_path: Path, knob: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        casckpt.open(tmp_path / "s", **{knob: value})
    assert knob in str(info.value) and "positive int" in str(info.value)


# -- restore targets -----------------------------------------------------------------------


def test_restore_into_wrong_shape(store: casckpt.Store) -> None:
    store.commit({"a": torch.ones(10), "b": torch.ones(3, 4)}, run="r", step=0)
    with pytest.raises(RestoreTargetError) as info:
        store.restore("r@0", into={"a": torch.zeros(10), "b": torch.zeros(4, 3)})
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "'b'" in message and "3, 4" in message and "4, 3" in message


def test_restore_into_wrong_dtype(store: casckpt.Store) -> None:
    store.commit({"a": torch.ones(10)}, run="r", step=0)
    with pytest.raises(RestoreTargetError) as info:
        store.restore("r@0", into={"a": torch.zeros(10, dtype=torch.float64)})
    assert "float32" in str(info.value) and "float64" in str(info.value)


def test_restore_into_missing_key(store: casckpt.Store) -> None:
    store.commit({"a": torch.ones(10)}, run="r", step=0)
    with pytest.raises(RestoreTargetError) as info:
        store.restore("r@0", into={"a": torch.zeros(10), "extra": torch.zeros(1)})
    assert "'extra'" in str(info.value) and "remove" in str(info.value)


def test_restore_into_wrong_structure(store: casckpt.Store) -> None:
    store.commit({"a": [torch.ones(2), torch.ones(2)]}, run="r", step=0)
    with pytest.raises(RestoreTargetError) as info:
        store.restore("r@0", into={"a": [torch.zeros(2)]})
    assert "'a'" in str(info.value) and "sequence of 1" in str(info.value)
    with pytest.raises(RestoreTargetError):
        store.restore("r@0", into={"a": {"x": torch.zeros(2)}})


def test_restore_into_module_refusing_state(store: casckpt.Store) -> None:
    store.commit({"weight": torch.ones(3, 4), "bias": torch.ones(2)}, run="r", step=0)
    with pytest.raises(RestoreTargetError) as info:
        store.restore("r@0", into=torch.nn.Linear(4, 3))
    assert "bias" in str(info.value)


@pytest.mark.parametrize("bad", ["shape", "dtype", "missing-key", "module"])
def test_refused_restore_leaves_target_untouched(store: casckpt.Store, bad: str) -> None:
    # Matching tensors used to be filled in place before the mismatch was found.
    store.commit({"a": torch.ones(3, 4), "b": torch.ones(3)}, run="r", step=0)
    into: Any
    if bad == "module":
        into = torch.nn.Linear(4, 2)  # weight (2, 4) and bias (2,) both mismatch ...
        store.commit({"weight": torch.ones(2, 4), "bias": torch.ones(3)}, run="r", step=1)
        before = into.weight.detach().clone()  # ... but only the bias: the weight matches
        with pytest.raises(RestoreTargetError):
            store.restore("r@1", into=into)
        assert torch.equal(into.weight.detach(), before), "a refused restore overwrote the module"
        return
    into = {"a": torch.zeros(3, 4), "b": torch.zeros(3)}
    if bad == "shape":
        into["b"] = torch.zeros(4)
    elif bad == "dtype":
        into["b"] = torch.zeros(3, dtype=torch.int32)
    else:
        into["extra"] = torch.zeros(1)
    with pytest.raises(RestoreTargetError):
        store.restore("r@0", into=into)
    assert torch.equal(into["a"], torch.zeros(3, 4)), "`into` was modified by a refused restore"


def test_load_tensor_unknown_path(store: casckpt.Store) -> None:
    store.commit({"model": {"layer1": {"weight": torch.ones(2)}}}, run="r", step=0)
    with pytest.raises(TensorNotFoundError) as info:
        store.load_tensor("r@0", "model.layer1.weigth")
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert "r@0" in message and "'model.layer1.weigth'" in message
    assert "Did you mean: model.layer1.weight?" in message
    with pytest.raises(TensorNotFoundError):
        store.load_tensor("r@0", "model")  # a subtree, not a tensor

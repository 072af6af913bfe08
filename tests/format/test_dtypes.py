"""The torch dtype sizes casckpt knows without importing torch agree with torch's own."""

from __future__ import annotations

import warnings

import pytest
import torch

from casckpt.errors import CorruptManifestError
from casckpt.format.dtypes import TORCH_SIZES, element_size, torch_dtypes


def test_every_torch_dtype_size_in_the_table_is_torchs() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        actual = {name: torch.empty((), dtype=d).element_size() for name, d in torch_dtypes().items()}
    assert {n: TORCH_SIZES[n] for n in actual if n in TORCH_SIZES} == {
        n: s for n, s in actual.items() if n in TORCH_SIZES}
    # a dtype a newer torch adds is sized by torch (the table is a shortcut, not a limit)
    for name, size in actual.items():
        assert element_size("torch", name) == size


def test_an_unknown_torch_dtype_name_is_a_corrupt_manifest() -> None:
    with pytest.raises(CorruptManifestError, match="lacks"):
        element_size("torch", "float7_madeup")

"""``copynodes``: a plan's nodes read again from the source, a version's batch in one read,
verified, and kept up to a bound."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from casckpt.engine.copying.copynodes import NodeBodies, NodeReader
from casckpt.errors import CorruptManifestError, MissingDataError
from casckpt.format.chunks import chunk_id
from casckpt.format.merkle import NodeSource


class Counted(NodeSource):
    """Nodes by id, counting the calls that read them (stands in for a store's catalog)."""

    def __init__(self, nodes: dict[bytes, bytes]) -> None:
        self.nodes, self.calls = nodes, []

    def get_many(self, ids: Sequence[bytes]) -> Mapping[bytes, bytes]:
        self.calls.append(list(ids))
        return {i: self.nodes[i] for i in ids if i in self.nodes}


def _nodes(n: int, size: int, start: int = 0) -> dict[bytes, bytes]:
    raws = [b'{"n":0,"b":0,"v":{"x":%d}}' % i + b" " * size for i in range(start, start + n)]
    return {chunk_id(raw): raw for raw in raws}


def test_a_version_s_nodes_are_read_in_one_call_and_kept_up_to_the_bound() -> None:
    first, second = _nodes(4, 100), _nodes(4, 100, start=4)
    source = Counted({**first, **second})
    reader = NodeReader(source, limit=600)
    one = NodeBodies(reader, {i: len(raw) for i, raw in first.items()})
    two = NodeBodies(reader, {i: len(raw) for i, raw in second.items()})
    assert dict(one.items()) == first and len(source.calls) == 1  # the whole batch at once
    assert dict(one) == first and len(source.calls) == 1  # kept
    assert dict(two.items()) == second and len(source.calls) == 2
    assert dict(one.items()) == first and len(source.calls) == 3  # over the bound: read again
    assert list(one) == list(first) and len(one) == 4 and next(iter(second)) not in one
    with pytest.raises(KeyError):
        one[next(iter(second))]


def test_a_node_gone_or_forged_at_the_source_is_refused() -> None:
    nodes = _nodes(2, 10)
    gone, forged = list(nodes)
    source = Counted({gone: nodes[gone], forged: nodes[gone]})
    reader = NodeReader(source)
    with pytest.raises(CorruptManifestError, match="does not match its id"):
        NodeBodies(reader, {forged: 1})[forged]
    del source.nodes[gone]
    with pytest.raises(MissingDataError, match="copy again"):
        NodeBodies(reader, {gone: 1})[gone]

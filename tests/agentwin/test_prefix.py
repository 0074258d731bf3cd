"""agentwin.prefix: placement keys chain content in order, and the prefix index reuses the longest
common token prefix computed after a prefix, across chunk boundaries and read tails."""

from __future__ import annotations

import pytest
import torch

from agentwin.prefix import PrefixIndex, common_prefix, placement_key, root_key
from agentwin.store import ChunkKey


def _key(n: int) -> ChunkKey:
    return ChunkKey.of("fp", "text", [n])


def _kv(rows: int, tag: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of [rows, 1, 2] keys/values whose row r holds tag + r (to see which rows came back)."""
    base = (torch.arange(rows, dtype=torch.float32) + tag)[:, None, None].expand(rows, 1, 2).clone()
    return [(base, -base), (2 * base, -2 * base)]


def test_placement_keys_chain_the_content_in_order_per_model_and_tenant():
    root = root_key("model-a")
    ab = placement_key(placement_key(root, _key(1)), _key(2))
    ba = placement_key(placement_key(root, _key(2)), _key(1))
    assert ab != ba  # order matters: the same chunks in another order are other KV
    assert ab == placement_key(placement_key(root_key("model-a"), _key(1)), _key(2))  # deterministic
    assert root_key("model-a") != root_key("model-b") and root_key("model-a") != root_key("model-a", "tenant")
    assert placement_key(root, _key(1)) != _key(1)  # a placement is not the content key itself


def test_common_prefix():
    a = torch.tensor([1, 2, 3, 4])
    assert common_prefix(a, torch.tensor([1, 2, 9])) == 2
    assert common_prefix(a, a) == 4 and common_prefix(a, torch.tensor([5])) == 0
    assert common_prefix(a, torch.zeros(0, dtype=torch.long)) == 0


def test_match_goes_through_whole_chunks_and_stops_inside_a_run():
    root = root_key("m")
    index = PrefixIndex()
    store = {}
    a_ids, b_ids = torch.tensor([10, 11, 12]), torch.tensor([20, 21])
    a_key = placement_key(root, _key(1))
    b_key = placement_key(a_key, _key(2))
    store[a_key], store[b_key] = _kv(3, 100.0), _kv(2, 200.0)
    index.add(root, a_ids, child=a_key)
    index.add(a_key, b_ids, child=b_key)
    index.add(b_key, torch.tensor([30, 31, 32]), kv=_kv(3, 300.0))  # a read's tail after [a, b]
    # [a, b, 30, 31, 99]: a and b whole, then two rows of the tail.
    pieces = index.match(root, torch.tensor([10, 11, 12, 20, 21, 30, 31, 99]), store.get)
    assert [p.num_tokens for p in pieces] == [3, 2, 2]
    assert float(pieces[2].kv[0][0][1, 0, 0]) == 301.0  # the tail's own rows
    # A run that differs inside the first chunk: only its common rows, nothing after.
    pieces = index.match(root, torch.tensor([10, 11, 99, 20]), store.get)
    assert [p.num_tokens for p in pieces] == [2]
    assert index.match(root, torch.tensor([7, 8]), store.get) == []


def test_a_chunk_the_store_dropped_is_forgotten_not_served():
    root = root_key("m")
    index = PrefixIndex()
    key = placement_key(root, _key(1))
    index.add(root, torch.tensor([1, 2, 3]), child=key)
    assert index.match(root, torch.tensor([1, 2, 3]), lambda k: None) == []
    assert len(index) == 0


def test_the_index_is_bounded_oldest_first():
    root = root_key("m")
    index = PrefixIndex(max_runs=3, max_tail_tokens=5)
    for n in range(5):
        index.add(root, torch.tensor([n, n]), child=placement_key(root, _key(n)))
    assert len(index) == 3  # the two oldest runs left
    assert index.match(root, torch.tensor([0, 0]), lambda k: _kv(2, 0.0)) == []
    assert [p.num_tokens for p in index.match(root, torch.tensor([4, 4]), lambda k: _kv(2, 0.0))] == [2]
    index.add(root, torch.tensor([50, 51, 52]), kv=_kv(3, 0.0))
    index.add(root, torch.tensor([60, 61, 62]), kv=_kv(3, 0.0))
    assert index.tail_tokens <= 5  # the older tail went to make room
    assert index.match(root, torch.tensor([50, 51]), lambda k: None) == []
    with pytest.raises(ValueError):
        PrefixIndex(max_runs=0)
    with pytest.raises(ValueError, match="either"):
        index.add(root, torch.tensor([1]))

"""The KV pool's block export: rows the store can write as they are, in memory reused across
exports once nothing refers to an earlier one."""

from __future__ import annotations

import torch

from cleave.runtime.engine.kv_layout import KVLayout
from cleave.runtime.engine.kv_pool import KVPool

SHAPE = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8)
HEADER_ROOM = 88


def pool_with_data() -> KVPool:
    pool = KVPool(SHAPE, num_blocks=8, block_size=4, dtype=torch.bfloat16,
                  device=torch.device("cpu"))
    pool.data.copy_(torch.randn(pool.data.shape).to(torch.bfloat16))
    return pool


def address(t: torch.Tensor) -> int:
    return t.data_ptr()


def test_export_rows_hold_the_blocks_behind_the_header_room() -> None:
    pool = pool_with_data()
    buffer, views = pool.export_blocks([5, 2], HEADER_ROOM)
    assert buffer.shape == (2, HEADER_ROOM + pool.data[:, :, :, 0].numel() * 2)
    for view, b in zip(views, [5, 2], strict=True):
        assert torch.equal(view, pool.data[:, :, :, b])
    row_payload = buffer[1, HEADER_ROOM:].view(torch.bfloat16).view(views[1].shape)
    assert torch.equal(row_payload, pool.data[:, :, :, 2])


def test_an_export_reuses_the_memory_of_one_no_longer_referred_to() -> None:
    pool = pool_with_data()
    buffer, views = pool.export_blocks([1, 2, 3], HEADER_ROOM)
    where = address(buffer)
    del buffer, views
    again, _ = pool.export_blocks([4, 5], HEADER_ROOM)
    assert address(again) == where


def test_an_export_still_in_use_is_never_overwritten() -> None:
    pool = pool_with_data()
    _, views = pool.export_blocks([1, 2], HEADER_ROOM)  # the buffer is gone, its views not
    kept = [v.clone() for v in views]
    other, _ = pool.export_blocks([6, 7], HEADER_ROOM)
    assert not (address(other) <= views[0].data_ptr() < address(other) + other.numel())
    assert all(torch.equal(v, k) for v, k in zip(views, kept, strict=True))


def test_imported_blocks_land_in_the_pool() -> None:
    source = pool_with_data()
    _, views = source.export_blocks([3, 0], HEADER_ROOM)
    target = KVPool(SHAPE, num_blocks=4, block_size=4, dtype=torch.bfloat16,
                    device=torch.device("cpu"))
    target.import_blocks([1, 2], views)
    assert torch.equal(target.data[:, :, :, 1], source.data[:, :, :, 3])
    assert torch.equal(target.data[:, :, :, 2], source.data[:, :, :, 0])

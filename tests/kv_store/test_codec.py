"""The stored-block codec: exact round trips, zero copies, and every corruption is a miss."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch
import xxhash

from cleave.kv_store.block_hash import KVFingerprint, chain_hashes
from cleave.kv_store.codec import (
    FORMAT_VERSION,
    MAGIC,
    BlockHeader,
    CorruptBlock,
    HeaderWriter,
    decode,
    encode,
    encode_into,
    header_size,
)
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.store import EncodedBlock, MemoryBlockStore

FP = KVFingerprint("tiny-llama", "sha256:abc", "bfloat16", num_layers=2, num_kv_heads=2,
                   head_dim=16, block_size=16, salt="t")
HASHES = chain_hashes(FP.root_hash(), list(range(64)), 16)
SHAPE = (2, 2, 2, 16, 16)  # layers, k/v, kv heads, tokens, head dim


def bf16_tensor(shape: tuple[int, ...] = SHAPE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    t.view(-1)[:4] = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-40])  # odd bit patterns
    return t


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def header_for(t: torch.Tensor, block_hash: bytes = HASHES[0]) -> BlockHeader:
    return BlockHeader("bfloat16", tuple(t.shape), 16, block_hash)


def sample_value() -> bytes:
    t = bf16_tensor((2, 2, 1, 16, 4))
    return encode(header_for(t), tensor_bytes(t))


def test_round_trip_keeps_header_and_payload() -> None:
    payload = bytes(range(256)) * 8
    header = BlockHeader("float16", (4, 256), 16, HASHES[1])
    value = encode(header, payload)
    assert value[:4] == MAGIC
    assert len(value) == header_size(2) + len(payload)
    got, view = decode(value, expected_hash=HASHES[1])
    assert got == header
    assert bytes(view) == payload
    assert decode(value)[0] == header  # expected_hash is optional


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_supported_dtype_round_trips(dtype: str) -> None:
    t = torch.randn(3, 5).to(getattr(torch, dtype))
    header = BlockHeader(dtype, (3, 5), 7, HASHES[2])
    got, view = decode(encode(header, tensor_bytes(t)), HASHES[2])
    assert got == header
    back = torch.frombuffer(bytearray(view), dtype=getattr(torch, dtype)).view(3, 5)
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_bf16_tensor_round_trips_bit_exactly() -> None:
    t = bf16_tensor()
    value = encode(header_for(t), tensor_bytes(t))
    header, view = decode(value, expected_hash=HASHES[0])
    assert header.shape == SHAPE and header.dtype == "bfloat16" and header.num_tokens == 16
    back = torch.frombuffer(bytearray(view), dtype=torch.bfloat16).view(header.shape)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))  # bits, not values
    assert torch.isinf(back.view(-1)[0]) and back.view(-1)[2].view(torch.int16) == -32768


def test_non_contiguous_tensor_round_trips_through_contiguous_bytes() -> None:
    t = bf16_tensor((16, 2, 2, 2, 16)).permute(1, 2, 3, 0, 4)  # a transposed view
    assert not t.is_contiguous()
    _, view = decode(encode(header_for(t), tensor_bytes(t)))
    back = torch.frombuffer(bytearray(view), dtype=torch.bfloat16).view(t.shape)
    assert torch.equal(back.view(torch.int16), t.contiguous().view(torch.int16))


def test_encode_into_writes_the_header_in_front_of_a_payload_in_place() -> None:
    t = bf16_tensor()
    header = header_for(t)
    start = header_size(len(t.shape))
    buf = bytearray(start + header.payload_len)
    # The producer lays the tensor bytes straight into the value buffer...
    target = torch.frombuffer(buf, dtype=torch.uint8, offset=start,
                              count=header.payload_len)
    target.copy_(t.view(-1).view(torch.uint8))
    payload_before = bytes(buf[start:])
    encode_into(memoryview(buf), header)
    # ...and encode_into touches only the header region.
    assert bytes(buf[start:]) == payload_before
    assert bytes(buf) == encode(header, tensor_bytes(t))

    got, view = decode(buf, expected_hash=HASHES[0])
    assert got == header
    assert view.obj is buf  # a view of the value, not a copy
    buf[start] ^= 0xFF  # mutate the source: the decoded view sees it
    assert view[0] == buf[start]
    buf[-1] ^= 0x01
    assert view[-1] == buf[-1]


def test_decode_payload_view_shares_memory_with_a_memoryview_value() -> None:
    buf = bytearray(sample_value())
    _, view = decode(memoryview(buf))
    before = view[5]
    buf[len(buf) - view.nbytes + 5] = (before + 1) % 256
    assert view[5] == (before + 1) % 256


def test_encode_into_rejects_a_buffer_of_the_wrong_size() -> None:
    t = bf16_tensor((2, 8))
    header = header_for(t)
    size = header_size(2) + header.payload_len
    for n in (size - 1, size + 1, header.payload_len):
        with pytest.raises(ValueError):
            encode_into(memoryview(bytearray(n)), header)


def _payload_in_place(t: torch.Tensor) -> tuple[BlockHeader, HeaderWriter, bytearray]:
    """A value buffer with the tensor's bytes laid in and room left for the header."""
    header = header_for(t)
    writer = HeaderWriter(header.dtype, header.shape, header.num_tokens)
    buf = bytearray(writer.value_size)
    buf[writer.header_size:] = tensor_bytes(t)
    return header, writer, buf


def test_a_deferred_header_is_checked_now_and_written_when_called() -> None:
    t = bf16_tensor((2, 8))
    header, writer, buf = _payload_in_place(t)
    seal = writer.deferred(memoryview(buf), header.block_hash)
    assert bytes(buf[:writer.header_size]) == bytes(writer.header_size)  # not yet
    seal()
    assert bytes(buf) == encode(header, tensor_bytes(t))  # the same value encode makes
    # A wrong size or hash is an error when the block is prepared, not when it goes out.
    with pytest.raises(ValueError, match="needs"):
        writer.deferred(memoryview(bytearray(writer.value_size + 1)), header.block_hash)
    with pytest.raises(ValueError, match="32 bytes"):
        writer.deferred(memoryview(buf), b"short")
    with pytest.raises(ValueError, match="unsupported dtype"):
        HeaderWriter("int8", (2, 8), 16)


def test_a_store_seals_a_block_before_keeping_it() -> None:
    header, writer, buf = _payload_in_place(bf16_tensor((2, 8)))
    block = EncodedBlock(header.block_hash, memoryview(buf),
                         seal=writer.deferred(memoryview(buf), header.block_hash))
    store = MemoryBlockStore(KeySpace("seal", HASHES[0]))
    assert asyncio.run(store.put_many([block])) == 1
    (got,) = asyncio.run(store.get_many([header.block_hash]))
    assert got is not None and got.header == header


def _sample_positions(n: int) -> list[int]:
    hdr = header_size(5)
    return sorted(set(range(hdr + 8)) | set(range(hdr, n, max(1, (n - hdr) // 97))) | {n - 1})


def test_any_single_flipped_byte_is_corrupt() -> None:
    value = sample_value()
    positions = _sample_positions(len(value))
    assert len(positions) > 150
    for pos in positions:
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(value)
            bad[pos] ^= flip
            with pytest.raises(CorruptBlock):
                decode(bytes(bad))
            with pytest.raises(CorruptBlock):
                decode(bytes(bad), expected_hash=HASHES[0])


@pytest.mark.parametrize("keep", [0, 1, 3, 4, 20, 51, 52, 55, 56, 60, -1, -2])
def test_truncated_value_is_corrupt(keep: int) -> None:
    value = sample_value()
    with pytest.raises(CorruptBlock):
        decode(value[:keep])


@pytest.mark.parametrize("extra", [b"\x00", b"\x00" * 7, b"junk", sample_value()])
def test_extra_bytes_are_corrupt(extra: bytes) -> None:
    with pytest.raises(CorruptBlock):
        decode(sample_value() + extra)


def _with_valid_crc(value: bytearray) -> bytes:
    """Recompute the checksum so only the field under test is wrong."""
    ndim = value[7]
    fixed = 4 + 2 + 1 + 1 + 4 + 32 + 8
    shape_at = fixed + 4
    payload_at = shape_at + 4 * ndim
    h = xxhash.xxh3_64()
    for part in (value[:fixed], value[shape_at:payload_at], value[payload_at:]):
        h.update(bytes(part))
    value[fixed:shape_at] = struct.pack("<Q", h.intdigest())
    return bytes(value)


def test_bad_magic_is_corrupt_even_with_a_valid_checksum() -> None:
    bad = bytearray(sample_value())
    bad[:4] = b"XLKV"
    with pytest.raises(CorruptBlock, match="magic"):
        decode(_with_valid_crc(bad))


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 0xFFFF])
def test_another_format_version_is_corrupt_even_with_a_valid_checksum(version: int) -> None:
    bad = bytearray(sample_value())
    bad[4:6] = struct.pack("<H", version)
    with pytest.raises(CorruptBlock, match="version"):
        decode(_with_valid_crc(bad))


def test_unknown_dtype_code_is_corrupt_even_with_a_valid_checksum() -> None:
    bad = bytearray(sample_value())
    bad[6] = 99
    with pytest.raises(CorruptBlock):
        decode(_with_valid_crc(bad))


def test_value_stored_under_the_wrong_hash_is_corrupt() -> None:
    value = sample_value()  # written for HASHES[0]
    assert decode(value, expected_hash=HASHES[0])
    for other in [*HASHES[1:], bytes(32)]:
        with pytest.raises(CorruptBlock, match="another block"):
            decode(value, expected_hash=other)


@pytest.mark.parametrize("value", [b"", b"CLKV", b"\x00" * 100, b"not a block at all" * 9])
def test_garbage_is_corrupt(value: bytes) -> None:
    with pytest.raises(CorruptBlock):
        decode(value)


def test_corrupt_block_is_a_value_error_so_callers_can_treat_it_as_a_miss() -> None:
    assert issubclass(CorruptBlock, ValueError)


def test_encode_rejects_a_payload_of_the_wrong_size() -> None:
    header = BlockHeader("bfloat16", (2, 8), 16, HASHES[0])
    for n in (0, 31, 33, 64):
        with pytest.raises(ValueError, match="payload"):
            encode(header, bytes(n))


@pytest.mark.parametrize("dtype", ["int8", "float64", "bf16", ""])
def test_encode_rejects_an_unknown_dtype(dtype: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode(BlockHeader(dtype, (4,), 16, HASHES[0]), bytes(8))


@pytest.mark.parametrize("shape", [(), (1,) * 9])
def test_encode_rejects_a_bad_number_of_dims(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="shape"):
        encode(BlockHeader("bfloat16", shape, 16, HASHES[0]), bytes(2))


@pytest.mark.parametrize("shape", [(-2, -2), (-1, -4), (4, 0, -1)])
def test_encode_rejects_negative_dims(shape: tuple[int, ...]) -> None:
    # Two negative dims make a positive payload length that a matching payload satisfies;
    # the shape itself must still be refused with the documented ValueError.
    header = BlockHeader("bfloat16", shape, 16, HASHES[0])
    with pytest.raises(ValueError):
        encode(header, bytes(max(header.payload_len, 0)))


@pytest.mark.parametrize("block_hash", [b"", b"\x00" * 31, b"\x00" * 33])
def test_encode_rejects_a_hash_that_is_not_32_bytes(block_hash: bytes) -> None:
    with pytest.raises(ValueError, match="32"):
        encode(BlockHeader("bfloat16", (4,), 16, block_hash), bytes(8))


@pytest.mark.parametrize("num_tokens", [-1, 2**32])
def test_encode_rejects_a_token_count_that_does_not_fit_u32(num_tokens: int) -> None:
    with pytest.raises(ValueError):
        encode(BlockHeader("bfloat16", (4,), num_tokens, HASHES[0]), bytes(8))

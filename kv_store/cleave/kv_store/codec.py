"""The stored-block format: a versioned, checksummed header, then the raw tensor bytes.

No pickle: a value is plain bytes any process can check before trusting. The header binds
the value to the block hash it was stored under, so a value that is corrupt, truncated, of
another format version, or sitting under the wrong key decodes to a miss, never to wrong KV.

Layout (little-endian)::

    magic "CLKV" | version u16 | dtype u8 | ndim u8 | tokens u32 | block_hash 32B
    | payload_len u64 | checksum u64 | shape u32 * ndim | payload

The checksum (XXH3-64) covers every header byte before it, the shape and the payload. XXH3
runs at memory speed (CRC32 ran at 7 GB/s here and was a third of a block's put or get).

With a MAC key (derived from the service's secret KV salt: :func:`mac_key`), the checksum
field holds the first 8 bytes of an HMAC-SHA256 over the same bytes instead: anyone who can
write to Redis could otherwise store KV for a prompt of their own under the chain hashes of a
real one, and every request sharing that prefix would be steered by it (issue 15). A block
whose MAC fails is corrupt, so a miss, recomputed. HMAC-SHA256 runs at about 0.7 GB/s a core
here (XXH3: 20): the price of a store that trusts no writer without the key.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import xxhash

MAGIC = b"CLKV"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHBBI32sQ")  # up to and excluding the checksum
_CRC = struct.Struct("<Q")
_FIXED_AND_CRC = struct.Struct(_FIXED.format + "Q")
_SHAPE_AT = _FIXED.size + _CRC.size
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
_CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}
MAX_NDIM = 8
_SHAPES = [struct.Struct(f"<{n}I") for n in range(MAX_NDIM + 1)]


class CorruptBlock(ValueError):
    """A stored value that must not be trusted; callers count it and treat it as a miss."""


@dataclass(frozen=True)
class BlockHeader:
    dtype: str
    shape: tuple[int, ...]
    num_tokens: int
    block_hash: bytes

    @property
    def payload_len(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for dim in self.shape:
            n *= dim
        return n


def mac_key(salt: str) -> bytes:
    """The key of the blocks' MAC, from the service's KV salt (empty: no salt, no MAC). A
    derived key, not the salt itself: the salt's other use (block hashes) never meets it."""
    if not salt:
        return b""
    return hmac.new(salt.encode(), b"cleave kv block mac v1", hashlib.sha256).digest()


def _checksum(fixed: bytes | memoryview, shape: bytes | memoryview,
              payload: memoryview, key: bytes = b"") -> int:
    h: xxhash.xxh3_64 | hmac.HMAC = hmac.new(key, digestmod=hashlib.sha256) if key \
        else xxhash.xxh3_64()
    h.update(fixed)
    h.update(shape)
    h.update(payload)
    if isinstance(h, hmac.HMAC):
        return int.from_bytes(h.digest()[:8], "little")
    return int(h.intdigest())


def header_size(ndim: int) -> int:
    return _FIXED.size + _CRC.size + 4 * ndim


def _check(header: BlockHeader) -> None:
    if header.dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported dtype {header.dtype!r}")
    if not 0 < len(header.shape) <= MAX_NDIM:
        raise ValueError(f"shape must have 1..{MAX_NDIM} dims, got {header.shape}")
    if len(header.block_hash) != 32:
        raise ValueError("block_hash must be 32 bytes")
    if any(not 0 < d < 1 << 32 for d in header.shape):
        raise ValueError(f"shape dims must be in [1, 2**32), got {header.shape}")
    if not 0 <= header.num_tokens < 1 << 32:
        raise ValueError(f"num_tokens must fit in u32, got {header.num_tokens}")


class HeaderWriter:
    """Writes the headers of one block layout (dtype, shape, token count), checked once.

    A producer writes a header per block of every prompt it saves, so the per-block work is
    packing the block's hash and taking the checksum.
    """

    def __init__(self, dtype: str, shape: tuple[int, ...], num_tokens: int,
                 key: bytes = b"") -> None:
        layout = BlockHeader(dtype, shape, num_tokens, bytes(32))
        self._key = key  # the MAC key (mac_key); empty: the unkeyed checksum
        _check(layout)
        self.header_size = header_size(len(shape))
        self.value_size = self.header_size + layout.payload_len
        self._fixed = (MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], len(shape), num_tokens)
        self._payload_len = layout.payload_len
        self._shape = struct.pack(f"<{len(shape)}I", *shape)

    def _check_value(self, value: memoryview, block_hash: bytes) -> None:
        if len(block_hash) != 32:
            raise ValueError("block_hash must be 32 bytes")
        if value.nbytes != self.value_size:
            raise ValueError(f"value buffer is {value.nbytes} bytes, needs {self.value_size}")

    def write(self, value: memoryview, block_hash: bytes) -> None:
        """Write the header in front of a payload already in place at
        ``value[header_size:]``: producers lay each block's tensor bytes straight into its
        value buffer, so the write path never copies a payload to prepend a header."""
        self._check_value(value, block_hash)
        start = self.header_size
        fixed = _FIXED.pack(*self._fixed, block_hash, self._payload_len)
        value[:start] = (fixed + _CRC.pack(_checksum(fixed, self._shape, value[start:],
                                                     self._key)) + self._shape)

    def deferred(self, value: memoryview, block_hash: bytes) -> Callable[[], None]:
        """:meth:`write`, checked now and done when the returned function is called.

        The store calls it just before the value goes out: the checksum's pass over the
        payload then brings it into cache for the socket's copy, one trip through memory
        instead of two.
        """
        self._check_value(value, block_hash)
        return partial(self.write, value, block_hash)


def encode_into(value: memoryview, header: BlockHeader, key: bytes = b"") -> None:
    """:meth:`HeaderWriter.write` for one block."""
    HeaderWriter(header.dtype, header.shape, header.num_tokens, key).write(value,
                                                                           header.block_hash)


def encode(header: BlockHeader, payload: memoryview | bytes, key: bytes = b"") -> bytes:
    """Header and payload as one new value (a copy; producers lay payloads in place and use
    :meth:`HeaderWriter.deferred`)."""
    writer = HeaderWriter(header.dtype, header.shape, header.num_tokens, key)
    data = memoryview(payload).cast("B")
    if data.nbytes != writer.value_size - writer.header_size:
        raise ValueError(f"payload is {data.nbytes} bytes; {header.shape} {header.dtype} "
                         f"needs {header.payload_len}")
    value = bytearray(writer.value_size)
    value[writer.header_size:] = data
    writer.write(memoryview(value), header.block_hash)
    return bytes(value)


def decode(value: bytes | memoryview, expected_hash: bytes | None = None, key: bytes = b""
           ) -> tuple[BlockHeader, memoryview]:
    """Check a stored value; returns its header and a zero-copy view of the payload.

    Raises :class:`CorruptBlock` for anything that is not exactly a block of this format,
    stored under ``expected_hash`` when given, and MACed with ``key`` when one is given.
    """
    view = memoryview(value).cast("B")
    if view.nbytes < _SHAPE_AT:
        raise CorruptBlock("value shorter than the header")
    magic, version, code, ndim, tokens, block_hash, payload_len, crc = \
        _FIXED_AND_CRC.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"format version {version}, expected {FORMAT_VERSION}")
    dtype = _CODE_DTYPES.get(code)
    if dtype is None or not 0 < ndim <= MAX_NDIM:
        raise CorruptBlock("bad dtype or ndim")
    payload_at = _SHAPE_AT + 4 * ndim
    if view.nbytes != payload_at + payload_len:
        raise CorruptBlock(f"value is {view.nbytes} bytes, header says {payload_at + payload_len}")
    shape = _SHAPES[ndim].unpack_from(view, _SHAPE_AT)
    if math.prod(shape) * DTYPE_SIZES[dtype] != payload_len:
        raise CorruptBlock("shape and dtype disagree with the payload length")
    payload = view[payload_at:]
    # Compared in constant time: a keyed tag must not tell a forger how much of it was right.
    if not hmac.compare_digest(_CRC.pack(_checksum(view[:_FIXED.size],
                                                   view[_SHAPE_AT:payload_at], payload, key)),
                               _CRC.pack(crc)):
        raise CorruptBlock("checksum mismatch (or a MAC made without this service's key)")
    if expected_hash is not None and block_hash != expected_hash:
        raise CorruptBlock("value belongs to another block")
    return BlockHeader(dtype, shape, tokens, block_hash), payload

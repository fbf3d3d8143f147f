"""TFRecord framing and the record payload: a hand-encoded ``tf.train.Example`` {path, data}.

A frame is ``uint64 length (LE) | masked crc32c(length bytes) | payload | masked crc32c(payload)``.
The payload is the protobuf of ``Example{features{feature{"path": bytes_list[path]},
feature{"data": bytes_list[data]}}}`` with the data feature last, so the file's bytes are the
last ``len(data)`` bytes of the payload: the index keeps that offset and a file is one ranged read.
"""

import struct
from collections.abc import Iterator
from typing import BinaryIO

import crc32c as _crc32c

from cachefs.packfmt.errors import CorruptRecord

HEADER = 12   # uint64 length + uint32 masked crc of it
FOOTER = 4    # uint32 masked crc of the payload
_MASK_DELTA = 0xA282EAD8
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """Plain crc32c (Castagnoli), in C; ``value`` continues an earlier checksum."""
    return _crc32c.crc32c(data, value)


def mask(crc: int) -> int:
    """TFRecord's masking of a crc32c."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def masked_crc(data: bytes | memoryview) -> int:
    return mask(_crc32c.crc32c(data))


def frame_header(payload_length: int) -> bytes:
    """The 12 bytes before a payload of ``payload_length`` bytes."""
    length = _LEN.pack(payload_length)
    return length + _CRC.pack(masked_crc(length))


def frame_footer(payload_crc: int) -> bytes:
    """The 4 bytes after a payload whose plain crc32c is ``payload_crc``."""
    return _CRC.pack(mask(payload_crc))


def frame(payload: bytes) -> bytes:
    """One TFRecord: header, payload, footer."""
    return b"".join((frame_header(len(payload)), payload, frame_footer(_crc32c.crc32c(payload))))


def frame_length(payload_length: int) -> int:
    return HEADER + payload_length + FOOTER


# ---- the Example payload -------------------------------------------------------------------------
_SMALL_VARINTS = tuple(bytes([v]) for v in range(0x80))
_TAG_1 = b"\x0a"     # field 1, length-delimited
_TAG_2 = b"\x12"     # field 2, length-delimited


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint_length(value: int) -> int:
    return 1 if value < 0x80 else (value.bit_length() + 6) // 7


def _field(number: int, body: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def _feature_entry_head(key: bytes, value_length: int) -> bytes:
    """The bytes of map entry {key: Feature{bytes_list{value}}} (field 1 of Features) up to the value."""
    bytes_list_len = 1 + _varint_length(value_length) + value_length
    feature_len = 1 + _varint_length(bytes_list_len) + bytes_list_len
    key_field = _TAG_1 + _varint(len(key)) + key
    entry_len = len(key_field) + 1 + _varint_length(feature_len) + feature_len
    return b"".join((_TAG_1, _varint(entry_len), key_field, _TAG_2, _varint(feature_len),
                     _TAG_1, _varint(bytes_list_len), _TAG_1, _varint(value_length)))


def _feature_entry_head_length(key_length: int, value_length: int) -> int:
    bytes_list_len = 1 + _varint_length(value_length) + value_length
    feature_len = 1 + _varint_length(bytes_list_len) + bytes_list_len
    entry_len = 1 + _varint_length(key_length) + key_length + 1 + _varint_length(feature_len) + feature_len
    return 1 + _varint_length(entry_len) + entry_len - value_length


def example_head(path: bytes, data_length: int) -> bytes:
    """Everything of the Example payload before the data bytes (the data is the payload's tail)."""
    path_entry = _feature_entry_head(b"path", len(path)) + path
    data_head = _feature_entry_head(b"data", data_length)
    features_len = len(path_entry) + len(data_head) + data_length
    return _TAG_1 + _varint(features_len) + path_entry + data_head


def example_head_length(path_length: int, data_length: int) -> int:
    """``len(example_head(path, data_length))`` without building it (the shard plan's arithmetic)."""
    features_len = (_feature_entry_head_length(4, path_length) + path_length
                    + _feature_entry_head_length(4, data_length) + data_length)
    return 1 + _varint_length(features_len) + features_len - data_length


def encode_example(path: bytes, data: bytes) -> tuple[bytes, int]:
    """The payload and the offset of ``data`` inside it."""
    head = example_head(path, len(data))
    return head + data, len(head)


def record_layout(path: bytes, data_length: int) -> tuple[int, int]:
    """(frame length, data offset inside the frame) of a file's record, without its bytes."""
    head = example_head_length(len(path), data_length)
    return frame_length(head + data_length), HEADER + head


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise CorruptRecord("truncated or malformed protobuf varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field; other wire types are skipped."""
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        wire = tag & 7
        if wire == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise CorruptRecord("protobuf field runs past the end of the record")
            yield tag >> 3, pos, pos + length
            pos += length
        elif wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise CorruptRecord(f"unsupported protobuf wire type {wire}")


def decode_example(payload: bytes | memoryview) -> dict[str, tuple[int, int]]:
    """{feature name: (start, end) of its first bytes value inside ``payload``} for bytes features."""
    buf, out = memoryview(payload), {}
    for number, start, end in _fields(buf):
        if number != 1:
            continue
        for entry_no, e_start, e_end in _fields(buf[start:end]):
            if entry_no == 1:
                key, span = _map_entry(buf, start + e_start, start + e_end)
                if span is not None:
                    out[key] = span
    return out


def _map_entry(buf: memoryview, start: int, end: int) -> tuple[str, tuple[int, int] | None]:
    key, span = "", None
    for number, f_start, f_end in _fields(buf[start:end]):
        if number == 1:
            key = bytes(buf[start + f_start:start + f_end]).decode("utf-8", "replace")
        elif number == 2:
            span = _first_bytes(buf, start + f_start, start + f_end)
    return key, span


def _first_bytes(buf: memoryview, start: int, end: int) -> tuple[int, int] | None:
    """The first value of a Feature's bytes_list, as a span of ``buf``."""
    for number, l_start, l_end in _fields(buf[start:end]):
        if number == 1:
            for value_no, v_start, v_end in _fields(buf[start + l_start:start + l_end]):
                if value_no == 1:
                    return start + l_start + v_start, start + l_start + v_end
    return None


def example_fields(payload: bytes) -> tuple[bytes, bytes]:
    """(path, data) of a packed record; CorruptRecord if either feature is missing."""
    spans = decode_example(payload)
    if "path" not in spans or "data" not in spans:
        raise CorruptRecord("record is not a cachefs Example (no 'path' or 'data' feature)")
    (p0, p1), (d0, d1) = spans["path"], spans["data"]
    return bytes(payload[p0:p1]), bytes(payload[d0:d1])


# ---- reading frames ------------------------------------------------------------------------------
def unframe(record: bytes | memoryview, offset: int = 0) -> memoryview:
    """The checked payload of one whole frame (as stored at ``offset``, for the message)."""
    view = memoryview(record)
    if len(view) < HEADER + FOOTER:
        raise CorruptRecord(f"record at offset {offset}: truncated ({len(view)} bytes)")
    length = _check_header(view[:HEADER], offset)
    if len(view) != HEADER + length + FOOTER:
        raise CorruptRecord(f"record at offset {offset}: length {length} does not fit {len(view)} bytes")
    payload = view[HEADER:HEADER + length]
    _check_crc(payload, view[HEADER + length:], offset, "data")
    return payload


def _check_header(header: memoryview, offset: int) -> int:
    _check_crc(header[:8], header[8:12], offset, "length")
    return _LEN.unpack(header[:8])[0]


def _check_crc(data: memoryview, stored: memoryview, offset: int, what: str) -> None:
    if len(stored) != 4 or _CRC.unpack(stored)[0] != masked_crc(data):
        raise CorruptRecord(f"record at offset {offset}: {what} crc32c mismatch")


def iter_records(stream: BinaryIO) -> Iterator[tuple[int, memoryview]]:
    """(offset, checked payload) of every record in a shard stream, in order."""
    offset = 0
    while True:
        header = stream.read(HEADER)
        if not header:
            return
        if len(header) < HEADER:
            raise CorruptRecord(f"record at offset {offset}: truncated header")
        length = _check_header(memoryview(header), offset)
        body = stream.read(length + FOOTER)
        if len(body) < length + FOOTER:
            raise CorruptRecord(f"record at offset {offset}: truncated ({len(body)} of {length + FOOTER} bytes)")
        view = memoryview(body)
        _check_crc(view[:length], view[length:], offset, "data")
        yield offset, view[:length]
        offset += HEADER + length + FOOTER

"""The protobuf wire format of NodePrepareResources / NodeUnprepareResources, by hand.

The kubelet calls these two methods for every pod with claims; decoding their requests and
encoding their answers through betterproto message objects cost tens of microseconds a call.
This module reads the request bytes straight into `Claim` tuples and writes the answers straight
from the preparer's results. v1 and v1beta1 share the format, except that v1's ``Device`` has
``optional string share_id = 5`` (see ``protos/dra/``).

grpclib's `ProtoCodec` only calls ``FromString(data)`` on the request type and
``SerializeToString()`` on the reply: `ClaimsRequest` and `EncodedReply` are those types.

Encoding (https://protobuf.dev/programming-guides/encoding/): a message is a sequence of fields,
each a varint tag ``field_number << 3 | wire_type`` and then its value; strings and messages are
wire type 2, a varint length and the bytes. The decoder accepts what any conforming encoder
writes (fields in any order, repeated, unknown ones skipped) and refuses anything malformed
with a `WireFormatError` saying what and where; like betterproto before it, it also refuses a
known field of another wire type and groups (wire types 3 and 4, proto2's, never in these
messages), which the official protobuf runtime would keep as unknown fields.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

from agent.claims.preparer import PreparedDevice, PrepareResult

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""A larger request is refused undecoded (gRPC's default limit on a received message)."""
MAX_FIELD_NUMBER = (1 << 29) - 1

_VARINT, _FIXED64, _LENGTH_DELIMITED, _GROUP_START, _GROUP_END, _FIXED32 = range(6)
_CLAIM_FIELDS = ("namespace", "uid", "name")

# The tags of fields 1 to 5 with wire type 2: every field these answers carry is one.
_F1, _F2, _F3, _F4, _F5 = (bytes(((n << 3) | _LENGTH_DELIMITED,)) for n in range(1, 6))
_ONE_BYTE = tuple(bytes((n,)) for n in range(0x80))


class WireFormatError(ValueError):
    """The request bytes are not a valid message; the text says what is wrong and where."""


class Claim(NamedTuple):
    """One ``Claim`` of a request (v1 and v1beta1 alike)."""

    namespace: str
    uid: str
    name: str


class ClaimsRequest:
    """A decoded ``NodePrepareResourcesRequest`` or ``NodeUnprepareResourcesRequest`` (same format)."""

    __slots__ = ("claims",)

    def __init__(self, claims: tuple[Claim, ...]) -> None:
        self.claims = claims

    @classmethod
    def FromString(cls, data: bytes) -> ClaimsRequest:  # the name grpclib's codec calls
        return cls(decode_claims(data))


class EncodedReply:
    """An answer already in wire bytes, which grpclib's codec sends as they are."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # the name grpclib's codec calls
        return self.data


# --- decoding ---------------------------------------------------------------------------------


def decode_claims(data: bytes) -> tuple[Claim, ...]:
    """The claims of a request.

    ``repeated Claim claims = 1``; ``Claim {string namespace = 1; string uid = 2; string name = 3}``.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireFormatError(f"message too long: {len(data)} bytes, at most {MAX_MESSAGE_BYTES}")
    claims = []
    for _, start, stop in _fields(data, 0, len(data), 1):
        try:
            claims.append(_claim(data, start, stop))
        except WireFormatError as exc:
            raise WireFormatError(f"claims[{len(claims)}]: {exc}") from None
    return tuple(claims)


def _claim(data: bytes, start: int, stop: int) -> Claim:
    values = ["", "", ""]
    for number, begin, end in _fields(data, start, stop, 3):
        try:
            values[number - 1] = data[begin:end].decode()
        except UnicodeDecodeError:
            raise WireFormatError(
                f"invalid UTF-8 in field {number} ({_CLAIM_FIELDS[number - 1]}) at byte {begin}"
            ) from None
    return Claim(*values)


def _fields(data: bytes, pos: int, end: int, known: int) -> Iterator[tuple[int, int, int]]:
    """``(number, start, stop)`` of each field numbered 1 to `known` in ``data[pos:end]``.

    Those fields are all strings or messages (wire type 2); any other field is checked and skipped.
    """
    while pos < end:
        at = pos
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(data, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if not 0 < number <= MAX_FIELD_NUMBER:
            raise WireFormatError(f"invalid field number {number} at byte {at}")
        if wire_type == _LENGTH_DELIMITED:
            if pos < end and data[pos] < 0x80:
                length, start = data[pos], pos + 1
            else:
                length, start = _varint(data, pos, end)
            if length > end - start:
                raise WireFormatError(
                    f"field {number} at byte {at}: length {length} runs past the end of its message "
                    f"({end - start} bytes left)"
                )
            pos = start + length
            if number <= known:
                yield number, start, pos
        elif number <= known:
            raise WireFormatError(
                f"wrong wire type {wire_type} for field {number} at byte {at} "
                f"(expected {_LENGTH_DELIMITED}, length-delimited)"
            )
        elif wire_type == _VARINT:
            pos = _varint(data, pos, end)[1]
        elif wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > end:
                raise WireFormatError(f"field {number} at byte {at}: truncated fixed-size value")
        elif wire_type in (_GROUP_START, _GROUP_END):
            raise WireFormatError(
                f"field {number} at byte {at}: groups (wire type {wire_type}) are not supported"
            )
        else:
            raise WireFormatError(f"invalid wire type {wire_type} for field {number} at byte {at}")


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it: 64 bits at most, so 10 bytes at most."""
    value = shift = 0
    for i in range(pos, min(end, pos + 10)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >> 64:
                raise WireFormatError(f"varint at byte {pos} overflows 64 bits")
            return value, i + 1
        shift += 7
    if end - pos >= 10:
        raise WireFormatError(f"varint longer than 10 bytes at byte {pos}")
    raise WireFormatError(f"truncated varint at byte {pos}")


# --- encoding ---------------------------------------------------------------------------------


def base_request_names(requests: Sequence[str]) -> list[str]:
    """``gpu/sub`` -> ``gpu``, duplicates dropped: the kubelet matches containers on base names."""
    return list(dict.fromkeys(r.partition("/")[0] for r in requests))


def encode_prepare_response(results: Mapping[str, PrepareResult], *, share_id: bool) -> bytes:
    """``NodePrepareResourcesResponse``: ``map<string, NodePrepareResourceResponse> claims = 1``.

    ``NodePrepareResourceResponse {repeated Device devices = 1; string error = 2}``: the devices,
    or only the error when there is one. `share_id`: v1's ``Device`` has field 5, v1beta1's not.
    """
    entries = []
    for uid, result in results.items():
        if result.error:
            value = _field(_F2, result.error.encode())
        else:
            value = b"".join([_field(_F1, _device(d, share_id)) for d in result.devices])
        entries.append(_map_entry(uid, value))
    return b"".join(entries)


def encode_unprepare_response(errors: Mapping[str, str]) -> bytes:
    """``NodeUnprepareResourcesResponse``: ``map<string, NodeUnprepareResourceResponse> claims = 1``.

    ``NodeUnprepareResourceResponse {string error = 1}``, empty for a success.
    """
    return b"".join([_map_entry(uid, _field(_F1, e.encode()) if e else b"") for uid, e in errors.items()])


def _device(device: PreparedDevice, share_id: bool) -> bytes:
    """``Device {repeated string request_names = 1; string pool_name = 2; string device_name = 3;
    repeated string cdi_device_ids = 4; optional string share_id = 5}``.

    proto3 leaves out empty singular strings, but ``optional`` has presence: a share ID of ``""``
    is sent (``None`` is not), as betterproto did for this field.
    """
    parts = [_field(_F1, r.encode()) for r in base_request_names(device.requests)]
    if device.pool:
        parts.append(_field(_F2, device.pool.encode()))
    if device.device:
        parts.append(_field(_F3, device.device.encode()))
    parts.extend([_field(_F4, c.encode()) for c in device.cdi_device_ids])
    if share_id and device.share_id is not None:
        parts.append(_field(_F5, device.share_id.encode()))
    return b"".join(parts)


def _map_entry(key: str, value: bytes) -> bytes:
    """A map field's entry (field 1): a message ``{key = 1; value = 2}``.

    An empty key is left out (proto3's default); the value message always goes, even empty.
    """
    entry = _field(_F2, value)
    if key:
        entry = _field(_F1, key.encode()) + entry
    return _field(_F1, entry)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length as a varint, the payload."""
    size = len(payload)
    if size < 0x80:
        return tag + _ONE_BYTE[size] + payload
    length = bytearray()
    while size >= 0x80:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return tag + length + payload

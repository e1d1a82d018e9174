"""Tensor data as the Open Inference Protocol carries it, to and from flat Python lists.

Raw form (gRPC `raw_input_contents` / `raw_output_contents`, HTTP binary data): row-major bytes,
little-endian; a BYTES element is a 4-byte little-endian length followed by its bytes; BOOL is one
byte. Typed form: gRPC `InferTensorContents` fields, or JSON `data` (nested or flat) over HTTP.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from pagedserve.errors import InvalidRequestError

# datatype -> numpy dtype of its raw form (BYTES has none: length-prefixed elements)
NUMPY_DTYPES: dict[str, str] = {
    "BOOL": "|b1",
    "UINT8": "|u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "|i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}
DATATYPES = frozenset(NUMPY_DTYPES) | {"BYTES", "BF16"}

# datatype -> the InferTensorContents field holding it in typed form
CONTENTS_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def element_count(field: str, shape: Sequence[int]) -> int:
    if any(d < 0 for d in shape):
        raise InvalidRequestError(f"{field}.shape", f"dimensions must not be negative, got {list(shape)}")
    return math.prod(shape)


def check_datatype(field: str, datatype: str) -> None:
    if datatype not in DATATYPES:
        raise InvalidRequestError(f"{field}.datatype", f"unknown datatype {datatype!r}")


def decode_raw(field: str, datatype: str, shape: Sequence[int], data: bytes) -> list[Any]:
    """Flat list of the elements of one raw tensor; the byte count must match the shape."""
    count = element_count(field, shape)
    if datatype == "BYTES":
        values = decode_bytes(field, data)
    elif datatype == "BF16":
        raise InvalidRequestError(f"{field}.datatype", "BF16 inputs are not supported")
    else:
        dtype = np.dtype(NUMPY_DTYPES[datatype])
        if len(data) % dtype.itemsize:
            raise InvalidRequestError(
                field, f"{len(data)} bytes is not a whole number of {datatype} elements"
            )
        values = np.frombuffer(data, dtype=dtype).tolist()
    if len(values) != count:
        raise InvalidRequestError(
            field, f"holds {len(values)} elements but its shape {list(shape)} needs {count}"
        )
    return values


def decode_bytes(field: str, data: bytes) -> list[bytes]:
    values, pos = [], 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise InvalidRequestError(field, "BYTES element is missing its 4-byte length prefix")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise InvalidRequestError(field, f"BYTES element of length {size} runs past the end of the data")
        values.append(bytes(data[pos : pos + size]))
        pos += size
    return values


def decode_contents(field: str, datatype: str, shape: Sequence[int], contents: Any) -> list[Any]:
    """Flat list of the elements of a tensor given in typed gRPC contents."""
    count = element_count(field, shape)
    name = CONTENTS_FIELDS.get(datatype)
    if name is None:
        raise InvalidRequestError(field, f"{datatype} data must be sent in raw_input_contents")
    values = list(getattr(contents, name))
    if len(values) != count:
        raise InvalidRequestError(
            field, f"holds {len(values)} {datatype} elements but its shape {list(shape)} needs {count}"
        )
    return values


def decode_json(field: str, datatype: str, shape: Sequence[int], data: Any) -> list[Any]:
    """Flat list of the elements of a tensor given as JSON `data` (nested or flat)."""
    count = element_count(field, shape)
    values = list(_flatten(data))
    if len(values) != count:
        raise InvalidRequestError(
            field, f"holds {len(values)} elements but its shape {list(shape)} needs {count}"
        )
    expected: type | tuple[type, ...]
    if datatype == "BYTES":
        expected = str
    elif datatype == "BOOL":
        expected = bool
    elif datatype.startswith(("INT", "UINT")):
        expected = int
    else:
        expected = (int, float)
    for value in values:
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise InvalidRequestError(field, f"{value!r} is not a {datatype} value")
    return [utf8(field, v) for v in values] if datatype == "BYTES" else values


def _flatten(data: Any) -> Iterable[Any]:
    if isinstance(data, list):
        for item in data:
            yield from _flatten(item)
    else:
        yield data


def utf8(field: str, text: str) -> bytes:
    """`text` as UTF-8, or an error naming `field`."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, which JSON's "\ud800" escapes can spell
        raise InvalidRequestError(field, "is not valid UTF-8 (it holds a lone surrogate)") from None


def encode_raw(datatype: str, values: Sequence[Any]) -> bytes:
    if datatype == "BYTES":
        return encode_bytes(values)
    return np.asarray(values, dtype=np.dtype(NUMPY_DTYPES[datatype])).tobytes()


def encode_bytes(values: Iterable[bytes | str]) -> bytes:
    parts = []
    for value in values:
        data = value.encode() if isinstance(value, str) else value
        parts.append(struct.pack("<I", len(data)) + data)
    return b"".join(parts)


def encode_json(datatype: str, values: Sequence[Any]) -> list[Any]:
    if datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]
    return list(values)

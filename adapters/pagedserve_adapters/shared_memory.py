"""Triton's system shared memory extension: a client on the same host registers a POSIX shared
memory object it made (tritonclient.utils.shared_memory: `/dev/shm/<key>`) as a named region, and an
inference's input tensors are read from it, and its requested outputs written into it, in place of
the tensor data in the messages.

A tensor names its region with the parameters `shared_memory_region` (a string) and
`shared_memory_byte_size` (its data's size), and optionally `shared_memory_offset` (into the region,
0 by default); given one of the first two without the other, or outside the region, it is refused
naming the parameter. An input's data is then its raw bytes there (BYTES: each element a 4-byte
little-endian length and the bytes, as raw_input_contents). An output's raw bytes are written there
and its response tensor carries its name, datatype and shape but no data; one larger than the space
given is refused, the region left as it was. A streamed request writes each response's outputs over
the last's, as Triton does: the client reads them as each response arrives.

Opening what a client names is off unless the server runs with --allow-client-shm (Triton's flag of
the same name, off by default there too): a key is a shared memory object's name, one path component,
under /dev/shm, opened read-write. A region's object stays open until it is unregistered (an empty
name: all of them) or the server stops. It is read and written with pread and pwrite, never mapped:
had the server mapped it, a client shrinking it would have the server killed by SIGBUS at its next
access past the end; a short read is an error to report instead (the request is refused, naming the
region). CUDA shared memory is not served (a CPU server's clients have none)."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve_adapters.llm_model import AdapterError

SHM_DIR = "/dev/shm"
REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"


@dataclass
class Region:
    name: str
    key: str
    offset: int  # into the shared memory object
    byte_size: int
    fd: int  # the object, open while registered (-1 once unregistered)

    def lost(self, where: str) -> str | None:
        """Why the region cannot be used now, if it cannot: unregistered, or its object shrunk by the
        client since."""
        if self.fd < 0:
            return f"{where}.parameters.{REGION}: region {self.name!r} was unregistered"
        size = os.fstat(self.fd).st_size
        if size < self.offset + self.byte_size:
            return (
                f"{where}.parameters.{REGION}: the shared memory object {self.key!r} of region {self.name!r} "
                f"holds {size} bytes now, fewer than the {self.offset + self.byte_size} registered"
            )
        return None

    def close(self) -> None:
        os.close(self.fd)
        self.fd = -1


@dataclass(frozen=True)
class Place:
    """Where a tensor's data lies: `byte_size` bytes at `offset` into `region`."""

    region: Region
    offset: int
    byte_size: int

    @property
    def start(self) -> int:  # into the object
        return self.region.offset + self.offset

    def read(self, where: str) -> bytes:
        if (why := self.region.lost(where)) is None:
            data = os.pread(self.region.fd, self.byte_size, self.start)
            if len(data) == self.byte_size:
                return data
            why = self.region.lost(where)  # shrunk between the check and the read
        raise AdapterError("invalid", why or f"{where}: the shared memory region could not be read whole")

    def write(self, where: str, data: bytes) -> None:
        """Write an output's raw bytes; refused (nothing written) when they do not fit."""
        if (why := self.region.lost(where)) is not None:
            raise WriteError("invalid", why)
        if len(data) > self.byte_size:
            raise WriteError(
                "invalid",
                f"{where}.parameters.{BYTE_SIZE}: {self.byte_size} bytes cannot hold the output "
                f"({len(data)} bytes)",
            )
        os.pwrite(self.region.fd, data, self.start)


class WriteError(AdapterError):
    """An output its region cannot take, found once the request has run (not a refusal of it)."""


class SharedMemory:
    """The server's registered regions, by name (one registry for gRPC and REST)."""

    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed
        self.regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not self.allowed:
            raise AdapterError(
                "permission_denied",
                "client shared memory is off: start the server with --allow-client-shm to register "
                "regions (it opens whatever shared memory object a client names)",
            )
        if not name:
            raise AdapterError("invalid", "name: must not be empty")
        if name in self.regions:
            raise AdapterError("already_exists", f"name: a region {name[:256]!r} is already registered")
        path = _object_path(key)
        if offset < 0 or byte_size <= 0:
            raise AdapterError("invalid", "offset and byte_size: offset >= 0 and byte_size > 0 are needed")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise AdapterError(
                "invalid", f"key: no shared memory object {key[:256]!r} can be opened: {exc.strerror}"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise AdapterError("invalid", f"key: {key[:256]!r} is not a shared memory object")
            if info.st_size < offset + byte_size:
                raise AdapterError(
                    "invalid",
                    f"byte_size: {key[:256]!r} holds {info.st_size} bytes, fewer than offset + byte_size "
                    f"({offset + byte_size})",
                )
        except BaseException:
            os.close(fd)
            raise
        self.regions[name] = Region(name, key, offset, byte_size, fd)

    def status(self, name: str) -> list[Region]:
        """One region, or every one for an empty name."""
        if not name:
            return list(self.regions.values())
        if name not in self.regions:
            raise AdapterError("not_found", f"name: no shared memory region {name[:256]!r} is registered")
        return [self.regions[name]]

    def unregister(self, name: str) -> None:
        """One region, or every one for an empty name; a name not registered is nothing to do."""
        for region_name in [name] if name else list(self.regions):
            region = self.regions.pop(region_name, None)
            if region is not None:
                region.close()

    def close(self) -> None:
        self.unregister("")

    def place(self, where: str, parameters: Mapping[str, Any]) -> Place | None:
        """Where the tensor at `where` (inputs.x / outputs.x) has its data, or None when its
        `parameters` name no region."""
        if REGION not in parameters and BYTE_SIZE not in parameters:
            if OFFSET in parameters:
                raise AdapterError("invalid", f"{where}.parameters.{OFFSET}: given without {REGION}")
            return None
        for needed in (REGION, BYTE_SIZE):
            if needed not in parameters:
                other = BYTE_SIZE if needed == REGION else REGION
                raise AdapterError("invalid", f"{where}.parameters.{needed}: needed with {other}")
        name, byte_size = parameters[REGION], parameters[BYTE_SIZE]
        offset = parameters.get(OFFSET, 0)
        if not isinstance(name, str):
            raise AdapterError("invalid", f"{where}.parameters.{REGION}: must be a string, got {name!r}")
        for key, value in ((BYTE_SIZE, byte_size), (OFFSET, offset)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AdapterError(
                    "invalid", f"{where}.parameters.{key}: must be an integer >= 0, got {value!r}"
                )
        region = self.regions.get(name)
        if region is None:
            raise AdapterError(
                "invalid",
                f"{where}.parameters.{REGION}: no shared memory region {name[:256]!r} is registered",
            )
        if offset + byte_size > region.byte_size:
            raise AdapterError(
                "invalid",
                f"{where}.parameters.{BYTE_SIZE}: offset + byte_size ({offset + byte_size}) is past the end "
                f"of region {name!r} ({region.byte_size} bytes)",
            )
        return Place(region, offset, byte_size)


def _object_path(key: str) -> str:
    """A key names a shared memory object as shm_open does: one name, an optional leading '/'."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise AdapterError(
            "invalid", f"key: {key[:256]!r} is not a shared memory object's name (one name, as '/input0')"
        )
    return os.path.join(SHM_DIR, name)

"""Plain state-dict files, ``.safetensors`` and ``.pt``: written tensor by tensor, read range
by range, so neither side ever holds more than a bounded part of the model.

Writing. The caller lists ``Entry``s (name, shape, dtype, ``source``) and gives a ``read``
function that yields each entry's data, in order, as 1-D chunks. Entries with the same
``source`` are aliases (tied params): ``.pt`` stores their data once and torch.load ties
them again; ``.safetensors`` cannot share data and stores it once per name.

- ``.safetensors``: the header (names, dtypes, shapes, byte ranges) is known from the
  entries alone, so the file is written front to back.
- ``.pt``: torch's own writer lays out the zip archive first (``skip_data`` over fake
  tensors: the pickle, and a hole per storage), then each chunk goes to its place with
  ``pwrite`` and each storage's CRC-32 is patched into its zip headers.

The reasoning is [Note: weights checksums] below."""

# [Note: weights checksums] A ``.safetensors`` file flatshard writes carries, in its header's
# ``__metadata__`` under ``flatshard.crc32``, the CRC-32 of every ``CRC_BLOCK`` bytes of every
# tensor, computed as the bytes are written (the header goes out first with placeholders of
# the same width, and is rewritten in place at the end). A read of any range checks the
# blocks it touches, so a rank reading only its shard still checks all it reads; a mismatch
# is a ``ChecksumError`` naming the file, the tensor and the bytes. ``.pt`` files (ours and
# torch.save's) carry the zip format's CRC-32 per storage, which is checked over the whole
# file when one is opened. ``.safetensors`` files from elsewhere (a Hugging Face checkpoint)
# carry none of ours and are read unchecked.
#
# Reading (``open_source``): a path to either format, or an in-memory state dict, becomes a
# ``Source`` with each tensor's shape and dtype and ``read(name, lo, hi)``, the flat elements
# ``[lo, hi)`` of one tensor. A ``.safetensors`` read touches only those bytes of the file; a
# ``.pt`` file is memory-mapped.

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from flatshard.errors import CheckpointError, ChecksumError

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPE_OF = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
PT_SUFFIXES = (".pt", ".pth", ".bin")
CRC_KEY = "flatshard.crc32"
CRC_BLOCK = 2**20  # bytes of a tensor per checksum; a range read checks the whole blocks it touches
_NO_CRC = "00000000"


class Entry(NamedTuple):
    """One tensor of a file to write: its data comes from ``source`` (entries that share a
    source are the same tensor under several names)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


Reader = Callable[[list[Entry]], Iterator[tuple[Entry, torch.Tensor]]]


def file_format(path: str) -> str:
    if path.endswith(".safetensors"):
        return "safetensors"
    if path.endswith(PT_SUFFIXES):
        return "pt"
    raise ValueError(f"{path}: expected a .safetensors or .pt file (by its suffix)")


def write_state_file(path: str, entries: list[Entry], read: Reader) -> None:
    """Write ``entries`` to ``path`` (its suffix picks the format), through ``path.partial``
    so that ``path`` appears only complete."""
    fmt = file_format(path)
    partial = path + ".partial"
    try:
        if fmt == "safetensors":
            _write_safetensors(partial, entries, read)
        else:
            _write_pt(partial, entries, read)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _checked_chunks(entries: list[Entry], read: Reader) -> Iterator[tuple[Entry, memoryview]]:
    """``read``'s chunks as bytes, checked to come in order (at least one per entry, empty for
    an empty tensor) and to fill each entry exactly."""
    index, left = -1, 0
    for entry, chunk in read(entries):
        if left == 0 and (index < 0 or entry is not entries[index]):
            index += 1
            left = entries[index].nbytes if index < len(entries) else 0
        if index >= len(entries) or entry is not entries[index] or chunk.dtype != entry.dtype:
            raise RuntimeError(f"internal: chunk of {entry.name!r} out of order")
        data = chunk.contiguous().view(torch.uint8).numpy().data
        left -= len(data)
        if left < 0:
            raise RuntimeError(f"internal: {entry.name!r} got more than its {entry.nbytes} bytes")
        yield entry, data
    if index != len(entries) - 1 or left:
        raise RuntimeError("internal: the data ended before the last tensor")


# -- .safetensors ---------------------------------------------------------------------------------
def _safetensors_header(entries: list[Entry], crcs: dict[str, list[str]] | None = None) -> bytes:
    """The header of ``entries``; ``crcs`` (8 hex digits per ``CRC_BLOCK``) default to
    placeholders of the same width, so that the real ones later fit in the same bytes."""
    blocks = {e.name: [_NO_CRC] * max(1, -(-e.nbytes // CRC_BLOCK)) for e in entries}
    checksums = json.dumps({"block": CRC_BLOCK, "tensors": crcs or blocks}, separators=(",", ":"))
    header: dict[str, object] = {"__metadata__": {"format": "pt", CRC_KEY: checksums}}
    offset = 0
    for entry in entries:
        code = SAFETENSORS_DTYPES.get(entry.dtype)
        if code is None:
            raise ValueError(f"{entry.name!r}: .safetensors has no dtype {entry.dtype}")
        header[entry.name] = {
            "dtype": code,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


class _BlockCrcs:
    """The CRC-32 of each ``CRC_BLOCK`` bytes of each entry, fed chunk by chunk in order."""

    def __init__(self) -> None:
        self.crcs: dict[str, list[str]] = {}  # name -> 8 hex digits per block
        self.name: str | None = None
        self.filled = self.crc = 0

    def update(self, entry: Entry, data: memoryview) -> None:
        if entry.name != self.name:
            self._close_entry()
            self.name, self.filled, self.crc = entry.name, 0, 0
            self.crcs[entry.name] = []
        while len(data):
            take = min(len(data), CRC_BLOCK - self.filled)
            self.crc, self.filled = zlib.crc32(data[:take], self.crc), self.filled + take
            if self.filled == CRC_BLOCK:
                self.crcs[entry.name].append(f"{self.crc:08x}")
                self.filled = self.crc = 0
            data = data[take:]

    def _close_entry(self) -> None:
        if self.name is not None and (self.filled or not self.crcs[self.name]):
            self.crcs[self.name].append(f"{self.crc:08x}")

    def finish(self) -> dict[str, list[str]]:
        self._close_entry()
        self.name = None
        return self.crcs


def _write_safetensors(path: str, entries: list[Entry], read: Reader) -> None:
    header = _safetensors_header(entries)
    crcs = _BlockCrcs()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for entry, data in _checked_chunks(entries, read):
            crcs.update(entry, data)
            f.write(data)
        final = _safetensors_header(entries, crcs.finish())
        if len(final) != len(header):
            raise RuntimeError("internal: the checksums changed the header's length")
        f.seek(8)
        f.write(final)
        f.flush()
        os.fsync(f.fileno())


# -- .pt ------------------------------------------------------------------------------------------
def _write_pt(path: str, entries: list[Entry], read: Reader) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    first: dict[Any, Any] = {}  # source -> its first entry: torch numbers storages in the order it meets them
    for entry in entries:
        first.setdefault(entry.source, entry)
    distinct = list(first.values())
    with FakeTensorMode():
        fakes = {e.source: torch.empty(e.shape, dtype=e.dtype) for e in distinct}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({e.name: fakes[e.source] for e in entries}, path)
    records = _zip_storage_records(path)
    if len(records) != len(distinct):
        raise RuntimeError(f"internal: torch.save wrote {len(records)} storages for {len(distinct)} tensors")
    fd = os.open(path, os.O_RDWR)
    try:
        where = {e.name: (records[str(i)], 0, 0) for i, e in enumerate(distinct)}
        for entry, data in _checked_chunks(distinct, read):
            record, written, crc = where[entry.name]
            if record.size != entry.nbytes:
                reserved = record.size
                raise RuntimeError(
                    f"internal: {entry.name!r}: {reserved} bytes reserved, {entry.nbytes} needed"
                )
            os.pwrite(fd, data, record.data_offset + written)
            where[entry.name] = (record, written + len(data), zlib.crc32(data, crc))
        for record, _, crc in where.values():
            for offset in record.crc_offsets:
                os.pwrite(fd, struct.pack("<I", crc), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


class _Record(NamedTuple):
    size: int
    data_offset: int
    crc_offsets: tuple[int, ...]  # where the record's CRC-32 sits in its headers


def _zip_storage_records(path: str) -> dict[str, _Record]:
    """Storage key -> where its bytes and CRC fields are in the zip archive torch.save wrote.
    The CRC-32 of a record is in its central directory entry and, in its local header, or in
    the data descriptor after its data when flag bit 3 says so (torch's writer sets it)."""
    out: dict[str, _Record] = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        central = archive.start_dir
        for info in archive.infolist():
            f.seek(central)
            fixed = f.read(46)
            if fixed[:4] != b"PK\x01\x02" or info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{path}: unexpected zip layout at {info.filename!r}")
            name_len, extra_len, comment_len = struct.unpack("<HHH", fixed[28:34])
            central_crc, central = central + 16, central + 46 + name_len + extra_len + comment_len
            _, _, rest = info.filename.partition("/")
            if not rest.startswith("data/"):
                continue
            f.seek(info.header_offset)
            local = f.read(30)
            (flags,) = struct.unpack("<H", local[6:8])
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            data_offset = info.header_offset + 30 + name_len + extra_len
            local_crc = info.header_offset + 14
            if flags & 0x08:
                f.seek(data_offset + info.file_size)
                local_crc = data_offset + info.file_size + (4 if f.read(4) == b"PK\x07\x08" else 0)
            out[rest.removeprefix("data/")] = _Record(info.file_size, data_offset, (local_crc, central_crc))
    return out


# -- reading --------------------------------------------------------------------------------------
class Source(NamedTuple):
    """Tensors by name, read by flat range: a ``.safetensors`` or ``.pt`` file or a state dict."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)
    read: Callable[[str, int, int], torch.Tensor]  # (name, lo, hi) -> elements [lo, hi), flat
    description: str
    checksums: dict[str, list[str]] | None = None  # a flatshard .safetensors file's block CRCs


def open_source(source: str | os.PathLike | Mapping[str, torch.Tensor]) -> Source:
    if isinstance(source, Mapping):
        return _tensor_source(source, "the state dict")
    path = _weights_path(os.fspath(source))
    if path.endswith(".index.json"):
        return _indexed_source(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no weights file at {path}")
    if file_format(path) == "safetensors":
        return _safetensors_source(path)
    zipped = zipfile.is_zipfile(path)
    if zipped:
        _check_zip(path)
    try:
        if zipped:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        else:  # the legacy (non-zip) format cannot be memory-mapped
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an unpickler fed bytes that are no pickle fails in any way at all
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path} is not a readable .pt state dict: {type(e).__name__} {first}") from e
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state dict")
    return _tensor_source(loaded, path)


HF_FILES = ("model.safetensors", "model.safetensors.index.json")
"""What a directory written by Hugging Face's ``save_pretrained`` holds its weights in (one
file, or shards listed by an index)."""


def _weights_path(path: str) -> str:
    """``path``, or for a directory the weights file (or index) in it."""
    if not os.path.isdir(path):
        return path
    for name in HF_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise FileNotFoundError(f"{path} is a directory with neither {' nor '.join(HF_FILES)}")


def _indexed_source(path: str) -> Source:
    """Sharded ``.safetensors`` files listed by an index (``{"weight_map": {name: file}}``),
    read as one source; every shard is opened (and checked) once."""
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except FileNotFoundError:
        raise FileNotFoundError(f"no weights index at {path}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a safetensors index ({type(e).__name__}: {e})") from None
    directory = os.path.dirname(path)
    files = {name: _safetensors_source(os.path.join(directory, name)) for name in set(weight_map.values())}
    for name, file in weight_map.items():
        if name not in files[file].shapes:
            raise CheckpointError(f"{path} puts {name!r} in {file}, which does not hold it")
    shapes = {name: files[file].shapes[name] for name, file in weight_map.items()}
    return Source(shapes, lambda name, lo, hi: files[weight_map[name]].read(name, lo, hi), path)


def _tensor_source(tensors: Mapping[str, torch.Tensor], description: str) -> Source:
    tensors = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    return Source(shapes, lambda name, lo, hi: tensors[name].detach().reshape(-1)[lo:hi], description)


def _safetensors_source(path: str) -> Source:
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > os.path.getsize(path) - 8:
                raise ValueError(f"a header of {length} bytes in a file of {os.path.getsize(path)}")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a {type(header).__name__}, not a JSON object")
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a .safetensors file: {e}") from None
    checksums = _header_checksums(path, header.pop("__metadata__", None))
    start = 8 + length
    shapes, spans = {}, {}
    for name, info in header.items():
        dtype = _DTYPE_OF.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {name!r} has dtype {info['dtype']}, which flatshard cannot read")
        shapes[name] = (tuple(info["shape"]), dtype)
        spans[name] = info["data_offsets"]

    def read(name: str, lo: int, hi: int) -> torch.Tensor:
        itemsize = shapes[name][1].itemsize
        first, end = spans[name]
        a, b = first + lo * itemsize, first + hi * itemsize
        if name in checksums and b > a:  # widen to whole blocks, check them
            a0 = first + (a - first) // CRC_BLOCK * CRC_BLOCK
            b0 = min(end, first + -(-(b - first) // CRC_BLOCK) * CRC_BLOCK)
            buf = _read_bytes(path, name, start + a0, b0 - a0)
            _check_blocks(path, name, checksums[name], buf, (a0 - first) // CRC_BLOCK)
            buf = buf[a - a0 : b - a0]
        else:
            buf = _read_bytes(path, name, start + a, b - a)
        return torch.frombuffer(buf, dtype=shapes[name][1]) if buf else torch.empty(0, dtype=shapes[name][1])

    return Source(shapes, read, path, checksums or None)


def _header_checksums(path: str, metadata: object) -> dict[str, list[str]]:
    """Tensor name -> its blocks' CRCs, from a header flatshard wrote ({} for other files)."""
    if not isinstance(metadata, dict) or CRC_KEY not in metadata:
        return {}
    try:
        checksums = json.loads(metadata[CRC_KEY])
        if checksums["block"] != CRC_BLOCK:
            raise ValueError(f"blocks of {checksums['block']} bytes, this flatshard reads {CRC_BLOCK}")
        return dict(checksums["tensors"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: its {CRC_KEY} header entry is unreadable ({e})") from None


def _read_bytes(path: str, name: str, offset: int, count: int) -> bytearray:
    buf = bytearray(count)
    with open(path, "rb") as f:
        f.seek(offset)
        if f.readinto(buf) != count:
            raise CheckpointError(f"{path} is truncated: {name!r} is cut short")
    return buf


def _check_blocks(path: str, name: str, crcs: list[str], data: bytearray, first_block: int) -> None:
    view = memoryview(data)
    for i in range(0, len(data), CRC_BLOCK):
        block = first_block + i // CRC_BLOCK
        if block >= len(crcs) or f"{zlib.crc32(view[i : i + CRC_BLOCK]):08x}" != crcs[block]:
            span = f"bytes {block * CRC_BLOCK}..{block * CRC_BLOCK + len(view[i : i + CRC_BLOCK])}"
            raise ChecksumError(
                f"{path}: {name!r} ({span} of the tensor) does not match the checksum written with it: "
                f"the file is corrupted"
            )


def _check_zip(path: str) -> int:
    """Check the CRC-32 of every record of the zip archive ``path``; returns the number of
    storages in it."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path} is not a readable .pt archive: {e}") from None
    if bad is not None:
        raise ChecksumError(f"{path}: {bad} does not match its zip CRC-32: the file is corrupted")
    return sum(1 for n in names if "/data/" in n)


def verify_state_file(path: str) -> int:
    """Check every checksum of weights file ``path`` (ours, as written); returns how many
    tensors were checked. Raises ``ChecksumError`` naming the first that differs."""
    if file_format(path) == "pt":
        return _check_zip(path)
    src = _safetensors_source(path)
    if src.checksums is None:
        return 0
    for name, (shape, dtype) in src.shapes.items():
        numel, step = math.prod(shape), 64 * CRC_BLOCK // dtype.itemsize
        for lo in range(0, numel, step):
            src.read(name, lo, min(numel, lo + step))
    return len(src.shapes)

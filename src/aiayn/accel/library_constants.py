"""An AOTInductor library's constants (its frozen weights) read in place from its file.

AOTInductor appends a library's constants to its shared object, and its loader copies them
into memory of its own (``AOTInductorModelBase::load_constants``): memory that stays in the
process for as long as the library is loaded. :func:`write_index` records, when the library
is built, where each constant lies in the file, through the library's own C interface
(``AOTInductorModelContainerGetConstant*``), and checks every one byte for byte against the
copy its loader made. :func:`map_constants` then hands a loaded runner the constants as views
of a mapping of the file (``update_constant_buffer`` with user-managed tensors; a weight that
freezing packed for oneDNN, whose blocks strides do not describe, as a oneDNN tensor over the
same bytes, made as the loader makes it) and frees the copy, once the index is found to fit
the runner: the same constants and dtypes, each view within its bytes, and equal to the
loader's copy wherever the runner names a constant uniquely (AOTInductor's
``extract_constants_map`` gives them by original name, which a few derived constants
share). The constants are then pages of a file: read when a decoder step needs them, handed
back by :func:`aiayn.accel.memory.release_file_pages`, and shared by every
process that maps them. Where anything does not add up, the loader's copy stays (figures:
docs/performance.md).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import json
import mmap
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.accel.memory import file_mappings, page_out, release_file_pages

INDEX_VERSION = 1
# c10::ScalarType codes, as the library's C interface gives a constant's dtype.
_DTYPES = {
    0: torch.uint8,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    11: torch.bool,
    15: torch.bfloat16,
}


def _name(dtype: torch.dtype) -> str:
    """A dtype as the index spells it: ``float32``."""
    return str(dtype).removeprefix("torch.")


_BY_NAME = {_name(dtype): dtype for dtype in _DTYPES.values()}
# A constant the loader copies starts on this boundary; a mapped one must too.
_ALIGN = 64


def index_path(library: Path) -> Path:
    """Where the index of ``library``'s constants is kept: beside it (not ``<stem>.json``,
    which AOTInductor's runner reads as its extern kernels' description)."""
    return library.with_name(library.stem + ".constants.json")


class _Entry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]


class _Library:
    """A container of the library made through its C interface, for what it tells of its
    constants (its loader copies them: made once, when the library is built)."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.handle = ctypes.c_void_p()
        create = self.lib.AOTInductorModelContainerCreateWithDevice
        self.check(create(ctypes.byref(self.handle), ctypes.c_size_t(1), b"cpu", None))

    def check(self, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"AOTInductor's C interface returned {code}")

    def close(self) -> None:
        self.check(self.lib.AOTInductorModelContainerDelete(self.handle))

    def get(self, function: str, kind: Any, *args: Any) -> Any:
        out = kind()
        self.check(getattr(self.lib, function)(*args, ctypes.byref(out)))
        return out

    def of_constant(self, what: str, index: int, kind: Any) -> Any:
        function = f"AOTInductorModelContainerGetConstant{what}"
        return self.get(function, kind, self.handle, ctypes.c_size_t(index)).value

    def of_tensor(self, what: str, handle: int, kind: Any) -> Any:
        return self.get(f"aoti_torch_get_{what}", kind, ctypes.c_void_p(handle))


def _constants(library: _Library, path: Path) -> dict[str, Any] | None:
    """The index of the library's constants, each checked against the loader's copy."""
    count = library.get(
        "AOTInductorModelContainerGetNumConstants", ctypes.c_size_t, library.handle
    ).value
    entries = ctypes.POINTER(_Entry)()
    found = ctypes.c_size_t()
    library.check(
        library.lib.AOTInductorModelContainerExtractConstantsMapEntries(
            library.handle, ctypes.byref(entries), ctypes.byref(found), ctypes.c_bool(False)
        )
    )
    # The loader reads the constants that are not folded at run time one after another, in
    # their order, from the start of the weights appended to the file; its header holds their
    # size and a number that the file's last eight bytes repeat.
    size, magic = (ctypes.c_uint64 * 2).in_dll(library.lib, "_binary_constants_bin_start")
    length = path.stat().st_size
    start = length - size
    if start < 0 or start % mmap.PAGESIZE:
        return None
    constants: list[dict[str, Any]] = []
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as data:
        if int.from_bytes(data[length - 8 :], "little") != magic:
            return None
        offset, entry = 0, 0
        for i in range(count):
            if library.of_constant("FromFolded", i, ctypes.c_bool):
                continue
            if entry >= found.value:
                return None
            handle = entries[entry].handle
            entry += 1
            name = library.of_constant("Name", i, ctypes.c_char_p).decode()
            nbytes = library.of_constant("DataSize", i, ctypes.c_size_t)
            dtype = _DTYPES.get(library.of_tensor("dtype", handle, ctypes.c_int32).value)
            dim = library.of_tensor("dim", handle, ctypes.c_int64).value
            sizes = library.of_tensor("sizes", handle, ctypes.POINTER(ctypes.c_int64))
            strides = library.of_tensor("strides", handle, ctypes.POINTER(ctypes.c_int64))
            storage_offset = library.of_tensor("storage_offset", handle, ctypes.c_int64).value
            pointer = library.of_tensor("data_ptr", handle, ctypes.c_void_p).value or 0
            if dtype is None or (start + offset) % _ALIGN:
                return None
            copied = pointer - storage_offset * dtype.itemsize
            if nbytes and data[start + offset : start + offset + nbytes] != ctypes.string_at(
                copied, nbytes
            ):
                return None
            constants.append(
                {
                    "name": name,
                    "offset": offset,
                    "nbytes": nbytes,
                    "dtype": _name(dtype),
                    "sizes": [sizes[d] for d in range(dim)],
                    "strides": [strides[d] for d in range(dim)],
                    "storage_offset": storage_offset,
                }
            )
            offset += nbytes
        if start + offset != length - 8 or entry != found.value:
            return None
    return {"version": INDEX_VERSION, "length": length, "start": start, "constants": constants}


def write_index(path: Path, index: Path) -> bool:
    """Write the index of the library ``path``'s constants to ``index`` (a file of its own,
    then renamed); False, and nothing written, where they cannot all be told."""
    try:
        library = _Library(path)
    except (OSError, RuntimeError, AttributeError):
        return False
    try:
        found = _constants(library, path)
    except (OSError, RuntimeError, AttributeError, ValueError):
        found = None
    finally:
        with contextlib.suppress(RuntimeError, AttributeError):
            library.close()
    if found is None:
        return False
    partial = index.with_name(index.name + ".partial")
    try:
        partial.write_text(json.dumps(found))
        os.replace(partial, index)
    except OSError:
        partial.unlink(missing_ok=True)
        return False
    return True


# One private mapping of each library file for the process: the runner keeps its own handle
# of each view it is given (and never lets it go), so a mapping per load would stay for good.
_MAPPINGS: dict[tuple[str, int, int, int], Tensor] = {}


def _mapping(path: Path) -> Tensor:
    info = path.stat()
    key = (str(path), info.st_ino, info.st_size, info.st_mtime_ns)
    whole = _MAPPINGS.get(key)
    if whole is None:
        whole = torch.from_file(str(path), shared=False, size=info.st_size, dtype=torch.uint8)
        _MAPPINGS[key] = whole
    return whole


def _views(path: Path, index: object, runner: Any) -> dict[str, Tensor] | None:
    """The constants as views of a private mapping of the file, or None where the index does
    not fit it or the runner: the same constants (names and dtypes), each within its bytes,
    and those the runner's loader copied under a name of their own equal to the copy (every
    constant the loader made, where none shares another's name)."""
    length = path.stat().st_size
    if (
        not isinstance(index, dict)
        or index.get("version") != INDEX_VERSION
        or index.get("length") != length
    ):
        return None
    dtypes = runner.get_constant_names_to_dtypes()
    constants = index["constants"]
    if sorted(c["name"] for c in constants) != sorted(dtypes):
        return None
    whole = _mapping(path)
    mappings = file_mappings()
    fqns = runner.get_constant_names_to_original_fqns()
    counts = collections.Counter(fqns.values())
    copied = runner.extract_constants_map(False)
    views: dict[str, Tensor] = {}
    for constant in constants:
        dtype = _BY_NAME.get(constant["dtype"])
        first = index["start"] + constant["offset"]
        last = first + constant["nbytes"]
        if dtype is None or _DTYPES.get(dtypes[constant["name"]]) is not dtype:
            return None
        if first % _ALIGN or not 0 <= first <= last <= length:
            return None
        sizes, strides, offset = constant["sizes"], constant["strides"], constant["storage_offset"]
        if offset < 0 or any(n < 0 for n in sizes) or any(s < 0 for s in strides):
            return None
        reach = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
        if constant["nbytes"] % dtype.itemsize or (
            all(sizes) and reach >= constant["nbytes"] // dtype.itemsize
        ):
            return None
        # The loader's copy, by the constant's original name: where the name is this
        # constant's alone, the view must hold the same values in the same shape.
        fqn = fqns.get(constant["name"])
        copy = copied.get(fqn) if fqn is not None and counts[fqn] == 1 else None
        if copy is not None and copy.is_mkldnn:  # a weight packed for oneDNN: its blocks
            view = _packed_view(whole, first, constant, dtypes[constant["name"]], copy)
        else:
            flat = whole[first:last].view(dtype)  # (as_strided's offset counts from the start)
            view = flat.as_strided(sizes, strides, flat.storage_offset() + offset)
            if copy is not None and (
                copy.shape != view.shape
                or copy.stride() != view.stride()
                or not torch.equal(copy, view)
            ):
                view = None
        if view is None:
            return None
        views[constant["name"]] = view
        # Its pages, read to compare, go back now: not all of the file's at once beside the
        # loader's copy (docs/performance.md).
        page_out(whole[first:last], mappings, cached=True)
    return views


def _packed_view(
    whole: Tensor, first: int, constant: dict[str, Any], dtype: int, copy: Tensor
) -> Tensor | None:
    """A weight that freezing packed for oneDNN (an ``is_mkldnn`` tensor, its blocks opaque to
    strides) over the file's bytes from ``first``, made as the library's loader makes it
    (``aoti_torch_create_tensor_from_blob_v2`` with the blocks' description, which the
    loader's copy gives); None unless it holds the copy's bytes and values."""
    if torch.ops.mkldnn._nbytes(copy) != constant["nbytes"]:
        return None
    library = _libtorch()
    described = bytes(torch.ops.mkldnn._get_mkldnn_serialized_md(copy).tolist())
    sizes, strides = constant["sizes"], constant["strides"]
    handle = ctypes.c_void_p()
    made = library.aoti_torch_create_tensor_from_blob_v2(
        ctypes.c_void_p(whole.data_ptr() + first),
        ctypes.c_int64(len(sizes)),
        (ctypes.c_int64 * len(sizes))(*sizes),
        (ctypes.c_int64 * len(strides))(*strides),
        ctypes.c_int64(constant["storage_offset"]),
        ctypes.c_int32(dtype),
        ctypes.c_int32(library.aoti_torch_device_type_cpu()),
        ctypes.c_int32(0),
        ctypes.byref(handle),
        ctypes.c_int32(library.aoti_torch_layout__mkldnn()),
        ctypes.c_char_p(described),
        ctypes.c_int64(len(described)),
    )
    if made != 0 or not handle.value:
        return None
    capsule = ctypes.pythonapi.PyCapsule_New
    capsule.restype, capsule.argtypes = (
        ctypes.py_object,
        [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p],
    )
    # The tensor takes the handle over (it describes the mapping's bytes; it never frees them).
    view = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(capsule(handle.value, None, None))
    if not view.is_mkldnn or view.shape != copy.shape:
        return None
    return view if torch.equal(view.to_dense(), copy.to_dense()) else None


def data_pointer(tensor: Tensor) -> int:
    """Where ``tensor``'s data starts, for a oneDNN-packed tensor too (which has no
    ``data_ptr()``): as AOTInductor's C shim gives it to a library's kernels."""
    library = _libtorch()
    capsule = torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(tensor)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    handle = ctypes.c_void_p(get(capsule, None))  # a new tensor object: deleted below
    pointer = ctypes.c_void_p()
    try:
        if library.aoti_torch_get_data_ptr(handle, ctypes.byref(pointer)) != 0:
            raise RuntimeError("AOTInductor's C shim gave no data pointer")
    finally:
        library.aoti_torch_delete_tensor_object(handle)
    return pointer.value or 0


@functools.cache
def _libtorch() -> ctypes.CDLL:
    """PyTorch's library that holds AOTInductor's C shim."""
    return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))


def map_constants(runner: Any, path: Path, index: Path) -> dict[str, Tensor] | None:
    """Have ``runner`` (an ``AOTIModelContainerRunnerCpu`` of the library ``path``) read its
    constants from a mapping of the file, as ``index`` places them, and free its copy; the
    views (the runner holds its own references to them), or None where the copy stays."""
    # The pages the loader read to copy them go back first (to the page cache: they are read
    # again through the views, and are shared with its mapping until then).
    release_file_pages(path, cached=True)
    try:
        views = _views(path, json.loads(index.read_text()), runner)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError):
        return None
    if views is None:
        return None
    try:  # into the buffer not in use, every constant, the tensors' own memory: then swapped
        runner.update_constant_buffer(views, True, True, True)
        runner.swap_constant_buffer()
    except RuntimeError:
        return None
    runner.free_inactive_constant_buffer()
    return views

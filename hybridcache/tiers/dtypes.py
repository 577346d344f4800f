"""Piece <-> raw bytes, for numpy arrays and torch CPU tensors, without copies where possible.

A piece is stored as its little-endian, C-contiguous bytes plus (kind, dtype name, shape).
``kind`` records whether the caller gave a numpy array (``"np"``) or a torch tensor
(``"pt"``) so that a round trip returns the same type. Dtypes numpy lacks (bfloat16, the
float8 formats) exist only as torch tensors; their bytes are reached through a ``uint8`` view,
so no conversion ever rounds a value.

Zero-copy rules (why the API looks like this):

* Encoding a contiguous array or tensor yields a ``memoryview`` of the caller's own memory.
  Tiers that write later (Redis' background writer) therefore *take ownership*: the caller
  must not modify a piece after ``put``.
* Decoding wraps the received buffer (``np.frombuffer`` / ``torch.frombuffer``). When that
  buffer is immutable (the ``bytes`` redis-py returns) the result is read-only: numpy marks
  it so; torch has no read-only tensors, so treat decoded tensors as read-only too (copy them
  into the device, do not write into them). PyTorch warns about this once per process; the
  warning is silenced for this module only, as it is the documented contract here.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch

from hybridcache.tiers.errors import InvalidEntryError

#: A piece: a numpy array or a torch CPU tensor.
Array = np.ndarray | torch.Tensor

KIND_NUMPY = "np"
KIND_TORCH = "pt"

#: dtypes a numpy piece may have (name -> numpy dtype).
NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "float64",
        "float32",
        "float16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
}

#: dtypes a torch piece may have (name -> torch dtype).
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    if hasattr(torch, name)
}

_ITEMSIZE: dict[tuple[str, str], int] = {
    **{(KIND_NUMPY, n): d.itemsize for n, d in NUMPY_DTYPES.items()},
    **{(KIND_TORCH, n): d.itemsize for n, d in TORCH_DTYPES.items()},
}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("hybridcache.tiers stores little-endian bytes and needs a little-endian host")

warnings.filterwarnings(
    "ignore",
    message="The given buffer is not writable",
    category=UserWarning,
    module=__name__.replace(".", r"\."),
)


def itemsize(kind: str, dtype: str) -> int | None:
    """Bytes per element of ``dtype`` for ``kind``; ``None`` if the pair is not supported."""
    return _ITEMSIZE.get((kind, dtype))


def describe(value: object, name: str) -> tuple[str, str, tuple[int, ...], int]:
    """Cheap validation of a piece: ``(kind, dtype name, shape, nbytes)``; no copy.

    Raises:
        InvalidEntryError: unsupported type or dtype, a tensor not on the CPU, or a tensor
            that is not strided (sparse, mkldnn).
    """
    if isinstance(value, np.ndarray):
        dname = value.dtype.name
        if dname not in NUMPY_DTYPES:
            raise InvalidEntryError(f"piece {name!r}: unsupported numpy dtype {value.dtype}")
        return KIND_NUMPY, dname, tuple(int(s) for s in value.shape), int(value.nbytes)
    if isinstance(value, torch.Tensor):
        dname = str(value.dtype).removeprefix("torch.")
        if dname not in TORCH_DTYPES:
            raise InvalidEntryError(f"piece {name!r}: unsupported torch dtype {value.dtype}")
        if value.layout != torch.strided:  # sparse / mkldnn: no plain bytes to store
            raise InvalidEntryError(
                f"piece {name!r}: {value.layout} tensors are not supported; store .to_dense()"
            )
        if value.device.type != "cpu":
            raise InvalidEntryError(
                f"piece {name!r}: tensor on {value.device}; gather it to host memory first"
            )
        nbytes = value.numel() * value.element_size()
        return KIND_TORCH, dname, tuple(int(s) for s in value.shape), int(nbytes)
    raise InvalidEntryError(
        f"piece {name!r}: need a numpy array or torch tensor, got {type(value).__name__}"
    )


def to_bytes(value: Array) -> memoryview:
    """C-contiguous little-endian bytes of a piece, as a flat ``uint8`` memoryview.

    Zero-copy for contiguous native-order input; otherwise one copy is made (and owned by the
    returned view).
    """
    if isinstance(value, np.ndarray):
        arr = value
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        return memoryview(arr.reshape(-1).view(np.uint8))
    flat = value.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def from_bytes(kind: str, dtype: str, shape: tuple[int, ...], buf: memoryview) -> Array:
    """Wrap ``buf`` (exactly ``prod(shape) * itemsize`` bytes) as a piece, zero-copy.

    The result aliases ``buf``; it is read-only when ``buf`` is (see the module notes).
    """
    if kind == KIND_NUMPY:
        return np.frombuffer(buf, dtype=NUMPY_DTYPES[dtype]).reshape(shape)
    tdtype = TORCH_DTYPES[dtype]
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(buf, dtype=tdtype).reshape(shape)

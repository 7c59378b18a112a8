"""The ``[dtype, shape, data]`` tensor codec of vLLM's msgpack wire.

Source of the format: vLLM 0.32.0 ``vllm/v1/serial_utils.py`` (``MsgpackEncoder`` /
``MsgpackDecoder``), as described in ``docs/vllm-wire.md`` §5.11 and pinned by the
golden vectors (``outputs_logprobs_k62_inline_edge``, ``outputs_logprobs_k63_aux``,
``outputs_logprobs_batch_aux``, ``request_prompt_embeds_aux``):

- a numpy array travels as ``[dtype.str, shape, data]`` (``"<i4"``, ``"<f4"``, ``"<i8"``,
  ``"|b1"``...), a torch tensor as ``[torch_name, shape, data]`` (``"int32"``,
  ``"float32"``, ``"bfloat16"``...);
- ``data`` is msgpack ExtType 3 ("raw view") holding the C-contiguous little-endian
  bytes inline when ``nbytes < 256`` (``VLLM_MSGPACK_ZERO_COPY_THRESHOLD``) or the
  array is 0-d, otherwise an int index into the message's frame list. Frame 0 is the
  msgpack body, so the first aux buffer is index 1; indexes run across the whole
  message in encoding (depth-first) order;
- ExtType 1 (pickle) and 2 (cloudpickle) exist only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. We always refuse them, and unknown codes.

No numpy: element access goes through :mod:`struct`, which handles both byte orders
and float16 (``"e"``); bfloat16 is widened to float32 by placing its two bytes in the
high half of each float32.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

import attrs
import msgpack

from zmqdispatch import limits as _limits
from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "EXT_PICKLE",
    "EXT_CLOUDPICKLE",
    "EXT_RAW_VIEW",
    "ZERO_COPY_THRESHOLD",
    "MAX_NDIM",
    "DType",
    "Tensor",
    "dtype_info",
    "as_c_bytes",
    "cast_float32",
    "check_tensor",
    "decode_tensor",
    "encode_tensor",
    "ext_hook",
]

#: msgpack ext code of a pickled object (vLLM ``CUSTOM_TYPE_PICKLE``); always refused.
EXT_PICKLE = 1
#: msgpack ext code of a cloudpickled function (``CUSTOM_TYPE_CLOUDPICKLE``); always refused.
EXT_CLOUDPICKLE = 2
#: msgpack ext code of raw tensor bytes (``CUSTOM_TYPE_RAW_VIEW``).
EXT_RAW_VIEW = 3

#: vLLM's ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD`` default, in bytes: a buffer of at least
#: this size goes to an aux frame, a smaller one is inlined as ExtType 3.
ZERO_COPY_THRESHOLD = 256

#: Largest tensor rank accepted (numpy's own limit is 64).
MAX_NDIM = 64


class DType(NamedTuple):
    """What we know about one element type.

    Attributes:
        name: the torch spelling (``"int32"``, ``"bfloat16"``), our canonical name.
        code: the :mod:`struct` format character (``"i"``, ``"e"``; ``"H"`` for bfloat16
            storage).
        itemsize: bytes per element.
        kind: numpy kind letter: ``"b"`` bool, ``"i"`` signed, ``"u"`` unsigned, ``"f"`` float.
        big_endian: the wire dtype string said ``">"``.
    """

    name: str
    code: str
    itemsize: int
    kind: str
    big_endian: bool = False


# torch name -> (struct code, itemsize, kind). Only the names ``str(torch.dtype)``
# produces (``torch.long`` prints as ``torch.int64``), minus the ``torch.`` prefix.
_TORCH: dict[str, tuple[str, int, str]] = {
    "bool": ("?", 1, "b"),
    "uint8": ("B", 1, "u"),
    "int8": ("b", 1, "i"),
    "int16": ("h", 2, "i"),
    "uint16": ("H", 2, "u"),
    "int32": ("i", 4, "i"),
    "uint32": ("I", 4, "u"),
    "int64": ("q", 8, "i"),
    "uint64": ("Q", 8, "u"),
    "float16": ("e", 2, "f"),
    "bfloat16": ("H", 2, "f"),
    "float32": ("f", 4, "f"),
    "float64": ("d", 8, "f"),
}
# numpy "<kind><itemsize>" -> torch name (numpy has no bfloat16).
_NUMPY: dict[str, str] = {
    "b1": "bool",
    "u1": "uint8",
    "i1": "int8",
    "i2": "int16",
    "u2": "uint16",
    "i4": "int32",
    "u4": "uint32",
    "i8": "int64",
    "u8": "uint64",
    "f2": "float16",
    "f4": "float32",
    "f8": "float64",
}
_TORCH_TO_NUMPY = {v: k for k, v in _NUMPY.items()}

# Every valid wire spelling, resolved once; lookups on the decode path are a dict hit.
_DTYPES: dict[str, DType] = {}
for _name, (_code, _size, _kind) in _TORCH.items():
    _DTYPES[_name] = DType(_name, _code, _size, _kind)
for _short, _name in _NUMPY.items():
    _code, _size, _kind = _TORCH[_name]
    # "<", "=" and "|" are all read as little-endian: "=" is the *sender's* native
    # order, and every engine host vLLM supports is little-endian. numpy writes "|"
    # for 1-byte types. ">" is honoured by byte-swapping in tolist().
    for _prefix in ("", "<", "=", "|"):
        _DTYPES[_prefix + _short] = DType(_name, _code, _size, _kind)
    _DTYPES[">" + _short] = DType(_name, _code, _size, _kind, big_endian=_size > 1)
del _name, _code, _size, _kind, _short, _prefix


# struct format character (native size, as memoryview reports it) -> torch name
_FORMATS: dict[tuple[str, int], str] = {
    ("?", 1): "bool", ("b", 1): "int8", ("B", 1): "uint8", ("h", 2): "int16", ("H", 2): "uint16",
    ("i", 4): "int32", ("I", 4): "uint32", ("l", 4): "int32", ("L", 4): "uint32", ("l", 8): "int64",
    ("L", 8): "uint64", ("q", 8): "int64", ("Q", 8): "uint64", ("e", 2): "float16", ("f", 4): "float32",
    ("d", 8): "float64",
}


def dtype_info(dtype: str) -> DType | None:
    """Resolve a wire dtype string (numpy ``dtype.str`` or torch name); ``None`` if unknown."""
    return _DTYPES.get(dtype) if type(dtype) is str else None


def _nbytes(buf: Any) -> int:
    return buf.nbytes if type(buf) is memoryview else len(buf)


def _shape(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(dims)


@attrs.frozen
class Tensor:
    """A decoded ``[dtype, shape, data]`` triple: raw bytes plus how to read them.

    Attributes:
        dtype: the dtype string exactly as on the wire (numpy ``"<f4"`` for ndarrays,
            torch ``"float32"`` for tensors); kept verbatim so re-encoding is byte-exact.
        shape: dimension sizes (``()`` for a 0-d scalar).
        data: ``nbytes`` raw bytes, little-endian unless ``dtype`` starts with
            ``">"``. Decoded: inline data is ``bytes``, aux data the frame object
            itself (no copy). To send: any buffer (a numpy array or a view of one,
            a ``memoryview``...) whose elements in C order are the tensor's; a
            non-contiguous view is copied into C order when the request is
            encoded, a contiguous one is sent without a copy (keep it unchanged
            until then). A torch tensor: ``Tensor.from_array(t)``.

    The decoder guarantees ``len(data) == prod(shape) * itemsize``; a hand-built Tensor
    is checked when it is encoded.
    """

    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    data: bytes | bytearray | memoryview

    @property
    def info(self) -> DType:
        """The resolved element type; ``ValueError`` for an unknown dtype string."""
        info = dtype_info(self.dtype)
        if info is None:
            raise ValueError(f"unknown tensor dtype {self.dtype!r}")
        return info

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Size of ``data`` in bytes."""
        return _nbytes(self.data)

    @property
    def is_torch(self) -> bool:
        """True when the dtype is spelled the torch way (a tensor, not an ndarray)."""
        return self.dtype in _TORCH

    def tolist(self) -> Any:
        """The values as nested Python lists (a bare scalar for a 0-d tensor).

        ints for integer dtypes, floats for float16/bfloat16/float32/float64, bools for
        bool. Cost: one :func:`struct.unpack` over the buffer plus list slicing per row.
        """
        info = self.info
        n = self.numel
        buf = self.data
        if info.name == "bfloat16":
            # bfloat16 is the high half of a float32: widen each 2-byte value into the
            # top two bytes of a zeroed 4-byte slot, then read float32 in the same order.
            raw = bytes(buf)
            wide = bytearray(4 * n)
            if info.big_endian:
                wide[0::4] = raw[0::2]
                wide[1::4] = raw[1::2]
            else:
                wide[2::4] = raw[0::2]
                wide[3::4] = raw[1::2]
            code, buf = "f", wide
        else:
            code = info.code
        flat = struct.unpack_from(f"{'>' if info.big_endian else '<'}{n}{code}", buf)
        return _reshape(flat, self.shape)

    @classmethod
    def from_array(cls, array: Any, *, dtype: str | None = None, torch: bool = True) -> Tensor:
        """A tensor over *array*'s memory, in any layout (sent in C order).

        Args:
            array: a CPU ``torch.Tensor`` (made contiguous: a copy only for a
                non-contiguous view) or anything with the buffer protocol (a numpy
                array or view, a ``memoryview``; kept as is, see ``data``).
            dtype: the element type when the buffer does not say it (a torch
                bfloat16 tensor viewed as int16 / uint16, raw bytes); default: the
                array's own.
            torch: spell the dtype the torch way (what vLLM reads as a
                ``torch.Tensor``, e.g. ``prompt_embeds``) or numpy's.

        Raises:
            LocalProtocolError: no buffer interface, a tensor not on the CPU, or a
                dtype we cannot send.
        """
        if type(array).__module__.startswith("torch") and hasattr(array, "dtype"):
            import torch as _torch  # the caller has torch: it gave us a tensor

            if array.device.type != "cpu":
                raise LocalProtocolError(f"tensor is on {array.device}: move it to the CPU first")
            name = str(array.dtype).removeprefix("torch.")
            shape = tuple(array.shape)
            data: Any = memoryview(array.detach().contiguous().reshape(-1).view(_torch.uint8).numpy())
        else:
            try:
                mv = memoryview(array)
            except TypeError:
                raise LocalProtocolError(f"{type(array).__name__} has no buffer interface") from None
            # typeshed types memoryview.shape as Optional; CPython always gives a tuple (() for 0-d).
            shape = cast("tuple[int, ...]", mv.shape)
            np_dtype = getattr(getattr(array, "dtype", None), "str", None)
            name = (_DTYPES[np_dtype].name if np_dtype in _DTYPES and not _DTYPES[np_dtype].big_endian
                    else _FORMATS.get((mv.format.lstrip("@=<"), mv.itemsize), ""))
            data = array
        info = dtype_info(dtype if dtype is not None else name)
        if info is None or info.big_endian:
            raise LocalProtocolError(f"cannot send a tensor of dtype {dtype or name or 'unknown'!r}")
        if not torch:
            short = _TORCH_TO_NUMPY.get(info.name)
            if short is None:
                raise LocalProtocolError(f"dtype {info.name} has no numpy spelling")
            return cls(("|" if info.itemsize == 1 else "<") + short, shape, data)
        return cls(info.name, shape, data)

    @classmethod
    def from_values(cls, dtype: str, shape: Sequence[int], values: Sequence[Any]) -> Tensor:
        """Build a little-endian tensor from a flat sequence of Python numbers.

        Used by tests and the mock engine. bfloat16 rounds to nearest-even from float32.
        Raises:
            LocalProtocolError: unknown or big-endian dtype, ``len(values)`` not matching
                ``shape``, or a value the dtype cannot hold.
        """
        info = dtype_info(dtype)
        if info is None or info.big_endian:
            raise LocalProtocolError(f"cannot build a tensor of dtype {dtype!r}")
        shape = tuple(shape)
        n = 1
        for d in shape:
            n *= d
        if len(values) != n:
            raise LocalProtocolError(f"{len(values)} values for shape {list(shape)}")
        try:
            if info.name == "bfloat16":
                bits = struct.unpack(f"<{n}I", struct.pack(f"<{n}f", *values))
                halves = [((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF for b in bits]
                data = struct.pack(f"<{n}H", *halves)
            else:
                data = struct.pack(f"<{n}{info.code}", *values)
        except (struct.error, OverflowError, TypeError) as exc:
            raise LocalProtocolError(f"values do not fit dtype {dtype!r}: {exc}") from None
        return cls(dtype, shape, data)


def _reshape(flat: Sequence[Any], shape: tuple[int, ...]) -> Any:
    """Nest a flat row-major sequence into lists of ``shape`` (zeros in shape allowed)."""
    if not shape:
        return flat[0]
    items: list[Any] = list(flat)
    # Group from the innermost axis outwards; axis k holds prod(shape[:k]) groups of
    # shape[k] items, which stays right when some dimension is 0.
    for k in range(len(shape) - 1, 0, -1):
        d = shape[k]
        items = [items[i * d : (i + 1) * d] for i in range(math.prod(shape[:k]))]
    return items


def ext_hook(code: int, data: bytes) -> bytes:
    """``msgpack.unpackb`` ext hook for engine bytes: ExtType 3 -> its raw bytes.

    Raises:
        RemoteProtocolError: ext code 1 or 2 (pickle: a remote-code-execution vector,
            refused regardless of ``VLLM_ALLOW_INSECURE_SERIALIZATION``) or any other code.
    """
    if code == EXT_RAW_VIEW:
        return data
    if code in (EXT_PICKLE, EXT_CLOUDPICKLE):
        raise RemoteProtocolError(f"refusing pickled msgpack ext type {code}")
    raise RemoteProtocolError(f"unknown msgpack ext type {code}")


def decode_tensor(raw: Any, frames: Sequence[Any], *, field: str = "tensor") -> Tensor:
    """Validate one decoded ``[dtype, shape, data]`` value and return a :class:`Tensor`.

    Args:
        raw: the msgpack-decoded triple (tuple or list). ``data`` is the ExtType 3 payload
            (``bytes``, as :func:`ext_hook` returns it; a ``msgpack.ExtType`` is also
            accepted and its code checked) or an int aux index.
        frames: the whole message, ``frames[0]`` being the msgpack body.
        field: dotted field name used in error messages.

    Raises:
        RemoteProtocolError: not a 3-element array, unknown dtype, bad shape (not
            non-negative ints, rank > :data:`MAX_NDIM`, more than
            ``limits.MAX_TENSOR_ELEMENTS`` elements), aux index outside ``1..len(frames)-1``,
            or a byte count that does not equal ``prod(shape) * itemsize``. Nothing is
            allocated before these checks pass.
    """
    if type(raw) not in (tuple, list) or len(raw) != 3:
        raise RemoteProtocolError(f"{field}: expected a [dtype, shape, data] array")
    dtype, shape, data = raw
    info = _DTYPES.get(dtype) if type(dtype) is str else None
    if info is None:
        raise RemoteProtocolError(f"{field}: unknown dtype {dtype!r}")
    if type(shape) not in (tuple, list) or len(shape) > MAX_NDIM:
        raise RemoteProtocolError(f"{field}: shape must be an array of at most {MAX_NDIM} ints")
    numel = 1
    max_elements = _limits.MAX_TENSOR_ELEMENTS
    lead = 1  # product of the dims before the first 0: the empty lists tolist() would build
    for d in shape:
        if type(d) is not int or d < 0:
            raise RemoteProtocolError(f"{field}: shape must hold non-negative ints, got {d!r}")
        if numel:
            lead = numel
        numel *= d
        if numel > max_elements:
            raise RemoteProtocolError(f"{field}: shape {list(shape)} exceeds {max_elements} elements")
    if numel == 0 and lead > _limits.MAX_EMPTY_TENSOR_ROWS:
        # A zero-size tensor carries no bytes, but [2**26, 0] would still make
        # tolist() build 2**26 empty lists (found by fuzz/tensors.py).
        raise RemoteProtocolError(
            f"{field}: empty tensor of shape {list(shape)} claims more than "
            f"{_limits.MAX_EMPTY_TENSOR_ROWS} rows"
        )
    if type(data) is int:
        if not 1 <= data < len(frames):
            raise RemoteProtocolError(f"{field}: aux frame index {data} out of range 1..{len(frames) - 1}")
        buf = frames[data]
        if not isinstance(buf, (bytes, bytearray, memoryview)):
            try:
                buf = memoryview(buf)
            except TypeError:
                raise RemoteProtocolError(f"{field}: aux frame {data} is not a buffer") from None
    elif isinstance(data, (bytes, bytearray, memoryview)):
        # bytes from ext_hook (ExtType 3); a plain msgpack bin is read the same way,
        # as vLLM's decoder does for anything that is not an int index.
        buf = data
    elif type(data) is msgpack.ExtType:
        if data.code != EXT_RAW_VIEW:
            ext_hook(data.code, data.data)  # raises with the right message
        buf = data.data
    else:
        raise RemoteProtocolError(f"{field}: data must be ext type 3 or an aux frame index")
    nbytes = _nbytes(buf)
    if nbytes != numel * info.itemsize:
        raise RemoteProtocolError(
            f"{field}: {nbytes} bytes for shape {list(shape)} of {dtype} "
            f"(expected {numel * info.itemsize})"
        )
    return Tensor(dtype, tuple(shape), buf)


def as_c_bytes(data: Any) -> bytes | memoryview:
    """The bytes of a tensor's data in C (row-major) order, ready for a ZMQ frame.

    *data* may be anything with the buffer protocol (``bytes``, ``bytearray``,
    ``memoryview``, a numpy array or a view of one, ``array.array``...), whatever
    its layout:

    - a C-contiguous buffer is kept (zero-copy): ``bytes`` as is, anything else as
      a flat unsigned-byte ``memoryview`` over the caller's memory, which must
      then stay unchanged until the message is sent;
    - anything else (Fortran order, a transposed or strided view) is copied into
      C order, the order of its logical elements (``memoryview.tobytes("C")``),
      as vLLM's encoder does for a non-contiguous array.

    Raises:
        LocalProtocolError: *data* has no buffer interface, or the buffer is
            released or otherwise unreadable.
    """
    if type(data) is bytes:
        return data
    try:
        mv = data if type(data) is memoryview else memoryview(data)
        if mv.c_contiguous:
            if mv.nbytes == 0:
                return b""
            if mv.ndim == 1 and mv.format == "B":
                return mv
            return mv.cast("B")
        return mv.tobytes(order="C")
    except (TypeError, ValueError, BufferError) as exc:
        raise LocalProtocolError(f"tensor data is not a readable buffer ({type(data).__name__}): {exc}") from None


def check_tensor(value: Any, *, torch: bool | None = None) -> Tensor:
    """Check that *value* is a :class:`Tensor` that :func:`encode_tensor` can send
    (sans-IO, no copy): known little-endian dtype, non-negative int shape of rank
    <= :data:`MAX_NDIM`, a readable buffer holding exactly
    ``prod(shape) * itemsize`` bytes, and, when *torch* is given, the torch
    (``True``) or numpy (``False``) dtype spelling.

    Raises:
        LocalProtocolError: the first problem (the message says what and the limit).
    """
    if not isinstance(value, Tensor):
        raise LocalProtocolError(f"expected a Tensor, got {type(value).__name__}")
    info = dtype_info(value.dtype)
    if info is None or info.big_endian:
        raise LocalProtocolError(f"dtype {value.dtype!r} cannot be sent (known little-endian dtypes: "
                                 f"{', '.join(_TORCH)})")
    if torch is True and not value.is_torch:
        raise LocalProtocolError(f"dtype {value.dtype!r} is numpy's spelling; vLLM reads this field as a torch "
                                 f"tensor: use {info.name!r}")
    if torch is False and value.is_torch:
        raise LocalProtocolError(f"dtype {value.dtype!r} is torch's spelling; vLLM reads this field as a numpy array")
    if len(value.shape) > MAX_NDIM:
        raise LocalProtocolError(f"shape has {len(value.shape)} dimensions, more than {MAX_NDIM}")
    numel = 1
    for d in value.shape:
        if type(d) is not int or d < 0:
            raise LocalProtocolError(f"shape must hold non-negative ints, got {d!r}")
        numel *= d
    try:
        nbytes = memoryview(value.data).nbytes
    except (TypeError, ValueError, BufferError) as exc:
        raise LocalProtocolError(f"data is not a readable buffer ({type(value.data).__name__}): {exc}") from None
    if nbytes != numel * info.itemsize:
        raise LocalProtocolError(
            f"data holds {nbytes} bytes; shape {list(value.shape)} of {value.dtype} needs {numel * info.itemsize}"
        )
    return value


def encode_tensor(
    dtype: str,
    shape: Sequence[int],
    data: bytes | bytearray | memoryview,
    aux: list[Any],
    *,
    torch: bool,
    threshold: int = ZERO_COPY_THRESHOLD,
) -> list[Any]:
    """Return the msgpack-ready ``[dtype, shape, data]`` value, vLLM's encoder rule.

    Args:
        dtype: either spelling (``"<i4"`` or ``"int32"``); the wire spelling is chosen by
            ``torch``.
        shape: dimension sizes.
        data: ``prod(shape) * itemsize`` raw little-endian bytes, in any buffer
            layout: sent in C order (:func:`as_c_bytes`; zero-copy when already
            C-contiguous).
        aux: the message's aux buffer list, shared by every tensor of one message;
            appended to when the data goes out of band.
        torch: write the torch name (a torch tensor, e.g. prompt logprobs, prompt_embeds)
            instead of numpy's ``dtype.str`` (an ndarray, e.g. sample logprobs).
        threshold: the zero-copy threshold in bytes (vLLM default 256).

    Returns:
        ``[wire_dtype, [dims...], ExtType(3, bytes)]`` when ``nbytes < threshold`` or the
        tensor is 0-d, else ``[wire_dtype, [dims...], index]`` with ``data`` appended to
        ``aux`` and ``index = len(aux)`` after the append (frame 0 is the body).

    Raises:
        LocalProtocolError: unknown or big-endian dtype, bfloat16 as an ndarray (numpy
            has none), a bad shape, data that is not a readable buffer, or a byte
            count that does not match the shape.
    """
    info = dtype_info(dtype)
    if info is None or info.big_endian:
        raise LocalProtocolError(f"cannot encode tensor dtype {dtype!r}")
    if torch:
        wire_dtype = info.name
    else:
        short = _TORCH_TO_NUMPY.get(info.name)
        if short is None:
            raise LocalProtocolError(f"dtype {info.name} has no numpy spelling")
        wire_dtype = ("|" if info.itemsize == 1 else "<") + short
    dims = list(shape)
    numel = 1
    for d in dims:
        if type(d) is not int or d < 0:
            raise LocalProtocolError(f"tensor shape must hold non-negative ints, got {d!r}")
        numel *= d
    data = as_c_bytes(data)
    nbytes = _nbytes(data)
    if nbytes != numel * info.itemsize:
        raise LocalProtocolError(f"{nbytes} bytes do not match shape {dims} of {wire_dtype}")
    if nbytes < threshold or not dims:
        return [wire_dtype, dims, msgpack.ExtType(EXT_RAW_VIEW, bytes(data))]
    aux.append(data)
    return [wire_dtype, dims, len(aux)]


#: Bytes of float32 converted per step by :func:`cast_float32` (bounds its temporaries).
_CAST_CHUNK = 1 << 18


@functools.lru_cache(maxsize=32)
def _lanes(pattern: bytes, n: int) -> int:
    return int.from_bytes(pattern * n, "little")


def _f32_to_bf16(chunk: memoryview) -> bytes:
    # Round to nearest even on every 32-bit lane at once, with the lanes held in one
    # Python int (C-speed bit operations; no carry crosses a lane), as torch's
    # float32 -> bfloat16 conversion does; every NaN becomes 0x7FC0.
    n = len(chunk) // 4
    x = int.from_bytes(chunk, "little")
    low16, one = _lanes(b"\xff\xff\0\0", n), _lanes(b"\x01\0\0\0", n)
    hi = (x >> 16) & low16
    lo = x & low16
    y = hi + (((lo + _lanes(b"\xff\x7f\0\0", n) + (hi & one)) >> 16) & one)
    # NaN: |x| > 0x7F800000, i.e. bit 31 of (|x| + 0x007FFFFF) set
    nan = (((x & _lanes(b"\xff\xff\xff\x7f", n)) + _lanes(b"\xff\xff\x7f\0", n)) >> 31) & one
    full = nan * 0x1FFFF
    y = ((y | full) ^ full) | (nan * 0x7FC0)
    wide = y.to_bytes(4 * n, "little")
    out = bytearray(2 * n)
    out[0::2] = wide[0::4]
    out[1::2] = wide[1::4]
    return bytes(out)


def _numpy_cast(mv: memoryview, dtype: str) -> bytes | None:
    """:func:`cast_float32` with numpy when it is installed (None otherwise): the
    same bytes, 2x (bfloat16) to 8x (float16) faster."""
    try:
        import numpy as np
    except ImportError:
        return None
    if dtype == "bfloat16":
        # (x + 0x7FFF + lsb) >> 16, in one scratch array; NaNs (which the add
        # could carry into the sign or exponent) are written afterwards
        x = np.frombuffer(mv, dtype="<u4")
        y = x >> 16
        y &= 1
        y += x
        y += 0x7FFF
        y >>= 16
        out = y.astype("<u2")
        nan = np.isnan(np.frombuffer(mv, dtype="<f4"))
        if nan.any():
            out[nan] = 0x7FC0
        return out.tobytes()
    f = np.frombuffer(mv, dtype="<f4")
    with np.errstate(over="ignore"):
        h = f.astype("<f2")
    if np.isinf(h).any() and (np.isinf(h) & np.isfinite(f)).any():
        raise LocalProtocolError("a float32 value is beyond float16's range (65504)")
    return h.tobytes()


def cast_float32(data: bytes | bytearray | memoryview, dtype: str) -> bytes:
    """Little-endian float32 bytes converted to ``float16`` or ``bfloat16`` (torch names),
    rounding to nearest even as ``torch.Tensor.to`` does: the same bytes for every
    non-NaN value (a NaN stays NaN: 0x7FC0 in bfloat16, whose payload torch's
    vectorized CPU cast may write otherwise). A new buffer of half the size: with
    numpy when it is installed, else with Python integers in 256 KiB steps (both
    C-speed; numpy 2x to 8x faster).

    Raises:
        LocalProtocolError: another target dtype, a byte count not a multiple of 4, or
            (float16) a finite value beyond float16's range (65504), which torch would
            turn into an infinity.
    """
    mv = memoryview(data).cast("B")
    if mv.nbytes % 4:
        raise LocalProtocolError(f"{mv.nbytes} bytes are not whole float32 values")
    if dtype not in ("float16", "bfloat16"):
        raise LocalProtocolError(f"cannot cast float32 to {dtype!r} (float16, bfloat16)")
    fast = _numpy_cast(mv, dtype)
    if fast is not None:
        return fast
    parts = []
    for off in range(0, mv.nbytes, _CAST_CHUNK):
        chunk = mv[off:off + _CAST_CHUNK]
        if dtype == "bfloat16":
            parts.append(_f32_to_bf16(chunk))
            continue
        n = chunk.nbytes // 4
        try:
            parts.append(struct.pack(f"<{n}e", *struct.unpack_from(f"<{n}f", chunk)))
        except (OverflowError, struct.error):
            raise LocalProtocolError("a float32 value is beyond float16's range (65504)") from None
    return b"".join(parts)

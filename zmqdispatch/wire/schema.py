"""The schema engine both wire dialects (vLLM, TokenSpeed) are built on (sans-IO).

A wire struct is an attrs class whose fields are declared with :func:`_field`: each
field carries a *kind* (a checker, ``_k_*``), and for map-encoded structs its wire key
and whether it is written even at its default. From that one declaration:

- :func:`_struct_from_map` / :func:`_struct_to_map`: map-encoded structs (vLLM's
  ``SamplingParams`` with ``omit_defaults``, its dataclasses as full maps);
- :func:`_positional` / :func:`_to_positional`: positional (msgspec *array_like*)
  structs, prefix tolerant (TokenSpeed's ADD and ``SamplingParams``);
- :func:`_prep`: the wire form of an opaque value (tensors inside it go to aux frames).

Kinds check one value (decoded, or handed to an encoder) and return it normalised,
or raise :class:`_Bad` with a short reason; each codec turns that into a
``RemoteProtocolError`` naming the field (decoding) or a ``LocalProtocolError``
(encoding). The same kinds run both ways, so whatever encodes also decodes. bool is
never accepted where an int is expected (msgspec refuses it too); an int is accepted
where a float is expected and widened.

``_pack`` / ``_unpack`` wrap msgpack with the settings both engines' msgspec encoders
use. The names are private to :mod:`zmqdispatch.wire`: the codec modules share them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import attrs
import msgpack

from .. import limits as _limits
from ..errors import LocalProtocolError, RemoteProtocolError
from .tensors import Tensor, encode_tensor, ext_hook

Kind = Callable[[Any], Any]
T = TypeVar("T")


class _Bad(Exception):
    """A value failed a field check; the message is completed with the field path."""


def _describe(exc: Exception) -> str:
    """``Type: message``; msgpack's FormatError and StackError often carry no message."""
    detail = str(exc) or {"FormatError": "a reserved or invalid type byte", "StackError": "nested too deep"}.get(
        type(exc).__name__, "no detail"
    )
    return f"{type(exc).__name__}: {detail}"


def _tname(v: Any) -> str:
    return type(v).__name__


# =========================================================================== msgpack


def _pack(obj: Any) -> bytes:
    # use_bin_type: bytes -> bin, str -> str (neither engine sends str as bin);
    # use_single_float=False: every float is float64 ("cb"), as msgspec writes it.
    try:
        out: bytes = msgpack.packb(obj, use_bin_type=True, use_single_float=False, datetime=False)
    except (TypeError, ValueError, OverflowError, BufferError) as exc:
        raise LocalProtocolError(f"value cannot be encoded as msgpack: {exc}") from None
    return out


def _unpack(payload: Any, what: str, *, use_list: bool = True) -> Any:
    """One msgpack document -> Python, every failure as RemoteProtocolError."""
    try:
        if len(payload) > _limits.MAX_FRAME_BYTES:
            raise RemoteProtocolError(f"{what}: frame of {len(payload)} bytes exceeds MAX_FRAME_BYTES")
        return msgpack.unpackb(payload, use_list=use_list, raw=False, strict_map_key=False, ext_hook=ext_hook)
    except RemoteProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError/TypeError/StackError/...: all "undecodable"
        raise RemoteProtocolError(f"{what}: not valid msgpack ({_describe(exc)})") from None


def msgpack_array_header(n: int) -> bytes:
    """The msgpack header of an *n*-element array (fixarray, array 16 or array 32)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def msgpack_array_len(payload: Any) -> int:
    """Elements of the msgpack array *payload* (bytes) starts with, read from its header
    only, or -1 if it does not start with an array header."""
    if not payload:
        return -1
    b: int = payload[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(payload) >= 3:
        return int.from_bytes(payload[1:3], "big")
    if b == 0xDD and len(payload) >= 5:
        return int.from_bytes(payload[1:5], "big")
    return -1


def _pack_omit_defaults_map(m: dict[str, Any]) -> bytes:
    # msgspec writes an omit_defaults Struct as a map with a map16 header ("de" + count)
    # whatever the count, since it only knows the count after writing the fields (it
    # patches the reserved header). Vectors: "de0006" for a 6-key SamplingParams where
    # plain msgpack would write fixmap "86".
    n = len(m)
    head = b"\xde" + n.to_bytes(2, "big") if n < 0x10000 else b"\xdf" + n.to_bytes(4, "big")
    return head + b"".join(_pack(k) + _pack(v) for k, v in m.items())


#: The single-frame death notice a vLLM (and TokenSpeed) engine pushes on its
#: output socket before exiting (vLLM 0.32 ``EngineCoreProc``): 16 raw bytes.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


def is_dead_sentinel(frames: Any) -> bool:
    """True for the ``ENGINE_CORE_DEAD`` message: exactly one frame equal to those 16 bytes.

    Check before decoding outputs; the engine exits (code 1) a few seconds later
    and every in-flight request is lost.
    """
    return len(frames) == 1 and len(frames[0]) == 16 and bytes(frames[0]) == ENGINE_CORE_DEAD


def _unpack_output_message(frames: Any, what: str) -> Any:
    """The shared prologue of the output decoders: frame-size limit, sentinel,
    one ``unpackb`` with arrays as tuples. Raises RemoteProtocolError."""
    if not frames:
        raise RemoteProtocolError(f"{what}: empty message")
    max_frame = _limits.MAX_FRAME_BYTES
    for f in frames:
        if len(f) > max_frame:
            raise RemoteProtocolError(f"{what}: frame of {len(f)} bytes exceeds MAX_FRAME_BYTES")
    if is_dead_sentinel(frames):
        raise RemoteProtocolError(f"{what}: got the ENGINE_CORE_DEAD sentinel")
    try:
        return msgpack.unpackb(frames[0], use_list=False, raw=False, strict_map_key=False, ext_hook=ext_hook)
    except RemoteProtocolError:
        raise
    except Exception as exc:  # any msgpack failure means "not an output message"
        raise RemoteProtocolError(f"{what}: not valid msgpack ({_describe(exc)})") from None


# =========================================================================== field kinds


def _k_any(v: Any) -> Any:
    return v


def _k_int(v: Any) -> int:
    if type(v) is int:
        return v
    if isinstance(v, int) and not isinstance(v, bool):  # an IntEnum
        return int(v)
    raise _Bad(f"expected an int, got {_tname(v)}")


def _k_float(v: Any) -> float:
    t = type(v)
    if t is float:
        return float(v)
    if t is int:
        try:
            return float(v)
        except OverflowError:
            raise _Bad("int too large for a float") from None
    raise _Bad(f"expected a float, got {_tname(v)}")


def _k_bool(v: Any) -> bool:
    if type(v) is bool:
        return v
    raise _Bad(f"expected a bool, got {_tname(v)}")


def _k_str(v: Any) -> str:
    if type(v) is str:
        return v
    raise _Bad(f"expected a str, got {_tname(v)}")


def _k_map(v: Any) -> dict[Any, Any]:
    if type(v) is dict:
        return v
    raise _Bad(f"expected a map, got {_tname(v)}")


def _k_opt(kind: Kind) -> Kind:
    def check(v: Any) -> Any:
        return None if v is None else kind(v)

    return check


def _k_seq(kind: Kind) -> Callable[[Any], tuple[Any, ...]]:
    def check(v: Any) -> tuple[Any, ...]:
        if type(v) not in (list, tuple):
            raise _Bad(f"expected an array, got {_tname(v)}")
        return tuple([kind(x) for x in v])

    return check


def _k_enum(cls: type[enum.IntEnum]) -> Kind:
    def check(v: Any) -> Any:
        try:
            return cls(_k_int(v))
        except ValueError:
            raise _Bad(f"{v!r} is not a valid {cls.__name__}") from None

    return check


_opt_int = _k_opt(_k_int)
_opt_str = _k_opt(_k_str)
_int_seq = _k_seq(_k_int)


# attrs converters: what a caller hands a wire struct's constructor, stored in wire shape.


def _conv_float(v: Any) -> Any:
    # an int given for a float field is stored (and written) as a float.
    return float(v) if type(v) is int else v


def _conv_tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _conv_nested_tuple(v: Any) -> Any:
    return tuple(_conv_tuple(x) for x in v) if isinstance(v, (list, tuple)) else v


# =========================================================================== structs


class FieldSpec(NamedTuple):
    """One declared field of a wire struct, in declaration (= wire) order."""

    name: str
    wire: str  # the map key (vLLM's private fields carry a leading underscore)
    default: Any  # attrs.NOTHING when required
    kind: Kind
    always: bool  # written even at its default (omit_defaults maps only)


def _field(
    default: Any = attrs.NOTHING,
    kind: Kind = _k_any,
    *,
    wire: str | None = None,
    always: bool = False,
    converter: Callable[[Any], Any] | None = None,
) -> Any:
    """attrs field carrying its value kind, and for map structs its wire key and
    "always written" flag."""
    md = {"kind": kind, "wire": wire, "always": always}
    return attrs.field(default=default, metadata=md, converter=converter)


def _spec(cls: type) -> tuple[FieldSpec, ...]:
    """The :class:`FieldSpec` of each field of ``cls``, in declaration order (cached)."""
    cached: tuple[FieldSpec, ...] | None = cls.__dict__.get("_wire_spec_cache")
    if cached is None:
        cached = tuple(
            FieldSpec(f.name, f.metadata.get("wire") or f.name, f.default, f.metadata["kind"],
                      f.metadata.get("always", False))
            for f in attrs.fields(cls)
        )
        type.__setattr__(cls, "_wire_spec_cache", cached)
    return cached


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same type (``0 == 0.0 == False`` are different wire values)."""
    return a is b or (type(a) is type(b) and a == b)


def _to_wire(v: Any) -> Any:
    """Plain msgpack-ready value: wire structs to their map / array (``_to_wire``),
    enums to ints, tuples to lists; anything else as it is (msgpack refuses what it
    cannot carry)."""
    if v is None or type(v) in (int, float, str, bool, bytes):
        return v
    to_map = getattr(v, "_to_wire", None)
    if to_map is not None:
        return to_map()
    if isinstance(v, enum.IntEnum):
        return int(v)
    if isinstance(v, (list, tuple)):
        return [_to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_wire(x) for k, x in v.items()}
    return v


def _prep(v: Any, aux: list[Any]) -> Any:
    """Wire form of an opaque field value (both dialects).

    A :class:`~zmqdispatch.wire.tensors.Tensor` anywhere inside goes through the
    tensor codec (aux frames appended to ``aux``, indexes in depth-first order);
    lists, tuples and map values are walked; anything else becomes :func:`_to_wire`'s
    form, so that whatever ``vllm.check_opaque_value`` accepts (wire structs, enums)
    is what gets sent. Values msgpack cannot carry are left for :func:`_pack` to
    refuse (LocalProtocolError).
    """
    if v is None or type(v) in (int, float, str, bool, bytes):
        return v
    if isinstance(v, Tensor):
        return encode_tensor(v.dtype, v.shape, v.data, aux, torch=v.is_torch)
    if isinstance(v, (list, tuple)):
        return [_prep(x, aux) for x in v]
    if isinstance(v, dict):
        return {k: _prep(x, aux) for k, x in v.items()}
    return _to_wire(v)


def _struct_from_map(cls: type[T], m: Any) -> T:
    """A map-encoded struct: known keys checked, unknown keys ignored, missing keys
    defaulted (a missing key without a default is an error). Raises _Bad."""
    if type(m) is not dict:
        raise _Bad(f"expected a map, got {_tname(m)}")
    kwargs = {}
    for name, wire, default, kind, _always in _spec(cls):
        if wire in m:
            try:
                kwargs[name] = kind(m[wire])
            except _Bad as exc:
                raise _Bad(f"{wire}: {exc}") from None
        elif default is attrs.NOTHING:
            raise _Bad(f"{wire}: missing")
    return cls(**kwargs)


def _struct_to_map(obj: Any, *, omit_defaults: bool) -> dict[str, Any]:
    """The map form of a wire struct, in declaration order. Raises _Bad."""
    out = {}
    for name, wire, default, kind, always in _spec(type(obj)):
        v = getattr(obj, name)
        try:
            v = kind(v)
            if omit_defaults and not always and v == default and type(v) is type(default):
                continue
            out[wire] = _to_wire(v)
        except _Bad as exc:
            raise _Bad(f"{wire}: {exc}") from None
    return out


def _wrap_map_struct(cls: type, what: str) -> Kind:
    """Kind of a nested map-encoded struct: an instance as it is, a map decoded."""

    def check(v: Any) -> Any:
        if isinstance(v, cls):
            return v
        return _struct_from_map(cls, v)

    check.__name__ = f"_k_{what}"
    return check


def _positional(
    cls: type[T], arr: Any, what: str, *, min_len: int = 0, nested: dict[str, Kind] | None = None
) -> T:
    """Decode an array_like struct: prefix tolerant, extra trailing elements ignored.

    ``nested`` maps a field name to a decoder that reports its own path. Raises _Bad.
    """
    if type(arr) not in (tuple, list):
        raise _Bad(f"expected an array, got {_tname(arr)}")
    if len(arr) < min_len:
        raise _Bad(f"expected an array of at least {min_len} elements, got {len(arr)}")
    kwargs = {}
    for f, v in zip(_spec(cls), arr):
        if nested and f.name in nested:
            kwargs[f.name] = nested[f.name](v)
            continue
        try:
            kwargs[f.name] = f.kind(v)
        except _Bad as exc:
            raise _Bad(f"{what}.{f.name}: {exc}") from None
    return cls(**kwargs)


def _to_positional(obj: Any, what: str) -> list[Any]:
    """Every field of an array_like struct, checked, in order. Raises LocalProtocolError."""
    out = []
    for f in _spec(type(obj)):
        try:
            out.append(f.kind(getattr(obj, f.name)))
        except _Bad as exc:
            raise LocalProtocolError(f"{what}.{f.name}: {exc}") from None
    return out

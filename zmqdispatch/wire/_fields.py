"""Shared msgpack helpers of the sans-IO wire codecs (vLLM, TokenSpeed).

Field checkers (``_k_*``) validate one decoded msgpack value and raise
:class:`_Bad` with a short reason; each codec turns that into a
``RemoteProtocolError`` naming the field (decoding) or a
``LocalProtocolError`` (encoding). ``_pack`` / ``_unpack`` wrap msgpack with
the settings both engines' msgspec encoders use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from .. import limits as _limits
from ..errors import LocalProtocolError, RemoteProtocolError
from .tensors import ext_hook


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


def _pack(obj: Any) -> bytes:
    # use_bin_type: bytes -> bin, str -> str (vLLM never sends str as bin);
    # use_single_float=False: every float is float64 ("cb"), as msgspec writes it.
    try:
        return msgpack.packb(obj, use_bin_type=True, use_single_float=False, datetime=False)
    except (TypeError, ValueError, OverflowError, BufferError) as exc:
        raise LocalProtocolError(f"value cannot be encoded as msgpack: {exc}") from None


def _unpack(payload: Any, what: str, *, use_list: bool = True) -> Any:
    """One msgpack document -> Python, every failure as RemoteProtocolError."""
    try:
        if len(payload) > _limits.MAX_FRAME_BYTES:
            raise RemoteProtocolError(f"{what}: frame of {len(payload)} bytes exceeds MAX_FRAME_BYTES")
        return msgpack.unpackb(
            payload, use_list=use_list, raw=False, strict_map_key=False, ext_hook=ext_hook
        )
    except RemoteProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError/TypeError/StackError/...: all "undecodable"
        raise RemoteProtocolError(f"{what}: not valid msgpack ({_describe(exc)})") from None


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
        return v
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


def _k_map(v: Any) -> dict:
    if type(v) is dict:
        return v
    raise _Bad(f"expected a map, got {_tname(v)}")


def _k_opt(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        return None if v is None else kind(v)

    return check


def _k_seq(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(v: Any) -> tuple:
        if type(v) not in (list, tuple):
            raise _Bad(f"expected an array, got {_tname(v)}")
        return tuple([kind(x) for x in v])

    return check


def _conv_float(v: Any) -> Any:
    # attrs converter: an int given for a float field is stored (and written) as a float.
    return float(v) if type(v) is int else v


def _conv_tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _conv_nested_tuple(v: Any) -> Any:
    return tuple(_conv_tuple(x) for x in v) if isinstance(v, (list, tuple)) else v



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

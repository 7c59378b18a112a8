"""Shared helpers of the atheris harnesses in ``fuzz/`` (not part of the package).

- Frame splitting: a fuzz input is one multipart message whose frames are
  separated by :data:`SEP` (``b"|FRAME|"``), so aux-frame indexes (ExtType 3
  tensors that point at ``frames[i]``) get exercised. ``fuzz/frames.dict`` gives
  libFuzzer the separator and msgpack tokens.
- Contract checks: :func:`only_typed` runs a decoder and lets exactly the
  allowed exception types through; anything else propagates and atheris reports
  it as a crash.
- Memory bounds: a decoder may not return more elements than the bytes it was
  given could describe. :func:`count_nodes` walks a decoded value (stopping as
  soon as a bound is exceeded, so a hostile value never costs more than the
  bound) and :func:`assert_bounded` raises :class:`BoundExceeded` (an
  ``AssertionError``) with a readable message.

Structure-aware mode: byte mutations of msgpack rarely stay well-formed, so
every msgpack harness also has a mode where :func:`mutate_message` takes one of
the golden vectors (picked by the input), unpacks it, applies a few structural
mutations chosen by ``atheris.FuzzedDataProvider`` (replace a value with a
boundary value or a copy of another node, delete, repeat, wrap, retype, tweak
an int, resize or repoint an aux frame) and packs it again. libFuzzer still
guides the choices by coverage.

Known, reported package bugs can be tolerated so a long run keeps exploring
past them: ``ZMQD_FUZZ_KNOWN=tensor-zero-dims,aux-reuse`` (see
``fuzz/README.md``). Without it every check is strict.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

SEP = b"|FRAME|"

#: Bug tags the current run tolerates (comma separated in ``ZMQD_FUZZ_KNOWN``).
KNOWN: frozenset[str] = frozenset(t for t in os.environ.get("ZMQD_FUZZ_KNOWN", "").split(",") if t)


def known(tag: str) -> bool:
    """True when the run was told to tolerate the reported bug *tag*."""
    return tag in KNOWN


def split_frames(body: bytes) -> list[bytes]:
    """One fuzz input -> a multipart message (at least one frame)."""
    return body.split(SEP)


def join_frames(frames: Sequence[bytes]) -> bytes:
    """Inverse of :func:`split_frames` (used to write seeds)."""
    return SEP.join(bytes(f) for f in frames)


def total_bytes(frames: Sequence[Any]) -> int:
    return sum(len(f) for f in frames)


class BoundExceeded(AssertionError):
    """A decoded value holds more elements than its input bytes can describe."""


def count_nodes(obj: Any, cap: int) -> int:
    """Number of values in the nested containers of *obj* (itself included).

    Walks tuples, lists, dicts (keys and values), sets and ``__slots__``/attrs
    objects are not entered (callers unpack them). Stops and returns ``cap + 1``
    as soon as the count exceeds *cap*, so the walk is O(cap) whatever *obj* is.
    """
    n = 0
    stack = [obj]
    pop, push = stack.pop, stack.extend
    while stack:
        o = pop()
        n += 1
        if n > cap:
            return n
        t = type(o)
        if t is tuple or t is list or t is set or t is frozenset:
            push(o)
        elif t is dict:
            push(o.keys())
            push(o.values())
    return n


def assert_bounded(what: str, obj: Any, budget: int) -> int:
    """Raise :class:`BoundExceeded` when *obj* has more than *budget* nodes."""
    n = count_nodes(obj, budget)
    if n > budget:
        raise BoundExceeded(f"{what}: more than {budget} decoded values (input allows at most {budget})")
    return n


def only_typed(allowed: type[BaseException] | tuple[type[BaseException], ...], fn: Callable[..., Any],
               *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """Call ``fn(*args, **kwargs)``; ``(True, result)`` or ``(False, exc)`` for an
    allowed exception. Any other exception propagates (atheris: a crash)."""
    try:
        return True, fn(*args, **kwargs)
    except allowed as exc:
        return False, exc


def tolist_nodes(shape: Sequence[int]) -> int:
    """How many values ``Tensor.tolist()`` builds for *shape*: every nested list
    plus every element (computed from the shape, without building anything)."""
    if not shape:
        return 1
    lists, prod = 0, 1
    for d in shape[:-1]:
        lists += prod  # one list per index prefix of this depth
        prod *= d
    lists += prod  # the innermost lists
    return lists + prod * shape[-1]


def tensor_tolist_budget(shape: Sequence[int], nbytes: int, input_len: int) -> int:
    """What ``tolist()`` may build: one value per element plus one list per
    element per dimension (``(ndim + 1) * numel``), plus what the input bytes
    themselves could describe. A zero-size tensor with huge leading dimensions
    (``[2**26, 0]``: no bytes, 64 Mi empty lists) is outside it."""
    numel = 1
    for d in shape:
        numel *= d
    return (len(shape) + 1) * numel + nbytes + input_len + 64


def setup_and_fuzz(test_one_input: Callable[[bytes], None], *, dict_file: str | None = "frames.dict") -> None:
    """``atheris.Setup`` + ``atheris.Fuzz`` with the shared dictionary unless one is given."""
    import atheris

    argv = list(sys.argv)
    if dict_file and not any(a.startswith("-dict=") for a in argv):
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), dict_file)
        if os.path.exists(path):
            argv.append(f"-dict={path}")
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


# --------------------------------------------------------------------------- structure-aware mutation

VECTORS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "wire" / "vectors"

_EXT = msgpack.ExtType
#: Boundary values a mutation may put anywhere (ints at every msgpack width edge
#: and at the limits of ``zmqdispatch.limits``; floats; dtype strings; ext types).
INTERESTING: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 4, 5, 16, 127, 128, 255, 256, 4096, 4097, 65535, 65536, 65537,
    2**26, 2**26 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
    -(2**31), -(2**63), 0.0, -0.0, 0.5, 1.0, 1e-300, 1e308, math.nan, math.inf, -math.inf,
    "", "r", "a", "req-1", "stop", "length", "abort", "<i4", "<f4", "<i8", "|i1", "|u1", "<f2", ">f8", "|b1",
    "int32", "float32", "int64", "bfloat16", "float16", "uint8", "bool", "HELLO", "READY",
    "BatchTokenIDOutSlim", "TokenizedGenerateReqInput", "\x00", "\u00e9",
    b"", b"\x00", b"\x00" * 4, _EXT(3, b""), _EXT(3, b"\x00" * 4), _EXT(3, b"\x00" * 8), _EXT(1, b"\x80\x04N."),
    _EXT(2, b""), _EXT(99, b"x"), [], {}, [0], [1, 0], [0, 1], [2**26, 0], [2**40], ["", []],
]


def load_vectors(*names: str, keep: Callable[[dict], bool] = lambda case: True,
                 with_type_byte: bool = False) -> list[list[bytes]]:
    """Frames of the golden vectors in *names* (``vllm_0.32.0.json``...) that
    *keep* selects and that are msgpack (the raw sentinel is not)."""
    out = []
    for name in names:
        for case in json.loads((VECTORS / name).read_text()):
            if not keep(case) or case["name"].endswith("engine_core_dead"):
                continue
            frames = [bytes.fromhex(h) for h in case["frames_hex"]]
            if with_type_byte:
                frames.insert(0, bytes.fromhex(case.get("type_byte") or "00"))
            out.append(frames)
    return out


def _keep_ext(code: int, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, data)


def _slots(value: Any) -> list[tuple[Any, Any]]:
    """Every (container, index-or-key) of *value*, breadth first, at most 512."""
    out: list[tuple[Any, Any]] = []
    todo = [value]
    while todo and len(out) < 512:
        v = todo.pop(0)
        if type(v) is list:
            for i, x in enumerate(v):
                out.append((v, i))
                todo.append(x)
        elif type(v) is dict:
            for k, x in v.items():
                out.append((v, k))
                todo.append(x)
    return out


def _scalar(fdp: Any) -> Any:
    k = fdp.ConsumeIntInRange(0, 5)
    if k == 0:
        return fdp.ConsumeIntInRange(-(2**63), 2**64 - 1)
    if k == 1:
        return fdp.ConsumeIntInRange(-4, 300)
    if k == 2:
        return fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat()
    if k == 3:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if k == 4:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16))
    return _EXT(fdp.ConsumeIntInRange(0, 127), fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16)))


def mutate_value(fdp: Any, value: Any, steps: int) -> Any:
    """Apply *steps* structural mutations to a msgpack-decoded *value* (in place
    where possible); returns the (possibly replaced) root."""
    root = [value]
    for _ in range(steps):
        slots = _slots(root[0]) or [(root, 0)]
        if fdp.ConsumeProbability() < 0.05:
            slots = [(root, 0)]
        box, key = slots[fdp.ConsumeIntInRange(0, len(slots) - 1)]
        old = box[key]
        action = fdp.ConsumeIntInRange(0, 9)
        if action == 0:
            box[key] = copy.copy(fdp.PickValueInList(INTERESTING))
        elif action == 1:
            box[key] = _scalar(fdp)
        elif action == 2:  # delete
            if type(box) is list and box is not root:
                del box[key]
            elif type(box) is dict:
                del box[key]
        elif action == 3 and type(box) is list and box is not root:  # repeat an element (rows, ids, dims...)
            n = fdp.ConsumeIntInRange(2, 64)
            if count_nodes(root, 20_000) + n * count_nodes(old, 20_000) <= 20_000:
                box[key:key + 1] = [copy.deepcopy(old) for _ in range(n)]
        elif action == 4:  # wrap
            box[key] = [old] if fdp.ConsumeBool() else {fdp.PickValueInList(["a", "type", "code", 0]): old}
        elif action == 5:  # a copy of another node of the message (tensors, rows, maps...)
            src_box, src_key = slots[fdp.ConsumeIntInRange(0, len(slots) - 1)]
            if count_nodes(root, 20_000) + count_nodes(src_box[src_key], 20_000) <= 20_000:
                box[key] = copy.deepcopy(src_box[src_key])
        elif action == 6 and type(old) is int and type(old) is not bool:
            box[key] = fdp.PickValueInList([old + 1, old - 1, old * 2, -old, old + 2**32, old - 2**32, 0])
        elif action == 7 and type(old) is list:  # truncate or extend an array
            if fdp.ConsumeBool():
                del old[fdp.ConsumeIntInRange(0, len(old)):]
            else:
                old.extend(copy.copy(fdp.PickValueInList(INTERESTING)) for _ in range(fdp.ConsumeIntInRange(1, 4)))
        elif action == 8 and type(box) is dict:  # add a key
            box[fdp.PickValueInList(["status", "max_model_len", "block_size", "local", "code", "x", 0, None])] = \
                copy.copy(fdp.PickValueInList(INTERESTING))
        elif action == 9 and type(old) is str:
            box[key] = old[: fdp.ConsumeIntInRange(0, len(old))] + fdp.ConsumeUnicodeNoSurrogates(2)
    return root[0]


def mutate_message(fdp: Any, seeds: Sequence[Sequence[bytes]], *, payload_index: int = 0) -> list[bytes] | None:
    """A golden message (picked by *fdp*) with its msgpack payload (frame
    *payload_index*) mutated structurally and its aux frames resized, dropped,
    duplicated or added. ``None`` if the mutated value cannot be packed."""
    frames = list(seeds[fdp.ConsumeIntInRange(0, len(seeds) - 1)])
    value = msgpack.unpackb(frames[payload_index], ext_hook=_keep_ext, strict_map_key=False, raw=False)
    value = mutate_value(fdp, value, fdp.ConsumeIntInRange(0, 6))
    try:
        frames[payload_index] = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None
    aux_from = payload_index + 1
    for _ in range(fdp.ConsumeIntInRange(0, 2)):
        action = fdp.ConsumeIntInRange(0, 3)
        if action == 0 and len(frames) > aux_from:  # resize an aux frame
            i = fdp.ConsumeIntInRange(aux_from, len(frames) - 1)
            n = fdp.PickValueInList([0, 1, 3, 4, 8, 255, 256, 1024, 4096]) if fdp.ConsumeBool() else \
                fdp.ConsumeIntInRange(0, 4096)
            frames[i] = (frames[i] * (n // max(len(frames[i]), 1) + 1))[:n] if frames[i] else bytes(n)
        elif action == 1 and len(frames) > aux_from:
            del frames[fdp.ConsumeIntInRange(aux_from, len(frames) - 1)]
        elif action == 2:
            frames.append(bytes(fdp.PickValueInList([0, 4, 8, 16, 256, 2048])))
        elif action == 3 and len(frames) > aux_from:
            frames.append(frames[fdp.ConsumeIntInRange(aux_from, len(frames) - 1)])
    return frames

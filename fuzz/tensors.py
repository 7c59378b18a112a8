#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the ``[dtype, shape, data]`` tensor codec.

Targets: ``zmqdispatch.wire.tensors.ext_hook`` and ``decode_tensor`` (ExtType 3
inline data, int aux-frame indexes, plain bin, pickle / unknown ext codes, every
dtype spelling, big-endian, bfloat16, rank up to 64, lying shapes up to 2**64-1),
then ``Tensor.tolist()``; and ``decode_logprobs_lists`` on a triple of tensors.

Input: byte 0 picks the mode; the rest is a multipart message, frames separated
by ``b"|FRAME|"``; frame 0 is the msgpack value, frames 1.. the aux buffers.

- mode 0: frame 0 is one ``[dtype, shape, data]`` value, unpacked with the
  package's ``ext_hook`` (ExtType 3 -> bytes, 1/2/other -> refused);
- mode 1: the same, unpacked with ExtType kept as ``msgpack.ExtType`` (the
  other branch of ``decode_tensor``);
- mode 2: frame 0 is a logprobs value ``[ids, logprobs, ranks, cu]``
  (``decode_logprobs_lists``);
- mode 3: the triple and its aux frames are built field by field with
  ``atheris.FuzzedDataProvider`` (dtype from every spelling plus junk; rank
  0..66; dimensions from boundary values -- 0, 1, 2**26, 2**26+1, 2**32,
  2**40, 2**64-1 -- or any uint64; data inline, as a plain bin, as an aux
  index, or another ext code; data lengths that match the shape or not);
- mode 4: a golden output or request message mutated structurally
  (``_common.mutate_message``); every ``[dtype, shape, data]`` value in it and
  every logprobs value goes through the decoders.

Contract: only ``RemoteProtocolError``; a decoded tensor has exactly
``prod(shape) * itemsize`` bytes and never more bytes than the input; ``tolist()``
builds at most ``(ndim + 1) * numel`` values plus what the input bytes could
describe -- checked from the shape *before* calling it, so a header that claims a
huge array is reported instead of allocated; whatever decodes re-encodes
(``encode_tensor``) to the same bytes, dtype and shape.

    python fuzz/seed_corpus.py tensors fuzz/corpus/tensors
    python fuzz/tensors.py fuzz/corpus/tensors -atheris_runs=1000000 -rss_limit_mb=1024 -timeout=10
"""

from __future__ import annotations

import atheris
import msgpack

with atheris.instrument_imports():
    from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
    from zmqdispatch.wire import tensors
    from zmqdispatch.wire import vllm as wire

import _common as C

MODES = 5
DTYPES = ["<i4", "<f4", "<i8", "|b1", "|i1", "|u1", "<f2", "<f8", ">f8", ">i4", ">f2", "=i4", "i2", "u8",
          "int32", "float32", "int64", "bool", "uint8", "int8", "int16", "uint16", "uint32", "uint64", "float16",
          "bfloat16", "float64", "<c8", "object", "", "<i3", "torch.int32"]
DIMS = [0, 1, 2, 3, 7, 255, 256, 65535, 65536, 2**26 - 1, 2**26, 2**26 + 1, 2**31, 2**32, 2**40, 2**63, 2**64 - 1]
SEEDS = C.load_vectors("vllm_0.32.0.json", keep=lambda c: c["name"].startswith(
    ("outputs_logprobs", "outputs_prompt_logprobs", "request_prompt_embeds")))
RPE = RemoteProtocolError


def _keep_ext(code: int, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, data)


def _unpack(frame: bytes, hook) -> tuple[bool, object]:
    # The harness's own parse of its input: msgpack's failures here are not
    # findings (the decoders under test get parsed values); ext_hook's are
    # checked to be RemoteProtocolError.
    try:
        return True, msgpack.unpackb(frame, use_list=False, raw=False, strict_map_key=False, ext_hook=hook)
    except RPE:
        return False, None
    except Exception:
        return False, None


def check_tensor(t: tensors.Tensor, frames: list[bytes], input_len: int) -> None:
    info = t.info
    assert type(t.shape) is tuple and all(type(d) is int and d >= 0 for d in t.shape)
    assert len(t.shape) <= tensors.MAX_NDIM
    assert t.nbytes == t.numel * info.itemsize, (t.nbytes, t.numel, info)
    assert t.nbytes <= max(C.total_bytes(frames), input_len), "tensor holds more bytes than its message"
    budget = C.tensor_tolist_budget(t.shape, t.nbytes, input_len)
    would_build = C.tolist_nodes(t.shape)
    if would_build > budget:
        if C.known("tensor-zero-dims"):
            return
        raise C.BoundExceeded(
            f"Tensor({t.dtype!r}, shape={list(t.shape)}, {t.nbytes} bytes).tolist() would build "
            f"{would_build} values from a {input_len}-byte input (bound {budget})"
        )
    values = t.tolist()
    assert C.count_nodes(values, would_build) == would_build
    # Re-encoding what decoded gives the same tensor (big-endian and bfloat16 as
    # an ndarray have no encoder: LocalProtocolError is the documented answer).
    aux: list = []
    try:
        raw = tensors.encode_tensor(t.dtype, t.shape, t.data, aux, torch=t.is_torch)
    except LocalProtocolError:
        assert info.big_endian or (not t.is_torch and info.name == "bfloat16")
        return
    if type(raw[2]) is msgpack.ExtType:
        raw = [raw[0], raw[1], raw[2].data]
    again = tensors.decode_tensor(raw, [b"", *aux])
    assert again.shape == t.shape and bytes(again.data) == bytes(t.data)
    assert again.info.name == info.name


def _built(fdp: atheris.FuzzedDataProvider) -> tuple[list, list[bytes]]:
    """One ``[dtype, shape, data]`` triple and its message, field by field."""
    dtype: object = fdp.PickValueInList(DTYPES) if fdp.ConsumeProbability() < 0.9 else \
        fdp.ConsumeUnicodeNoSurrogates(4)
    rank = fdp.ConsumeIntInRange(0, 4) if fdp.ConsumeProbability() < 0.9 else fdp.ConsumeIntInRange(0, 66)
    shape = [fdp.PickValueInList(DIMS) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 2**64 - 1)
             if fdp.ConsumeProbability() < 0.2 else fdp.ConsumeIntInRange(0, 300) for _ in range(rank)]
    info = tensors.dtype_info(dtype) if type(dtype) is str else None
    numel = 1
    for d in shape:
        numel *= d
    want = numel * (info.itemsize if info else 4)
    if want <= 4096 and fdp.ConsumeProbability() < 0.8:
        n = want
    else:
        n = fdp.ConsumeIntInRange(0, 4096)
    buf = fdp.ConsumeBytes(n)
    buf += bytes(n - len(buf))
    frames = [b""]
    how = fdp.ConsumeIntInRange(0, 4)
    if how == 0:
        data: object = msgpack.ExtType(3, buf)
    elif how == 1:
        data = buf  # plain bin
    elif how == 2:
        frames += [bytes(fdp.ConsumeIntInRange(0, 8)) for _ in range(fdp.ConsumeIntInRange(0, 2))]
        frames.append(buf)
        data = len(frames) - 1 + fdp.PickValueInList([0, 0, 0, -1, 1, -len(frames)])
    elif how == 3:
        data = msgpack.ExtType(fdp.ConsumeIntInRange(0, 127), buf)
    else:
        data = fdp.PickValueInList([None, True, 1.5, "x", [], {}, -1, 2**64 - 1])
    value = [dtype, shape, data]
    if fdp.ConsumeProbability() < 0.05:
        value = value[: fdp.ConsumeIntInRange(0, 2)] if fdp.ConsumeBool() else value + [None]
    return value, frames


def _all_tensors(value: object, out: list, depth: int = 0) -> None:
    """Every value shaped like a tensor triple or a logprobs array, anywhere."""
    if depth > 32 or type(value) not in (list, tuple, dict):
        return
    items = list(value.values()) if type(value) is dict else list(value)
    if type(value) is not dict and len(items) == 3 and type(items[0]) is str:
        out.append(("tensor", value))
    if type(value) is not dict and len(items) >= 3 and all(type(x) in (list, tuple) for x in items[:3]):
        out.append(("logprobs", value))
    for x in items:
        _all_tensors(x, out, depth + 1)


def _structured(body: bytes) -> None:
    frames = C.mutate_message(atheris.FuzzedDataProvider(body), SEEDS)
    if frames is None:
        return
    ok, raw = _unpack(frames[0], tensors.ext_hook)
    if not ok:
        return
    found: list = []
    _all_tensors(raw, found)
    for kind, value in found[:64]:
        if kind == "tensor":
            ok, t = C.only_typed(RPE, tensors.decode_tensor, value, frames)
            if ok:
                check_tensor(t, frames, C.total_bytes(frames))
        else:
            ok, lp = C.only_typed(RPE, wire.decode_logprobs_lists, value, frames)
            if ok:
                C.assert_bounded("decode_logprobs_lists", (lp.token_ids, lp.logprobs, lp.ranks),
                                 4 * C.total_bytes(frames) + 64)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % MODES, data[1:]
    if mode == 4:
        _structured(body)
        return
    if mode == 3:
        raw, frames = _built(atheris.FuzzedDataProvider(body))
        try:  # through msgpack and back, as the wire would carry it
            frames[0] = msgpack.packb(raw, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            return
        body = C.join_frames(frames)
        mode = 1 if type(raw) is list and len(raw) == 3 and type(raw[2]) is msgpack.ExtType else 0
    frames = C.split_frames(body)
    hook = _keep_ext if mode == 1 else tensors.ext_hook
    ok, raw = _unpack(frames[0], hook)
    if not ok:
        return
    if mode == 2:
        ok, lp = C.only_typed(RPE, wire.decode_logprobs_lists, raw, frames)
        if ok:
            assert len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks)
            C.assert_bounded("decode_logprobs_lists", (lp.token_ids, lp.logprobs, lp.ranks),
                             4 * C.total_bytes(frames) + 64)
        return
    ok, t = C.only_typed(RPE, tensors.decode_tensor, raw, frames)
    if ok:
        check_tensor(t, frames, len(body))


if __name__ == "__main__":
    C.setup_and_fuzz(test_one_input)

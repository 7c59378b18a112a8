"""Our tensor encoding against vLLM's own (``MsgpackEncoder`` in the vllm venv),
for torch views of every layout: vLLM makes a tensor contiguous before it sends
it, and so do we, so the frames must be byte-equal.

Needs the vllm venv only (no engine is started)."""

from __future__ import annotations

import json
import subprocess

import msgpack
import numpy as np
import pytest

from zmqdispatch.wire.tensors import Tensor, encode_tensor

pytestmark = pytest.mark.real_engine

# name, torch dtype, numpy dtype holding the same bytes, shape, view
CASES = [
    (dtype, shape, view)
    for dtype in ("float16", "bfloat16", "float32", "int32", "int64", "bool")
    for shape, view in (((0, 3), "t"), ((2, 3), "t"), ((40, 7), "t"), ((9, 40), "step"), ((5, 6, 7), "perm"),
                        ((), "none"), ((300,), "rev"))
]

_VLLM = """
import json, sys, torch
from vllm.v1.serial_utils import MsgpackEncoder
enc = MsgpackEncoder()
out = []
for dtype, shape, view in json.load(sys.stdin):
    n = 1
    for d in shape:
        n *= d
    base = (torch.arange(n, dtype=torch.int64) * 7919 % 251).to(getattr(torch, dtype)).reshape(shape)
    t = {"t": lambda x: x.T if x.dim() == 2 else x, "step": lambda x: x[::2], "perm": lambda x: x.permute(2, 0, 1),
         "none": lambda x: x, "rev": lambda x: x.flip(0)}[view](base)
    frames = enc.encode(t)
    out.append([bytes(f).hex() for f in frames])
print(json.dumps(out))
"""

_NP = {"float16": np.float16, "float32": np.float32, "int32": np.int32, "int64": np.int64, "bool": np.bool_}


def _our_view(dtype, shape, view):
    n = int(np.prod(shape)) if shape else 1
    ints = (np.arange(n, dtype=np.int64) * 7919 % 251)
    if dtype == "bfloat16":
        # the same values as torch's int -> bfloat16 cast (integers < 256 are exact in bfloat16)
        base = (ints.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).reshape(shape)
    else:
        base = ints.astype(_NP[dtype]).reshape(shape)
    return {"t": lambda x: x.T, "step": lambda x: x[::2], "perm": lambda x: x.transpose(2, 0, 1),
            "none": lambda x: x, "rev": lambda x: x[::-1]}[view](base)


def test_tensor_frames_equal_vllms(vllm_py):
    p = subprocess.run([vllm_py, "-c", _VLLM], input=json.dumps(CASES), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    expected = json.loads(p.stdout.strip().splitlines()[-1])
    for (dtype, shape, view), frames in zip(CASES, expected):
        v = _our_view(dtype, shape, view)
        aux: list = []
        t = Tensor.from_array(v, dtype=dtype)
        body = msgpack.packb(encode_tensor(t.dtype, t.shape, t.data, aux, torch=True), use_bin_type=True)
        ours = [body.hex(), *(bytes(a).hex() for a in aux)]
        assert ours == frames, (dtype, shape, view)

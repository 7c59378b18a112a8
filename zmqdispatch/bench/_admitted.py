"""What the benchmark engine's step encoders (:class:`.engine.StepEncoder`,
:class:`.batches.BatchStepEncoder`) share: which requests are running."""

from __future__ import annotations

from collections.abc import Mapping


class RunningRequests:
    """Requests waiting for their first row (``_new``: rid -> (prompt_len,
    max_tokens)) and past it (``_started``, keyed by rid), set by the subclass."""

    _new: dict[str, tuple[int, int | None]]

    @property
    def _started(self) -> Mapping[str, object]:
        raise NotImplementedError

    @property
    def running(self) -> int:
        """Requests that will appear in the next step."""
        return len(self._new) + len(self._started)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._new or request_id in self._started

    def add(self, request_id: str, prompt_len: int, max_tokens: int | None) -> None:
        """Admit a request (its first row goes out in the next step).

        Raises:
            ValueError: the id is already running (the real engine dies on
                this), or ``max_tokens`` below 1.
        """
        if request_id in self:
            raise ValueError(f"duplicate request id {request_id!r}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self._new[request_id] = (prompt_len, max_tokens)

"""How long a decoding client waited for the token of a step (what a latency depth policy learns)."""

from __future__ import annotations

import time


class DecodeWaitClock:
    """A step's wait runs to its end from the end of the step before, when the engine had work all
    along (output handling and the server's turn count too), else from its own start."""

    def __init__(self) -> None:
        self._busy_since: float | None = None  # the last step's end, if requests were left unfinished then

    def idle(self) -> None:
        """Nothing ran: the next step's wait starts with that step."""
        self._busy_since = None

    def lap(self, step_start: float, work_left: bool) -> float:
        """The wait of the step that started at `step_start` (time.perf_counter()) and ends now."""
        end = time.perf_counter()
        waited = end - (step_start if self._busy_since is None else self._busy_since)
        self._busy_since = end if work_left else None
        return waited

"""``--profile-steps``'s range of steps, read before torch is imported (``bert_ds.train.cli``
checks it with the other flags at once; ``bert_ds.train.profiling`` profiles it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from bert_ds.base.errors import ConfigError


@dataclass(frozen=True)
class StepRange:
    """``--profile-steps``: the first and last step profiled, both included."""

    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> StepRange:
        """``"11-13"`` or ``"12"``; a ConfigError naming the flag otherwise."""
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
        if match is None:
            raise ConfigError(f"--profile-steps must be STEP or FIRST-LAST (e.g. 11-13), got {text!r}")
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if not 1 <= first <= last:
            raise ConfigError(f"--profile-steps {text}: steps count from 1 and FIRST must not exceed LAST")
        return cls(first, last)

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

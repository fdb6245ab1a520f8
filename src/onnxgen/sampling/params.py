"""Sampling parameters, resolved once per request.

Precedence for each field: the explicit argument, then the package's `search` defaults, then the
built-in defaults. Omitting `temperature` means the package's choice: greedy unless its
`search.do_sample` is true.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnxgen.errors import InvalidRequest
from onnxgen.package.spec import SearchDefaults

GREEDY_BELOW = 1e-5  # temperatures below this are greedy: logits / 1e-40 overflow to inf, and the
# distribution at 1e-5 is the argmax to within float32 anyway


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings. `temperature < GREEDY_BELOW` (0 included) means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise InvalidRequest(
                f"temperature must be in [0, 100], got {self.temperature}", field="temperature"
            )
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}", field="top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequest(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                field="repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {v}", field=name)
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest(f"seed must be an int, got {self.seed!r}", field="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def resolve(
        cls,
        search: SearchDefaults | None = None,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
    ) -> SamplingParams:
        """Combine explicit arguments (None = not given) with the package's search defaults."""
        d = cls()
        s = search or SearchDefaults()
        if temperature is None:
            temperature = s.temperature if s.do_sample else d.temperature
        sampling_from_package = s.do_sample
        return cls(
            temperature=float(temperature),
            top_k=int(top_k if top_k is not None else (s.top_k if sampling_from_package else d.top_k)),
            top_p=float(top_p if top_p is not None else (s.top_p if sampling_from_package else d.top_p)),
            min_p=float(min_p if min_p is not None else d.min_p),
            repetition_penalty=float(
                repetition_penalty if repetition_penalty is not None else s.repetition_penalty
            ),
            presence_penalty=float(presence_penalty if presence_penalty is not None else d.presence_penalty),
            frequency_penalty=float(
                frequency_penalty if frequency_penalty is not None else d.frequency_penalty
            ),
            seed=seed,
        )

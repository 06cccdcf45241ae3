"""Request timeouts that fit slow engines: a no-progress (stall) bound plus an overall bound that
grows with `max_tokens`, instead of one fixed per-request timeout.

A streamed generation that keeps sending tokens is never cut by the stall bound, however long it
runs; a server that stops sending (hung, dead, wedged) is cut after `stall_s` without a token. The
overall bound is a safety net: `stall_s + max_tokens / min_tokens_per_s`, where the floor is the
slowest per-request decode rate still considered progress (a CPU engine with 64 requests in
flight gives each one ~1-2 tok/s). A fixed `overall_s` replaces the derived bound for every request.

Environment (a backend's own variable wins over the generic one; `KIND` is the backend kind in
upper case with `-` as `_`, e.g. `OPENAI`, `VLLM_MANAGED`):

    QUMEM_LLM_TIMEOUT_S / QUMEM_LLM_<KIND>_TIMEOUT_S               fixed overall bound (s); unset = derived
    QUMEM_LLM_STALL_TIMEOUT_S / QUMEM_LLM_<KIND>_STALL_TIMEOUT_S   no-progress bound (s), default 120
    QUMEM_LLM_MIN_TOKENS_PER_S / QUMEM_LLM_<KIND>_MIN_TOKENS_PER_S decode-rate floor, default 0.5
"""

import os
from dataclasses import dataclass

DEFAULT_STALL_S = 120.0
DEFAULT_MIN_TOKENS_PER_S = 0.5


def _env_float(kind: str, name: str) -> float | None:
    specific = f"QUMEM_LLM_{kind.upper().replace('-', '_')}_{name}" if kind else None
    for var in filter(None, (specific, f"QUMEM_LLM_{name}")):
        raw = os.environ.get(var, "").strip()
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r}: expected a number of seconds / tokens per second") from None
            if value <= 0:
                raise ValueError(f"{var}={raw!r}: must be > 0")
            return value
    return None


@dataclass(frozen=True)
class RequestTimeouts:
    stall_s: float = DEFAULT_STALL_S
    min_tokens_per_s: float = DEFAULT_MIN_TOKENS_PER_S
    overall_s: float | None = None  # fixed overall bound; None = derived from max_tokens

    def overall_for(self, max_tokens: int) -> float:
        if self.overall_s is not None:
            return self.overall_s
        return self.stall_s + max(1, int(max_tokens)) / self.min_tokens_per_s

    def stall_for(self, max_tokens: int) -> float:
        """No request waits longer for a token than its overall bound allows."""
        return min(self.stall_s, self.overall_for(max_tokens))

    @classmethod
    def resolve(cls, kind: str = "", overall_s: float | None = None, stall_s: float | None = None,
                min_tokens_per_s: float | None = None) -> "RequestTimeouts":
        """Explicit arguments first, then the backend's variables, then the generic ones, then defaults."""
        overall = overall_s if overall_s else _env_float(kind, "TIMEOUT_S")
        stall = stall_s if stall_s else _env_float(kind, "STALL_TIMEOUT_S")
        floor = min_tokens_per_s if min_tokens_per_s else _env_float(kind, "MIN_TOKENS_PER_S")
        return cls(stall_s=float(stall or DEFAULT_STALL_S), min_tokens_per_s=float(floor or DEFAULT_MIN_TOKENS_PER_S),
                   overall_s=None if overall is None else float(overall))

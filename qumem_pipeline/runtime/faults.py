"""Fault injection for crash and interleaving tests: kill or pause this process at a named point.

    QUMEM_FAULT_KILL_AT=decompose.batch:2   # os._exit(137) at the 2nd pass through that point
    QUMEM_FAULT_PAUSE_AT=turns.synced:1     # stop at the 1st pass until told to go on:
    QUMEM_FAULT_PAUSE_FILE=/tmp/x/pause     #   writes /tmp/x/pause.reached, waits for /tmp/x/pause.go

`fault_point(name)` is called at a few named places where a crash or a concurrent operation
matters (after the archive sync committed, between decomposition batches, between an index file's
write and its rename, after the last step before the warehouse, between warehouse tables, after
classification).
A SIGKILL or a concurrent command from outside cannot hit those places reliably; this can. With
both variables unset (always, outside tests and bench/faults.py) it is two dict lookups and returns.
`os._exit` skips every finally/atexit handler, exactly like a kill -9, so what it leaves on disk
is what a real crash leaves. A pause holds whatever the calling thread holds (no lock of the
store's or the warehouse's at the points listed), so another process can run a command against
the same data root (a forget, tests/test_erasure_interleavings.py) while this one stands still.
"""

import json
import os
import sys
import time
from pathlib import Path

ENV = "QUMEM_FAULT_KILL_AT"
PAUSE_ENV = "QUMEM_FAULT_PAUSE_AT"
PAUSE_FILE_ENV = "QUMEM_FAULT_PAUSE_FILE"
PAUSE_TIMEOUT_ENV = "QUMEM_FAULT_PAUSE_TIMEOUT_S"  # a pause never released fails the step (default 600 s)
KILL_EXIT_CODE = 137  # what a shell reports for SIGKILL
_hits: dict[tuple[str, str], int] = {}

# The points wired into the pipeline (for documentation and the tests that enumerate them).
POINTS = ("turns.synced", "episodes.classify", "decompose.batch", "llm.call_recorded", "index.write",
          "query_states.committed", "warehouse.table")


class PauseNotReleased(RuntimeError):
    """A paused process was not released within QUMEM_FAULT_PAUSE_TIMEOUT_S."""


def _target(env: str) -> tuple[str, int] | None:
    spec = os.environ.get(env, "")
    if not spec:
        return None
    name, _, n = spec.partition(":")
    try:
        return name, int(n or 1)
    except ValueError:
        raise ValueError(f"{env}={spec!r}: expected <point>:<n>, e.g. decompose.batch:2") from None


def _nth_hit(env: str, name: str) -> int | None:
    """The configured hit count when `name` is `env`'s point and this pass is that hit, else None."""
    target = _target(env)
    if target is None or target[0] != name:
        return None
    key = (env, name)
    _hits[key] = _hits.get(key, 0) + 1
    return target[1] if _hits[key] == target[1] else None


def fault_point(name: str) -> None:
    """Exit the process with code 137 when `name` is the kill point and this is its n-th hit; wait
    for the release file when it is the pause point and this is its n-th hit."""
    if ENV not in os.environ and PAUSE_ENV not in os.environ:
        return
    hit = _nth_hit(ENV, name)
    if hit is not None:
        sys.stderr.write(f"[fault] {ENV}: killing process at {name} (hit {hit})\n")
        sys.stderr.flush()
        os._exit(KILL_EXIT_CODE)
    hit = _nth_hit(PAUSE_ENV, name)
    if hit is not None:
        _pause(name, hit)


def _pause(name: str, hit: int) -> None:
    base = os.environ.get(PAUSE_FILE_ENV)
    if not base:
        raise ValueError(f"{PAUSE_ENV} is set without {PAUSE_FILE_ENV} (the file this process signals and waits on)")
    reached, go = Path(base + ".reached"), Path(base + ".go")
    timeout = float(os.environ.get(PAUSE_TIMEOUT_ENV, "600"))
    tmp = reached.with_name(reached.name + f".{os.getpid()}")
    tmp.write_text(json.dumps({"point": name, "hit": hit, "pid": os.getpid()}))
    os.replace(tmp, reached)  # the waiting test sees the whole file or none
    sys.stderr.write(f"[fault] {PAUSE_ENV}: paused at {name} (hit {hit}) until {go} exists\n")
    sys.stderr.flush()
    deadline = time.monotonic() + timeout
    while not go.exists():
        if time.monotonic() > deadline:
            raise PauseNotReleased(f"{PAUSE_ENV}: paused at {name} for {timeout:g}s and never released ({go})")
        time.sleep(0.05)
    sys.stderr.write(f"[fault] {PAUSE_ENV}: released at {name}\n")
    sys.stderr.flush()

"""Fault injection for crash tests: kill this process at a named point, deterministically.

    QUMEM_FAULT_KILL_AT=decompose.batch:2   # os._exit(137) at the 2nd pass through that point

`fault_point(name)` is called at a few named places where a crash matters (between decomposition
batches, between an index file's write and its rename, between warehouse tables, after
classification). A SIGKILL from outside cannot hit those places reliably; this can. With the
variable unset (always, outside tests and bench/faults.py) it is one dict lookup and returns.
`os._exit` skips every finally/atexit handler, exactly like a kill -9, so what it leaves on disk
is what a real crash leaves.
"""

import os
import sys

ENV = "QUMEM_FAULT_KILL_AT"
KILL_EXIT_CODE = 137  # what a shell reports for SIGKILL
_hits: dict[str, int] = {}

# The points wired into the pipeline (for documentation and the tests that enumerate them).
POINTS = ("episodes.classify", "decompose.batch", "index.write", "warehouse.table")


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    name, _, n = spec.partition(":")
    try:
        return name, int(n or 1)
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: expected <point>:<n>, e.g. decompose.batch:2") from None


def fault_point(name: str) -> None:
    """Exit the process with code 137 when `name` is the configured point and this is its n-th hit."""
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == target[1]:
        sys.stderr.write(f"[fault] {ENV}: killing process at {name} (hit {target[1]})\n")
        sys.stderr.flush()
        os._exit(KILL_EXIT_CODE)

"""Are two LoCoMo harness reports the same, timing keys aside? (the check behind "behaviour unchanged")

    python bench/locomo_report_diff.py BEFORE.out AFTER.out [--json]

Each file is the stdout of ``qumem eval locomo ... --json`` (the report is its last line). Keys
``wall_s``, ``seconds_embedding`` and ``seconds`` are dropped at every depth; the rest is compared
as serialised JSON, so key order counts too. Prints one JSON object as the last line; exit 1 if they differ.
"""

import json
import sys

TIMING = {"wall_s", "seconds_embedding", "seconds"}


def strip(o):
    if isinstance(o, dict):
        return {k: strip(v) for k, v in o.items() if k not in TIMING}
    if isinstance(o, list):
        return [strip(v) for v in o]
    return o


def main() -> int:
    a, b = (strip(json.loads(open(p).read().strip().splitlines()[-1])) for p in sys.argv[1:3])
    out = {"identical": json.dumps(a) == json.dumps(b), "differing_top_level_keys": [k for k in a if a.get(k) != b.get(k)]}
    print(json.dumps(out))
    return 0 if out["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

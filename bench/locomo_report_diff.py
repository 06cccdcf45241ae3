"""Are two LoCoMo harness reports the same, timing keys aside? (the check behind "behaviour unchanged")

    python bench/locomo_report_diff.py BEFORE.out AFTER.out [--json]

Each file is the stdout of ``qumem eval locomo ... --json`` (the report is its last line). Keys
``wall_s``, ``seconds_embedding`` and ``seconds`` are dropped at every depth; the rest is compared
as serialised JSON, so key order counts too. ``differing_top_level_keys``: the top-level keys of either
report whose values differ (a key only one report has counts), in the first report's order, then the
second's. Without ``--json`` a line per differing key comes first; the last line is one JSON object
either way. Exit 1 if they differ.
"""

import argparse
import json
import sys

TIMING = {"wall_s", "seconds_embedding", "seconds"}
_MISSING = object()


def strip(o):
    if isinstance(o, dict):
        return {k: strip(v) for k, v in o.items() if k not in TIMING}
    if isinstance(o, list):
        return [strip(v) for v in o]
    return o


def load(path: str):
    return strip(json.loads(open(path).read().strip().splitlines()[-1]))


def compare(a: dict, b: dict) -> dict:
    keys = list(dict.fromkeys([*a, *b]))  # the union, in order of first appearance
    differ = [k for k in keys if a.get(k, _MISSING) != b.get(k, _MISSING)]
    return {"identical": json.dumps(a) == json.dumps(b), "differing_top_level_keys": differ,
            "only_in_before": [k for k in a if k not in b], "only_in_after": [k for k in b if k not in a]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", help="stdout of the first `qumem eval locomo ... --json` run")
    ap.add_argument("after", help="stdout of the second run")
    ap.add_argument("--json", action="store_true", help="only the JSON object (its last line either way)")
    args = ap.parse_args(argv)
    out = compare(load(args.before), load(args.after))
    if not args.json:
        print("identical" if out["identical"] else
              f"differ: top-level keys {out['differing_top_level_keys'] or '(none: key order only)'}")
    print(json.dumps(out))
    return 0 if out["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

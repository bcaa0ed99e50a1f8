#!/usr/bin/env python3
"""Checks the JSON summary of an example run against bounds.

usage: check_summary.py SUMMARY.json KEY:MIN[:MAX] [KEY:MIN[:MAX] ...]
Each KEY must be present with MIN <= value (<= MAX when given).
"""
import json
import sys


def main() -> int:
    path, *conditions = sys.argv[1:]
    with open(path) as f:
        summary = json.load(f)
    ok = True
    for cond in conditions:
        key, *bounds = cond.split(":")
        lo = float(bounds[0])
        hi = float(bounds[1]) if len(bounds) > 1 else float("inf")
        if key not in summary:
            print(f"{path}: missing key {key!r} (have {sorted(summary)})")
            ok = False
            continue
        value = float(summary[key])
        good = lo <= value <= hi
        print(f"{key} = {value} (need {lo} <= value <= {hi}): {'ok' if good else 'FAILED'}")
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

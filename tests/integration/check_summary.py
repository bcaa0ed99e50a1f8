#!/usr/bin/env python3
"""Checks the JSON summary of an example run: required keys present, thresholds met.

usage: check_summary.py SUMMARY.json KEY:MIN [KEY:MIN ...]  (each value must be >= MIN)
"""
import json
import sys


def main() -> int:
    path, *conditions = sys.argv[1:]
    with open(path) as f:
        summary = json.load(f)
    ok = True
    for cond in conditions:
        key, threshold = cond.split(":")
        if key not in summary:
            print(f"{path}: missing key {key!r} (have {sorted(summary)})")
            ok = False
            continue
        value = float(summary[key])
        verdict = "ok" if value >= float(threshold) else "FAILED"
        print(f"{key} = {value} (need >= {threshold}): {verdict}")
        ok &= value >= float(threshold)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

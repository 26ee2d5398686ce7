#!/usr/bin/env python3
"""`plan` against `train` end to end (issue 46), a benchmark run by hand, not by CI.

For each layout of the tiny model (seq 128, 8,192 tokens per step) on `cpu-local`, it asks
`ferrotron plan` for that layout, pastes the overrides `plan` prints into `ferrotron train`
exactly as a user would, and compares the tokens/s `train` measures (the median over its
steps after the first, from summary.json) with the figure `plan` predicted. It prints each
layout's error and the median and worst over them (goals: median within 10%, worst 25%).

    scripts/plan-vs-train.py [--bin target/release/ferrotron] [--steps 30] [--rounds 1]

Run it on a quiet machine after `ferrotron bench --configs ''` (the peak) and, for measured
collectives, `ferrotron bench-comm`.
"""

import argparse
import json
import shlex
import statistics
import subprocess
import tempfile

LAYOUTS = [
    ("dp1", ["--gpus", "1"]),
    ("dp2", ["--gpus", "2", "--dp", "2", "--zero", "0"]),
    ("tp2", ["--gpus", "2", "--tp", "2"]),
    ("pp2", ["--gpus", "2", "--pp", "2"]),
    ("dp2 ZeRO-1", ["--gpus", "2", "--dp", "2", "--zero", "1"]),
]
COMMON = ["--model", "tiny", "--hardware", "cpu-local", "--seq", "128",
          "--global-batch-tokens", "8192", "--top", "1"]


def plan(binary, fixed):
    """The predicted global tokens/s and the printed overrides of the best layout."""
    argv = [binary, "plan", *COMMON, *fixed]
    text = subprocess.run(argv, check=True, capture_output=True, text=True)
    lines = (text.stdout + text.stderr).splitlines()
    overrides = next(l for l in lines if l.startswith("as overrides:"))
    data = json.loads(subprocess.run(argv + ["--json"], check=True, capture_output=True,
                                     text=True).stdout)
    best = data["candidates"][0]
    predicted = best["cost"]["tokens_per_s_per_gpu"] * data["gpus"]
    return predicted, shlex.split(overrides.split(":", 1)[1])


def train(binary, overrides, steps):
    """tokens/s `train` measured with `overrides` pasted in."""
    with tempfile.TemporaryDirectory() as d:
        argv = [binary, "train", "--quiet", *overrides, "--set", f"train.steps={steps}",
                "--set", f"run.dir={d}"]
        subprocess.run(argv, check=True, capture_output=True)
        with open(f"{d}/summary.json") as f:
            return json.load(f)["tokens_per_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/ferrotron")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    errors = []
    for name, fixed in LAYOUTS:
        predicted, overrides = plan(args.bin, fixed)
        measured = statistics.median(
            train(args.bin, overrides, args.steps) for _ in range(args.rounds))
        err = predicted / measured - 1
        errors.append(abs(err))
        threads = next((o for o in overrides if o.startswith("train.threads")), "auto")
        print(f"{name:<11} predicted {predicted:>8.0f} tok/s  measured {measured:>8.0f}"
              f"  error {100 * err:+6.1f}%   ({threads})")
    print(f"median |error| {100 * statistics.median(errors):.1f}% (goal 10%), "
          f"worst {100 * max(errors):.1f}% (goal 25%)")


if __name__ == "__main__":
    main()

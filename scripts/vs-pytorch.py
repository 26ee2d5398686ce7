#!/usr/bin/env python3
"""ferrotron against the PyTorch peer in the same run: the same Llama shapes, fp32, the same
thread count, each side run `--rounds` times alternating (ferrotron, PyTorch, ferrotron, ...),
and each side's best median tokens/s kept.

The peer is `../shared/peers/torch_llama` (not part of this project; its `setup.sh` installs
pinned torch and transformers into a venv, by default ~/.venvs/torch_llama). Example:

    cargo build --release
    python3 scripts/vs-pytorch.py --sizes tiny,small,medium --rounds 2
    python3 scripts/vs-pytorch.py --matmul openblas   # the linear layers on OpenBLAS

Prints one line per run and a Markdown table. Nothing else of yours should run meanwhile: a
second busy core slows either side by far more than the difference measured.
"""
import argparse
import json
import os
import re
import subprocess
import sys

# The peer's flags for ferrotron's bench presets (crates/bench/src/presets.rs): 1,024 tokens per
# step for every size.
PEER_FLAGS = {
    "tiny": "--vocab 256 --hidden 128 --layers 4 --heads 4 --kv-heads 4 --ffn 384 --seq 128 --micro-batch 8",
    "small": "--vocab 8192 --hidden 512 --layers 8 --heads 8 --kv-heads 4 --ffn 1536 --seq 256 --micro-batch 4",
    "medium": "--vocab 32000 --hidden 768 --layers 12 --heads 12 --kv-heads 12 --ffn 2048 --seq 512 --micro-batch 2",
}
STEPS = {"tiny": 20, "small": 10, "medium": 10}


def run(cmd):
    """The command's stdout; its stderr and exit status when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed with status {p.returncode}:\n{p.stderr[-4000:]}")
    return p.stdout


def ferrotron(binary, size, threads, matmul):
    out = run([binary, "bench", "--configs", size, "--threads", str(threads), "--steps", str(STEPS[size]),
               "--matmul", matmul])
    row = re.search(rf"^\| {size} \| {threads} \| [^|]+ \| ([0-9.]+) \|", out, re.M)
    if not row:
        sys.exit(f"no {size} row in ferrotron bench's output:\n{out}")
    return float(row.group(1))


def pytorch(python, peer, size, threads):
    cmd = [python, os.path.join(peer, "train_llama.py"), *PEER_FLAGS[size].split(),
           "--warmup", "3", "--steps", str(STEPS[size]), "--threads", str(threads)]
    out = run(cmd)
    line = next((l for l in out.splitlines() if l.startswith("RESULT_JSON ")), None)
    if line is None:
        sys.exit(f"no RESULT_JSON line in the peer's output:\n{out}")
    res = json.loads(line[len("RESULT_JSON "):])
    return res["median_tok_s"], res.get("foreign_cores", 0.0)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,small,medium")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--matmul", default="gemm", choices=["gemm", "openblas"],
                    help="ferrotron's library for the linear layers (train.matmul)")
    ap.add_argument("--ferrotron", default=os.path.join(here, "..", "target", "release", "ferrotron"))
    ap.add_argument("--peer", default=os.path.join(here, "..", "..", "shared", "peers", "torch_llama"))
    ap.add_argument("--python", default=os.path.expanduser("~/.venvs/torch_llama/bin/python"))
    a = ap.parse_args()
    sizes = a.sizes.split(",")
    for s in sizes:
        if s not in PEER_FLAGS:
            sys.exit(f"--sizes: unknown size `{s}` (use tiny, small, medium)")
    for path, what in [(a.ferrotron, "--ferrotron (run `cargo build --release`)"),
                       (a.python, "--python (the peer's venv: run its setup.sh)"),
                       (os.path.join(a.peer, "train_llama.py"), "--peer")]:
        if not os.path.exists(path):
            sys.exit(f"{what}: {path} does not exist")
    runs = {s: ([], []) for s in sizes}
    for r in range(a.rounds):
        for s in sizes:
            f = ferrotron(a.ferrotron, s, a.threads, a.matmul)
            p, busy = pytorch(a.python, a.peer, s, a.threads)
            runs[s][0].append(f)
            runs[s][1].append(p)
            note = f"  (other processes used {busy:.2f} cores during PyTorch's steps)" if busy > 0.05 else ""
            print(f"round {r + 1} {s}: ferrotron {f:.0f} tok/s, PyTorch {p:.0f} tok/s{note}", flush=True)
    print(f"\n| size | ferrotron tok/s (runs) | PyTorch tok/s (runs) | best / best |\n|---|---|---|---|")
    for s in sizes:
        f, p = runs[s]
        print(f"| {s} | {', '.join(f'{x:.0f}' for x in f)} | {', '.join(f'{x:.0f}' for x in p)} | "
              f"{max(f) / max(p):.2f}× |")


if __name__ == "__main__":
    main()

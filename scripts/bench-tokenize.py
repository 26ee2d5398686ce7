#!/usr/bin/env python3
"""prepare-data's throughput against the `tokenizers` Python package, same files, same
tokenizer, same machine, alternating A B A B. Run by hand (needs `tokenizers`, e.g. the
venv of ../shared/peers/torch_llama/setup.sh):

    python3 scripts/bench-tokenize.py target/release/ferrotron [WORKDIR] [MB]

It writes WORKDIR/corpus/part-*.jsonl (MB megabytes of Zipf-distributed words), trains a
BPE tokenizer of 8000 ids with `ferrotron prepare-data --train-bpe`, then times
  A: ferrotron prepare-data corpus/*.jsonl --tokenizer tok.json (read, tokenize, write);
  B: Python: read the same files, json-parse each line, tokenizer.encode_batch in batches
     of 4096 documents (the batch prepare-data uses), counting tokens (no writing).
Both add the end-of-document token the same way (none here: a trained BPE has no
post-processor). It prints each run and the medians and ratio.
"""
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time

from tokenizers import Tokenizer


def corpus(dir_, megabytes):
    os.makedirs(dir_, exist_ok=True)
    rng = random.Random(0)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(20000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    target = megabytes << 20
    part, written = 0, 0
    while written < target:
        path = os.path.join(dir_, f"part-{part:03d}.jsonl")
        with open(path, "w") as f:
            for _ in range(5000):
                n = rng.randint(20, 400)
                text = " ".join(rng.choices(words, weights, k=n)) + "."
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line)
        part += 1
    return sorted(glob.glob(os.path.join(dir_, "*.jsonl")))


def run_ferrotron(exe, files, tok, out):
    t = time.perf_counter()
    r = subprocess.run([exe, "prepare-data", *files, "-o", out, "--tokenizer", tok, "--quiet"],
                       check=True, capture_output=True, text=True)
    dt = time.perf_counter() - t
    return json.loads(r.stdout)["tokens"], dt


def run_python(files, tok):
    t = time.perf_counter()
    tokenizer = Tokenizer.from_file(tok)
    tokens, batch = 0, []
    for path in files:
        with open(path) as f:
            for line in f:
                batch.append(json.loads(line)["text"])
                if len(batch) == 4096:
                    tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch))
                    batch = []
    if batch:
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch))
    return tokens, time.perf_counter() - t


def main():
    exe = sys.argv[1]
    work = sys.argv[2] if len(sys.argv) > 2 else "/tmp/bench-tokenize"
    mb = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    files = corpus(os.path.join(work, "corpus"), mb)
    tok = os.path.join(work, "tok.json")
    if not os.path.exists(tok):
        subprocess.run([exe, "prepare-data", *files, "-o", os.path.join(work, "bpe.bin"),
                        "--train-bpe", "8000", "--save-tokenizer", tok, "--quiet"],
                       check=True, capture_output=True)
    size = sum(os.path.getsize(f) for f in files)
    a, b = [], []
    for i in range(3):
        out = os.path.join(work, f"out{i}.bin")
        if os.path.exists(out):
            os.remove(out)
            os.remove(out + ".json")
        ta, da = run_ferrotron(exe, files, tok, out)
        tb, db = run_python(files, tok)
        # The same documents give the same tokens, plus one end-of-document per document
        # on the ferrotron side when the tokenizer has one.
        print(f"run {i}: ferrotron {ta} tokens in {da:.2f} s ({ta / da / 1e6:.2f} M tok/s); "
              f"tokenizers {tb} tokens in {db:.2f} s ({tb / db / 1e6:.2f} M tok/s)")
        a.append(ta / da)
        b.append(tb / db)
    ma, mb_ = statistics.median(a), statistics.median(b)
    print(f"{size / 2**20:.0f} MiB in {len(files)} files; median ferrotron {ma / 1e6:.2f} M tok/s, "
          f"tokenizers {mb_ / 1e6:.2f} M tok/s, ratio {ma / mb_:.2f}")


if __name__ == "__main__":
    main()

"""The Python package against the engine's command line: a 20-step run, the planner, the
estimator, evaluation and generation, and a bad configuration raising the CLI's message.

Needs the `ferrotron` binary of the workspace (`cargo build --release`, as CI's test run
leaves it) to compare with: FERROTRON_BIN or ../target/release/ferrotron.
"""

import json
import math
import os
import pathlib
import subprocess

import pytest

import ferrotron

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("FERROTRON_BIN", str(ROOT / "target" / "release" / "ferrotron"))


def cli(*args, check=True, cwd=None):
    out = subprocess.run([BIN, *args], capture_output=True, text=True, cwd=cwd)
    if check:
        assert out.returncode == 0, out.stderr
    return out


SMALL = {"model": {"layers": 2, "seq_len": 32}, "train": {"micro_batch": 2}}


def test_a_20_step_run_yields_every_step_and_its_summary():
    run = ferrotron.train({**SMALL, "train": {"steps": 20, "micro_batch": 2}})
    steps = list(run.metrics())
    assert [s["step"] for s in steps] == list(range(1, 21))
    assert all(math.isfinite(s["loss"]) and s["tokens"] == 2 * 32 for s in steps)
    summary = run.wait()
    assert summary["status"] == "completed" and summary["steps"] == 20
    assert summary["final_loss"] == steps[-1]["loss"]
    assert summary["config"]["train"]["steps"] == 20
    # It learns: the last five steps' loss below the first five's.
    assert sum(s["loss"] for s in steps[-5:]) < sum(s["loss"] for s in steps[:5])


def test_the_same_run_from_python_and_the_command_line_gives_the_same_losses(tmp_path):
    sets = ["model.layers=2", "model.seq_len=32", "train.micro_batch=2", "train.steps=5"]
    run = ferrotron.train(set=sets)
    py = [s["loss"] for s in run.metrics()]
    run.wait()
    args = ["train", "--quiet", "--set", f"run.dir={tmp_path / 'run'}"]
    for s in sets:
        args += ["--set", s]
    cli(*args)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["loss"] for r in rows] == py


def test_a_full_run_writes_its_directory_and_resumes_as_the_command_line(tmp_path):
    sets = ["model.layers=2", "model.seq_len=32", "train.micro_batch=2", "checkpoint.every=2"]
    run = ferrotron.train(set=sets + ["train.steps=4"], run_dir=tmp_path / "py")
    first = [s["loss"] for s in run.metrics()]
    summary = run.wait()
    assert summary["status"] == "completed" and summary["final_loss"] == first[-1]
    assert (tmp_path / "py" / "summary.json").is_file()
    assert (tmp_path / "py" / "checkpoints" / "latest").exists()
    # No configuration given: the checkpoint's, with train.steps raised on top.
    resumed = ferrotron.train(set=["train.steps=6"], run_dir=tmp_path / "py", resume="latest")
    rest = [s["loss"] for s in resumed.metrics()]
    assert resumed.wait()["final_loss"] == rest[-1]
    # The command line's straight 6-step run gives the same losses, bit for bit.
    args = ["train", "--quiet", "--set", f"run.dir={tmp_path / 'cli'}", "--set", "train.steps=6"]
    for s in sets:
        args += ["--set", s]
    cli(*args)
    rows = (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()
    assert first + rest == [json.loads(r)["loss"] for r in rows]


def test_a_bad_configuration_raises_the_command_lines_message():
    with pytest.raises(ferrotron.FerrotronError) as err:
        ferrotron.train({"train": {"lr": -1}})
    out = cli("train", "--quiet", "--set", "train.lr=-1", check=False)
    assert out.returncode != 0
    assert "train.lr" in str(err.value)
    assert f"Error: {err.value}" in out.stderr
    with pytest.raises(ferrotron.FerrotronError, match="unknown field `lrr`"):
        ferrotron.train({"train": {"lrr": 1}})


def test_plan_and_estimate_are_the_command_lines():
    plan = ferrotron.plan(model="llama3-8b", gpus=8, global_batch_tokens=1 << 20)
    out = cli("plan", "--model", "llama3-8b", "--gpus", "8",
              "--global-batch-tokens", str(1 << 20), "--json")
    assert plan == json.loads(out.stdout)
    assert plan["candidates"][0]["verdict"] == {"verdict": "best"}
    est = ferrotron.estimate(preset="llama3-1b", set=["parallel.tp=2"])
    out = cli("estimate", "--preset", "llama3-1b", "--set", "parallel.tp=2", "--json")
    want = json.loads(out.stdout)
    assert est["total"] == want["total"] and est["memory"] == want["memory"]
    with pytest.raises(ferrotron.FerrotronError, match="parallel.tp"):
        ferrotron.estimate(set=["parallel.tp=3"])


def test_eval_and_generate_match_the_command_line(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    cli("prepare-data", "text.txt", "-o", "text.bin", "--quiet", cwd=tmp_path)
    cli("train", "--quiet", "--set", "model.vocab=257", "--set", "model.layers=2",
        "--set", "model.seq_len=32", "--set", "train.steps=10",
        "--set", f"data.path={tmp_path / 'text.bin'}", "--set", f"run.dir={tmp_path / 'run'}",
        "--save-model", str(tmp_path / "model"))
    model, data = str(tmp_path / "model"), str(tmp_path / "text.bin")
    report = ferrotron.eval(model=model, data=data, seq=32)
    want = json.loads(cli("eval", "--model", model, "--data", data, "--seq", "32").stdout)
    assert report["loss"] == want["loss"] and report["tokens"] == want["tokens"]
    text = ferrotron.generate(model=model, prompt="the quick", max_new_tokens=12)
    out = cli("generate", "--model", model, "--prompt", "the quick", "--max-new-tokens", "12")
    assert text == out.stdout.rstrip("\n")
    assert len(text.encode()) <= 12
    with pytest.raises(ferrotron.FerrotronError, match="holds .* tokens, fewer than one window"):
        ferrotron.eval(model=model, data=data, seq=100000)

"""ferrotron from Python: the engine's library calls, with dicts in and out.

    import ferrotron
    run = ferrotron.train({"train": {"steps": 20}})
    for step in run.metrics():          # one dict per step, as the steps finish
        print(step["step"], step["loss"])
    summary = run.wait()                # the run's summary.json, as a dict

    ferrotron.plan(model="llama3-8b", gpus=8, global_batch_tokens=1 << 20)
    ferrotron.estimate({"model": {"layers": 8}}, set=["parallel.tp=2"])
    ferrotron.eval(model="runs/x/model", data="val.bin")
    ferrotron.generate(model="runs/x/model", prompt="Once upon", max_new_tokens=20)

Configurations are the TOML file's sections as nested dicts; `set` takes the command
line's `section.key=value` overrides. Every error is a `ferrotron.FerrotronError` whose
message is the command line's.
"""

import json

from . import _ferrotron
from ._ferrotron import FerrotronError

__all__ = ["FerrotronError", "Run", "train", "plan", "estimate", "eval", "generate"]


class Run:
    """A training run in the background (ranks as threads)."""

    def __init__(self, handle):
        self._handle = handle

    def metrics(self):
        """Yields each step's metrics (a dict) as the step finishes."""
        while True:
            row = self._handle.next_step()
            if row is None:
                return
            yield json.loads(row)

    def wait(self):
        """Waits for the run's end; its summary as a dict (raises the error that stopped it)."""
        return json.loads(self._handle.wait())

    def stop(self):
        """Asks the run to stop after the step in progress."""
        self._handle.stop()


def train(config=None, set=(), run_dir=None, resume=None, init_from=None, save_model=None,
          overwrite=False):
    """Starts training `config` (nested dict of TOML sections; None: the defaults).

    Without `run_dir`, `resume`, `init_from`, `save_model` or `overwrite` the run writes
    nothing to disk.
    With any of them it is `ferrotron train`'s full run: metrics, checkpoints
    (`checkpoint.every`) and summary.json in `run_dir` (or the configuration's `run.dir`),
    `resume` a checkpoint (a step folder, a checkpoint root or "latest"; without `config`,
    the checkpoint's configuration, `set` applied on top), `init_from` a
    Hugging Face model directory, `save_model` the trained model as one; `overwrite`
    replaces a previous run's results there.
    """
    sets = list(set)
    full = (run_dir, resume, init_from, save_model)
    if all(x is None for x in full) and not overwrite:
        return Run(_ferrotron.train(json.dumps(config or {}), sets))
    if run_dir is not None:
        sets.append("run.dir=" + json.dumps(str(run_dir)))
    return Run(_ferrotron.train_full(
        None if config is None else json.dumps(config), sets,
        None if resume is None else str(resume),
        None if init_from is None else str(init_from),
        None if save_model is None else str(save_model),
        overwrite,
    ))


def plan(model, gpus, global_batch_tokens, hardware="h100", seq=4096, top=5):
    """The planner's best layouts of `model` (a preset or a TOML file) on `gpus` devices."""
    return json.loads(
        _ferrotron.plan(model, gpus, hardware, seq, global_batch_tokens, top)
    )


def estimate(config=None, set=(), preset=None):
    """The memory of every rank of a configuration, per category, before running it."""
    return json.loads(_ferrotron.estimate_memory(json.dumps(config or {}), list(set), preset))


def eval(model, data, seq=None, batch=8, document_eos=None):
    """Mean next-token loss of a Hugging Face model directory on a token file or Megatron
    dataset; with `document_eos`, each window attends only within its documents, which end
    at that token (as training with `data.document_mask`)."""
    return json.loads(_ferrotron.evaluate(model, data, seq, batch, document_eos))


def generate(model, prompt, max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0):
    """Continues `prompt` with a model directory; the new text (greedy at temperature 0)."""
    return _ferrotron.generate(model, prompt, max_new_tokens, temperature, top_p, seed)

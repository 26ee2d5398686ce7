//! The `ferrotron._ferrotron` extension module: the engine's library calls, JSON in and out
//! (`ferrotron/__init__.py` turns it into dicts). Every error is a `FerrotronError` carrying
//! the engine's message, the one the command line prints.

use std::path::Path;
use std::sync::Mutex;

use ferrotron_config::{Config, DType};
use ferrotron_plan::{estimate, Job, PlanOptions, PlanRequest};
use ferrotron_tokenize::TextCodec;
use ferrotron_train::eval_dir::{check_finite, evaluate_dir, EvalDir};
use ferrotron_train::generate::{check_settings, GenerateOptions, Generation, Sampling};
use ferrotron_train::hf::{eos_token_id, load_model};
use ferrotron_train::on_device::DeviceModel;
use ferrotron_train::trainer::host_backend;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _ferrotron,
    FerrotronError,
    PyException,
    "An error of ferrotron, with the command line's message."
);

fn err(e: impl std::fmt::Display) -> PyErr {
    FerrotronError::new_err(e.to_string())
}

/// The TOML text of a configuration given as JSON (nested tables).
fn toml_text(json: &str) -> Result<String, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("config: {e}"))?;
    let table = toml::Table::try_from(value)
        .map_err(|e| format!("config: not a table of TOML sections: {e}"))?;
    toml::to_string(&table).map_err(|e| format!("config: {e}"))
}

/// The run behind a [`RunHandle`]: the light library run (nothing on disk) or the engine's
/// full run (a run directory, checkpoints, resume, a saved model).
enum Started {
    Light(ferrotron_train::run::RunHandle),
    Full(ferrotron_engine::TrainHandle),
}

impl Started {
    fn next(&mut self) -> Option<ferrotron_train::StepStats> {
        match self {
            Started::Light(h) => h.next(),
            Started::Full(h) => h.next(),
        }
    }

    fn stop(&self) {
        match self {
            Started::Light(h) => h.stop(),
            Started::Full(h) => h.stop(),
        }
    }

    /// The run's summary as JSON (an interrupted full run's says so).
    fn wait(self) -> Result<String, String> {
        use ferrotron_engine::Outcome;
        let summary = match self {
            Started::Light(h) => h.wait().map_err(|e| e.to_string())?,
            Started::Full(h) => match h.wait().map_err(|e| e.to_string())? {
                Outcome::Finished(Some(s))
                | Outcome::Interrupted {
                    summary: Some(s), ..
                } => *s,
                _ => return Err("the run ended without a summary".into()),
            },
        };
        serde_json::to_string(&summary).map_err(|e| e.to_string())
    }
}

/// A training run in the background.
#[pyclass]
struct RunHandle {
    inner: Mutex<Option<Started>>,
}

#[pymethods]
impl RunHandle {
    /// The next step's metrics as JSON, waiting for it (None once the run is over).
    fn next_step(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let step = py.detach(|| {
            let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            guard.as_mut().and_then(Started::next)
        });
        step.map(|s| serde_json::to_string(&s).map_err(err))
            .transpose()
    }

    /// Waits for the end of the run: its summary as JSON, or the error that stopped it.
    fn wait(&self, py: Python<'_>) -> PyResult<String> {
        let handle = self
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| err("the run was already waited for"))?;
        py.detach(move || handle.wait()).map_err(err)
    }

    /// Asks the run to stop after the step in progress.
    fn stop(&self) {
        if let Some(h) = self
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            h.stop();
        }
    }
}

impl RunHandle {
    fn of(started: Started) -> RunHandle {
        RunHandle {
            inner: Mutex::new(Some(started)),
        }
    }
}

/// Starts training the configuration `config_json` with `overrides` applied (nothing
/// written to disk).
#[pyfunction]
fn train(config_json: &str, overrides: Vec<String>) -> PyResult<RunHandle> {
    let text = toml_text(config_json).map_err(err)?;
    let config = Config::from_toml_with_overrides(&text, &overrides).map_err(err)?;
    let handle = ferrotron_train::Run::new(config).start().map_err(err)?;
    Ok(RunHandle::of(Started::Light(handle)))
}

/// Starts the full run of `ferrotron train` (the engine): `config_json` (None: the
/// defaults, or with `resume` the checkpoint's configuration) with `overrides` (`run.dir`
/// among them), resumed from `resume`, initialised from `init_from`, the model
/// saved to `save_model`, a previous run replaced with `overwrite`. Its lines go to stderr,
/// as the command line's with `--quiet`.
#[pyfunction]
#[pyo3(signature = (config_json, overrides, resume=None, init_from=None, save_model=None, overwrite=false))]
fn train_full(
    py: Python<'_>,
    config_json: Option<&str>,
    overrides: Vec<String>,
    resume: Option<String>,
    init_from: Option<String>,
    save_model: Option<String>,
    overwrite: bool,
) -> PyResult<RunHandle> {
    let options = ferrotron_engine::TrainOptions {
        // No configuration: the defaults, or a resumed checkpoint's own.
        config_toml: config_json.map(toml_text).transpose().map_err(err)?,
        set: overrides,
        resume: resume.map(Into::into),
        init_from: init_from.map(Into::into),
        save_model: save_model.map(Into::into),
        overwrite,
        ..ferrotron_engine::TrainOptions::default()
    };
    let console = std::sync::Arc::new(ferrotron_engine::Stderr);
    // Opening a checkpoint or a model to start from takes a while: without the GIL.
    let handle = py
        .detach(move || ferrotron_engine::start(&options, console))
        .map_err(err)?;
    Ok(RunHandle::of(Started::Full(handle)))
}

/// The planner's ranked layouts as JSON.
#[pyfunction]
fn plan(
    py: Python<'_>,
    model: &str,
    gpus: usize,
    hardware: &str,
    seq: usize,
    global_batch_tokens: usize,
    top: usize,
) -> PyResult<String> {
    py.detach(|| -> Result<String, String> {
        let model = ferrotron_bench::hardware::load_model(model).map_err(|e| e.to_string())?;
        let (hardware, _notes) =
            ferrotron_bench::hardware::load_hardware(hardware).map_err(|e| e.to_string())?;
        let opts = PlanOptions {
            top: top.max(1),
            ..PlanOptions::default()
        };
        let mut req = PlanRequest {
            model,
            gpus,
            hardware,
            seq,
            global_batch_tokens,
        };
        let plan = ferrotron_bench::hardware::plan_measured(&mut req, &opts, || {})
            .map_err(|e| e.to_string())?;
        serde_json::to_string(&plan).map_err(|e| e.to_string())
    })
    .map_err(err)
}

/// Every rank's memory per category as JSON, with the peak rank's total.
#[pyfunction]
#[pyo3(signature = (config_json, overrides, preset=None))]
fn estimate_memory(
    config_json: &str,
    overrides: Vec<String>,
    preset: Option<&str>,
) -> PyResult<String> {
    let text = toml_text(config_json).map_err(err)?;
    let job = Job::from_toml(&text, &overrides, preset).map_err(err)?;
    let est = estimate(&job).map_err(err)?;
    let mut value = serde_json::to_value(&est).map_err(err)?;
    if let Some(obj) = value.as_object_mut() {
        obj.insert("total".into(), est.total().into());
    }
    Ok(value.to_string())
}

/// The evaluation report of a model directory on a token file, as JSON.
#[pyfunction]
#[pyo3(signature = (model, data, seq=None, batch=8, document_eos=None))]
fn evaluate(
    py: Python<'_>,
    model: &str,
    data: &str,
    seq: Option<usize>,
    batch: usize,
    document_eos: Option<u32>,
) -> PyResult<String> {
    py.detach(|| -> Result<String, String> {
        let call = EvalDir {
            model: Path::new(model),
            data: Path::new(data),
            seq,
            batch,
            threads: 0,
            document_eos,
        };
        let backend = host_backend(&Config::default()).map_err(|e| e.to_string())?;
        let outcome = evaluate_dir(call, backend).map_err(|e| e.to_string())?;
        check_finite(&outcome.report, call).map_err(|e| e.to_string())?;
        let mut value = serde_json::to_value(outcome.report).map_err(|e| e.to_string())?;
        value["warnings"] = outcome.warnings.into();
        Ok(value.to_string())
    })
    .map_err(err)
}

/// What to generate, from the Python call's arguments.
struct GenerateCall<'a> {
    model: &'a Path,
    prompt: &'a str,
    options: GenerateOptions,
}

fn generate_text(call: GenerateCall<'_>) -> Result<String, String> {
    check_settings(&call.options.sampling, call.options.max_new_tokens)
        .map_err(|e| e.to_string())?;
    let loaded = load_model(call.model).map_err(|e| e.to_string())?;
    let codec = TextCodec::for_model_dir(call.model).map_err(|e| e.to_string())?;
    let ids = codec.encode(call.prompt).map_err(|e| e.to_string())?;
    if ids.is_empty() {
        return Err("the prompt is empty".into());
    }
    let vocab = loaded.config.vocab;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(format!(
            "prompt token {bad} is outside the model's vocabulary of {vocab}"
        ));
    }
    let backend = host_backend(&Config::default()).map_err(|e| e.to_string())?;
    let model = DeviceModel::new(&loaded.config, &loaded.weights, DType::F32, backend);
    let decoder = model.decoder(ids.len() + call.options.max_new_tokens);
    let mut generation = Generation::new(decoder, &ids, call.options);
    for _ in generation.by_ref() {}
    Ok(codec.decode(&generation.ids()[ids.len()..]))
}

/// Continues `prompt` with the model directory `model`; the new text.
#[pyfunction]
#[pyo3(signature = (model, prompt, max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0))]
fn generate(
    py: Python<'_>,
    model: &str,
    prompt: &str,
    max_new_tokens: usize,
    temperature: f64,
    top_p: f64,
    seed: u64,
) -> PyResult<String> {
    let call = GenerateCall {
        model: Path::new(model),
        prompt,
        options: GenerateOptions {
            max_new_tokens,
            sampling: Sampling {
                temperature,
                top_p,
                seed,
            },
            eos: eos_token_id(Path::new(model)),
            recompute: false,
        },
    };
    py.detach(|| generate_text(call)).map_err(err)
}

#[pymodule]
fn _ferrotron(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FerrotronError", m.py().get_type::<FerrotronError>())?;
    m.add_class::<RunHandle>()?;
    m.add_function(wrap_pyfunction!(train, m)?)?;
    m.add_function(wrap_pyfunction!(train_full, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_memory, m)?)?;
    m.add_function(wrap_pyfunction!(evaluate, m)?)?;
    m.add_function(wrap_pyfunction!(generate, m)?)?;
    Ok(())
}

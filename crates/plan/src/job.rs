//! The job the estimator reads — a model and its layout — built from a run configuration,
//! including the keys the engine does not accept yet.

use std::path::Path;

use ferrotron_config::{apply_override, Config, ConfigError, ParallelConfig};
use serde::{Deserialize, Serialize};

use crate::layout::{Layout, Recompute};
use crate::model::{ModelSpec, Moe};
use crate::{invalid, PlanError};

/// A model and the layout of its training step: what [`crate::estimate`] reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// The model.
    pub model: ModelSpec,
    /// The layout.
    pub layout: Layout,
}

/// Parallel keys the planner reads itself (taken out of the table before the rest is typed
/// as a run configuration, so they work whether or not this build's engine runs them).
const PARALLEL_KEYS: [&str; 9] = [
    "tp",
    "pp",
    "cp",
    "ep",
    "pp_schedule",
    "virtual_stages",
    "pp_layers",
    "sequence_parallel",
    "recompute",
];
/// Model keys the run configuration has no field for yet.
const MODEL_KEYS: [&str; 3] = ["experts", "top_k", "moe_every"];

fn parse_error(e: impl std::fmt::Display) -> PlanError {
    PlanError::Config(ConfigError::Parse(e.to_string()))
}

impl Job {
    /// The job of a run configuration: its model (dense) and its layout, every parallel
    /// setting the configuration carries included.
    pub fn from_config(config: &Config) -> Result<Self, PlanError> {
        Self::from_table(toml::Table::try_from(config).map_err(parse_error)?, None)
    }

    /// Parses a run configuration (TOML) with `section.key=value` overrides. `preset` names a
    /// model whose shape is the base of the `[model]` section (file keys and overrides apply
    /// on top). Besides the run configuration's keys it reads `parallel.{tp, pp, cp, ep,
    /// pp_schedule, virtual_stages, pp_layers, sequence_parallel, recompute}` and
    /// `model.{experts, top_k, moe_every}` itself, whether or not the engine runs them.
    pub fn from_toml(
        text: &str,
        overrides: &[String],
        preset: Option<&str>,
    ) -> Result<Self, PlanError> {
        let mut table: toml::Table = toml::from_str(text).map_err(parse_error)?;
        let preset = preset.map(ModelSpec::preset).transpose()?;
        if let Some(spec) = &preset {
            let mut base = toml::Table::try_from(&spec.config).map_err(parse_error)?;
            if let Some(m) = spec.moe {
                for (k, v) in MODEL_KEYS.iter().zip([m.experts, m.top_k, m.every]) {
                    base.insert(k.to_string(), toml::Value::Integer(v as i64));
                }
            }
            if let Some(toml::Value::Table(file)) = table.remove("model") {
                base.extend(file);
            }
            table.insert("model".into(), toml::Value::Table(base));
        }
        for item in overrides {
            apply_override(&mut table, item)?;
        }
        Self::from_table(table, preset.map(|p| p.name))
    }

    fn from_table(mut table: toml::Table, name: Option<String>) -> Result<Self, PlanError> {
        let par = take_keys(&mut table, "parallel", &PARALLEL_KEYS)?;
        let moe = take_keys(&mut table, "model", &MODEL_KEYS)?;
        // Validated below with the experts it caps (the dense configuration has none).
        let capacity = take_keys(&mut table, "model", &["moe_capacity_factor"])?;
        let config: Config = table.try_into().map_err(parse_error)?;
        config.validate()?;
        let mut job = Job {
            model: ModelSpec::dense(
                name.unwrap_or_else(|| "config".into()),
                config.model.clone(),
            ),
            layout: layout_of(&config),
        };
        let l = &mut job.layout;
        l.tp = uint(&par, "parallel", "tp")?.unwrap_or(1);
        l.pp = uint(&par, "parallel", "pp")?.unwrap_or(1);
        l.cp = uint(&par, "parallel", "cp")?.unwrap_or(1);
        l.ep = uint(&par, "parallel", "ep")?.unwrap_or(1);
        l.virtual_stages = uint(&par, "parallel", "virtual_stages")?.unwrap_or(1);
        if let Some(v) = par.get("pp_layers") {
            let list = v.as_array().ok_or_else(|| {
                invalid("parallel.pp_layers", "expected an array of block counts")
            })?;
            let mut layers = Vec::with_capacity(list.len());
            for x in list {
                let n = x.as_integer().and_then(|i| usize::try_from(i).ok());
                layers.push(n.ok_or_else(|| {
                    invalid("parallel.pp_layers", "expected non-negative integers")
                })?);
            }
            l.pp_layers = Some(layers);
        }
        if let Some(v) = par.get("sequence_parallel") {
            l.sequence_parallel = v
                .as_bool()
                .ok_or_else(|| invalid("parallel.sequence_parallel", "expected true or false"))?;
        }
        if let Some(s) = string(&par, "parallel", "pp_schedule")? {
            l.pp_schedule = s.parse().map_err(|e: ferrotron_schedule::ScheduleError| {
                invalid("parallel.pp_schedule", e.to_string())
            })?;
        }
        if let Some(s) = string(&par, "parallel", "recompute")? {
            l.recompute = match s.as_str() {
                "none" => Recompute::None,
                "selective" => Recompute::Selective,
                "full" => Recompute::Full,
                _ => {
                    return Err(invalid(
                        "parallel.recompute",
                        "expected none, selective or full",
                    ))
                }
            };
        }
        let experts = uint(&moe, "model", "experts")?.unwrap_or(0);
        if experts > 1 {
            job.model.moe = Some(Moe {
                experts,
                top_k: uint(&moe, "model", "top_k")?.unwrap_or(2.min(experts)),
                every: uint(&moe, "model", "moe_every")?.unwrap_or(1),
            });
        }
        if let Some(v) = capacity.get("moe_capacity_factor") {
            let cf = v.as_float().or_else(|| v.as_integer().map(|i| i as f64));
            job.model.config.moe_capacity_factor =
                Some(cf.ok_or_else(|| invalid("model.moe_capacity_factor", "expected a number"))?);
        }
        job.validate()?;
        Ok(job)
    }

    /// Reads a run configuration file (none: the defaults), as [`Job::from_toml`].
    pub fn load(
        path: Option<&Path>,
        overrides: &[String],
        preset: Option<&str>,
    ) -> Result<Self, PlanError> {
        let text = match path {
            Some(p) => std::fs::read_to_string(p).map_err(|source| {
                PlanError::Config(ConfigError::Io {
                    path: p.display().to_string(),
                    source,
                })
            })?,
            None => String::new(),
        };
        Self::from_toml(&text, overrides, preset)
    }

    /// The layout as `section.key=value` overrides of a run configuration (what
    /// `ferrotron train --set` takes).
    pub fn overrides(&self) -> Vec<String> {
        let l = &self.layout;
        let mut out = vec![
            format!("parallel.dp={}", l.dp),
            format!("parallel.tp={}", l.tp),
            format!("parallel.pp={}", l.pp),
            format!("parallel.cp={}", l.cp),
            format!("parallel.ep={}", l.ep),
            format!("parallel.zero={}", l.zero),
            format!("parallel.sequence_parallel={}", l.sequence_parallel),
            format!("parallel.pp_schedule={}", l.pp_schedule.name()),
            format!("parallel.virtual_stages={}", l.virtual_stages),
        ];
        if let Some(list) = &l.pp_layers {
            out.push(format!("parallel.pp_layers={list:?}"));
        }
        if l.cp > 1 && l.cp_kind == ferrotron_config::CpKind::Ulysses {
            out.push("parallel.cp_kind=ulysses".into());
        }
        if l.recompute != Recompute::None {
            out.push(format!("parallel.recompute={:?}", l.recompute).to_lowercase());
        }
        let dtype = l.dtype.name();
        out.extend([
            format!("train.micro_batch={}", l.micro_batch),
            format!("train.grad_accum={}", l.grad_accum),
            format!("train.dtype={dtype}"),
            format!("model.seq_len={}", self.model.config.seq_len),
        ]);
        if l.matmul != ferrotron_config::Matmul::Gemm {
            out.push(format!("train.matmul={}", l.matmul.name()));
        }
        if l.attention == ferrotron_config::Attention::Products {
            out.push("train.attention=products".into());
        }
        if l.threads > 0 {
            out.push(format!("train.threads={}", l.threads));
        }
        out
    }

    /// The engine's run configuration of this job: the model's shape (its mixture of experts
    /// included), the layout, and the default optimiser, data and output settings. Not
    /// validated: [`Job::engine_accepts`] is the engine's verdict.
    pub fn run_config(&self) -> Config {
        let (l, mut config) = (&self.layout, Config::default());
        config.model = self.model.config.clone();
        if let Some(m) = self.model.moe {
            (
                config.model.experts,
                config.model.top_k,
                config.model.moe_every,
            ) = (m.experts, m.top_k, m.every);
        }
        config.parallel = l.parallel.clone();
        let t = &mut config.train;
        (t.micro_batch, t.grad_accum, t.dtype) = (l.micro_batch, l.grad_accum, l.dtype);
        (t.fp32_grad_accum, t.loss_chunk) = (l.fp32_grad_accum, l.loss_chunk);
        (t.matmul, t.threads, t.attention) = (l.matmul, l.threads, l.attention);
        if l.async_checkpoint {
            (config.checkpoint.background, config.checkpoint.every) = (true, 1);
        }
        if l.attention == ferrotron_config::Attention::Products {
            // Attention as products is a GPU's: the run is one.
            t.device = ferrotron_config::Device::Cuda;
        }
        config
    }

    /// Whether the engine runs this job: its run configuration ([`Job::run_config`]) through
    /// the engine's own validation, with a token file as the data (a plan is for a real
    /// corpus, not the built-in synthetic one, whose vocabulary is bounded).
    pub fn engine_accepts(&self) -> Result<(), ConfigError> {
        let mut config = self.run_config();
        config.data.path = Some("tokens.bin".into());
        config.validate()
    }

    /// Validates the model and the layout against it.
    pub fn validate(&self) -> Result<(), PlanError> {
        self.model.validate()?;
        self.layout.validate(&self.model)
    }
}

fn take_keys(
    table: &mut toml::Table,
    section: &str,
    keys: &[&str],
) -> Result<toml::Table, PlanError> {
    let mut out = toml::Table::new();
    match table.get_mut(section) {
        None => {}
        Some(toml::Value::Table(t)) => {
            for k in keys {
                if let Some(v) = t.remove(*k) {
                    out.insert(k.to_string(), v);
                }
            }
        }
        Some(_) => return Err(invalid(section, "expected a table")),
    }
    Ok(out)
}

fn uint(t: &toml::Table, section: &str, key: &str) -> Result<Option<usize>, PlanError> {
    t.get(key)
        .map(|v| {
            v.as_integer()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(|| {
                    invalid(
                        &format!("{section}.{key}"),
                        "expected a non-negative integer",
                    )
                })
        })
        .transpose()
}

fn string(t: &toml::Table, section: &str, key: &str) -> Result<Option<String>, PlanError> {
    t.get(key)
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| invalid(&format!("{section}.{key}"), "expected a string"))
        })
        .transpose()
}

/// The layout a validated configuration's `[train]` and data-parallel settings give (the
/// other parallel degrees are read from the table after it).
fn layout_of(config: &Config) -> Layout {
    let (p, t) = (&config.parallel, &config.train);
    Layout {
        parallel: ParallelConfig {
            dp: p.dp,
            zero: p.zero,
            bucket_mb: p.bucket_mb,
            cp_kind: p.cp_kind,
            ..ParallelConfig::default()
        },
        micro_batch: t.micro_batch,
        grad_accum: t.grad_accum,
        dtype: t.dtype,
        fp32_grad_accum: t.fp32_grad_accum,
        loss_chunk: t.loss_chunk,
        host_matmul: t.device == ferrotron_config::Device::Cpu,
        matmul: t.matmul,
        attention: t.attention,
        threads: t.threads,
        async_checkpoint: config.checkpoint.background && config.checkpoint.every > 0,
        document_mask: config.data.document_mask,
        muon_ns_steps: (t.optimizer == ferrotron_config::Optimizer::Muon)
            .then_some(t.muon.ns_steps),
        fp8: t.fp8 != ferrotron_config::Fp8::Off,
    }
}

#[cfg(test)]
mod tests;

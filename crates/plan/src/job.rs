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
        let config: Config = table.try_into().map_err(parse_error)?;
        config.validate()?;
        let (p, t) = (&config.parallel, &config.train);
        let mut job = Job {
            model: ModelSpec::dense(
                name.unwrap_or_else(|| "config".into()),
                config.model.clone(),
            ),
            layout: Layout {
                parallel: ParallelConfig {
                    dp: p.dp,
                    zero: p.zero,
                    bucket_mb: p.bucket_mb,
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
            },
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
        if l.recompute != Recompute::None {
            out.push(format!("parallel.recompute={:?}", l.recompute).to_lowercase());
        }
        let dtype = match l.dtype {
            ferrotron_config::DType::F32 => "f32",
            ferrotron_config::DType::Bf16 => "bf16",
        };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_reads_keys_the_engine_refuses() {
        let job = Job::from_toml(
            "[parallel]\ndp = 2\ntp = 8\npp = 4\npp_schedule = \"interleaved\"\nvirtual_stages = 2\n",
            &["parallel.recompute=full".into(), "model.seq_len=4096".into()],
            Some("llama3-70b"),
        )
        .unwrap();
        assert_eq!(job.model.name, "llama3-70b");
        assert_eq!(job.model.config.hidden, 8192);
        assert_eq!((job.layout.dp, job.layout.tp, job.layout.pp), (2, 8, 4));
        assert_eq!(job.layout.pp_schedule, crate::layout::Schedule::Interleaved);
        assert_eq!(job.layout.recompute, Recompute::Full);
        let moe = Job::from_toml("", &["model.experts=4".into()], None).unwrap();
        assert_eq!(moe.model.moe.map(|m| (m.experts, m.top_k)), Some((4, 2)));
    }

    /// On OpenBLAS the host matmul's scratch is its buffer per compute thread instead of
    /// `gemm`'s largest packing, in the estimate as in the ledger.
    #[test]
    fn the_estimate_counts_openblas_scratch_per_thread() {
        let sets = |m: &str| -> Vec<String> {
            vec![
                format!("train.matmul={m}"),
                "train.threads=3".into(),
                "model.seq_len=512".into(),
            ]
        };
        let gemm = Job::from_toml("", &sets("gemm"), None).unwrap();
        let blas = Job::from_toml("", &sets("openblas"), None).unwrap();
        assert_eq!(blas.layout.matmul, ferrotron_config::Matmul::OpenBlas);
        let total = |j: &Job| crate::estimate(j).unwrap().stages[0].memory.total() as i64;
        let c = gemm.run_config();
        let (t, p) = (&c.train, &c.parallel);
        let pack = ferrotron_config::step_gemm_pack_bytes(&c.model, p, t.micro_batch, t.loss_chunk);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = 3.min(cores) as i64;
        assert_eq!(
            total(&blas) - total(&gemm),
            threads * ferrotron_config::BLAS_SCRATCH_PER_THREAD as i64 - pack as i64
        );
        let again = Job::from_toml("", &blas.overrides(), None).unwrap();
        assert_eq!(again.layout.matmul, ferrotron_config::Matmul::OpenBlas);
    }

    /// With bf16 products the host matmul's scratch is their packed blocks (one shared, one
    /// per compute thread), in the estimate as in the ledger, and the setting round-trips.
    #[test]
    fn the_estimate_counts_the_bf16_products_blocks() {
        let sets = |m: &str| -> Vec<String> {
            vec![
                format!("train.matmul={m}"),
                "train.dtype=\"bf16\"".into(),
                "train.threads=3".into(),
            ]
        };
        let gemm = Job::from_toml("", &sets("gemm"), None).unwrap();
        let bf16 = Job::from_toml("", &sets("bf16"), None).unwrap();
        assert_eq!(bf16.layout.matmul, ferrotron_config::Matmul::Bf16);
        let total = |j: &Job| crate::estimate(j).unwrap().stages[0].memory.total() as i64;
        let c = gemm.run_config();
        let (t, p) = (&c.train, &c.parallel);
        let pack = ferrotron_config::step_gemm_pack_bytes(&c.model, p, t.micro_batch, t.loss_chunk);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = 3.min(cores) as u64;
        let blocks = ferrotron_config::BF16_GEMM_SHARED_BYTES
            + threads * ferrotron_config::BF16_GEMM_PER_THREAD_BYTES;
        assert_eq!(total(&bf16) - total(&gemm), blocks as i64 - pack as i64);
        let again = Job::from_toml("", &bf16.overrides(), None).unwrap();
        assert_eq!(again.layout.matmul, ferrotron_config::Matmul::Bf16);
    }

    /// On a GPU there is no host matmul scratch; with bf16 products there is the backend's
    /// scratch for their rounded operands, which the engine holds as workspace too.
    #[test]
    fn the_estimate_counts_a_gpus_bf16_operands() {
        let sets = |m: &str| -> Vec<String> {
            vec![
                format!("train.matmul={m}"),
                "train.dtype=\"bf16\"".into(),
                "train.device=\"cuda\"".into(),
            ]
        };
        let gemm = Job::from_toml("", &sets("gemm"), None).unwrap();
        let bf16 = Job::from_toml("", &sets("bf16"), None).unwrap();
        let total = |j: &Job| crate::estimate(j).unwrap().stages[0].memory.total() as i64;
        let c = bf16.run_config();
        let (t, p) = (&c.train, &c.parallel);
        let operands =
            ferrotron_config::device_bf16_operand_bytes(&c.model, p, (t.micro_batch, t.loss_chunk));
        assert!(operands > 0);
        assert_eq!(total(&bf16) - total(&gemm), operands as i64);
    }

    /// With attention as products the GPU's score buffers are workspace for the whole run,
    /// of the rank's kv heads under tp, and the layout's overrides carry the choice.
    #[test]
    fn the_estimate_counts_a_gpus_attention_scores() {
        let sets = |a: &str, tp: usize| -> Vec<String> {
            vec![
                format!("train.attention={a}"),
                "train.device=\"cuda\"".into(),
                format!("parallel.tp={tp}"),
            ]
        };
        let total = |j: &Job| crate::estimate(j).unwrap().stages[0].memory.total() as i64;
        for tp in [1, 2] {
            let tiles = Job::from_toml("", &sets("tiles", tp), None).unwrap();
            let products = Job::from_toml("", &sets("products", tp), None).unwrap();
            let c = products.run_config();
            assert_eq!(c.train.attention, ferrotron_config::Attention::Products);
            let kv = c.model.kv_heads / tp;
            let rows = ferrotron_config::attention_score_rows(c.model.seq_len, kv);
            let scores = 2 * 4 * kv * rows * c.model.seq_len;
            assert!(scores > 0);
            assert_eq!(total(&products) - total(&tiles), scores as i64);
            assert!(products
                .overrides()
                .contains(&"train.attention=products".to_string()));
        }
    }

    /// With `train.threads` unset, the estimate counts OpenBLAS's buffer for the threads the
    /// engine gives a rank: every core for a pipeline stage (the stages share them), a share
    /// for a data-parallel rank.
    #[test]
    fn unset_threads_count_a_stage_s_cores_and_a_dp_rank_s_share() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (degree, threads) in [
            ("parallel.pp=2", cores),
            ("parallel.dp=2", (cores / 2).max(1)),
        ] {
            let sets = |m: &str| -> Vec<String> {
                vec![
                    format!("train.matmul={m}"),
                    "train.threads=0".into(),
                    degree.into(),
                ]
            };
            let gemm = Job::from_toml("", &sets("gemm"), None).unwrap();
            let blas = Job::from_toml("", &sets("openblas"), None).unwrap();
            let c = gemm.run_config();
            let (t, p) = (&c.train, &c.parallel);
            let pack =
                ferrotron_config::step_gemm_pack_bytes(&c.model, p, t.micro_batch, t.loss_chunk);
            let (g, b) = (
                crate::estimate(&gemm).unwrap(),
                crate::estimate(&blas).unwrap(),
            );
            for (g, b) in g.stages.iter().zip(&b.stages) {
                assert_eq!(
                    b.memory.total() as i64 - g.memory.total() as i64,
                    threads as i64 * ferrotron_config::BLAS_SCRATCH_PER_THREAD as i64 - pack as i64,
                    "{degree}, stage {}",
                    g.stage
                );
            }
        }
    }

    #[test]
    fn overrides_round_trip() {
        let job = Job::from_toml(
            "",
            &[
                "parallel.pp=2".into(),
                "parallel.pp_layers=[3, 1]".into(),
                "parallel.pp_schedule=zero_bubble".into(),
                "train.dtype=bf16".into(),
                "train.grad_accum=4".into(),
            ],
            None,
        )
        .unwrap();
        let again = Job::from_toml("", &job.overrides(), None).unwrap();
        assert_eq!(again.layout, job.layout);
        assert_eq!(job.layout.pp_layers, Some(vec![3, 1]));
    }

    #[test]
    fn bad_layouts_name_the_field() {
        let err = Job::from_toml("[parallel]\ntp = 3\n", &[], None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "parallel.tp: tp=3 does not divide model.heads=4"
        );
        let err = Job::from_toml("[parallel]\nep = 2\n", &[], None).unwrap_err();
        assert!(err.to_string().starts_with("parallel.ep:"), "{err}");
        let err = Job::from_toml("[parallel]\npp = -1\n", &[], None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "parallel.pp: expected a non-negative integer"
        );
        let err = Job::from_toml("", &["parallel.recompute=some".into()], None).unwrap_err();
        assert!(err.to_string().starts_with("parallel.recompute"), "{err}");
    }
}

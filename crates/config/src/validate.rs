//! Validation of a run configuration: every relation between its fields, checked before
//! any work, each failure naming the field and the fix. The checks run in a fixed order
//! (device, degrees, pipeline, experts, communication, training, data and output), so a
//! configuration with several problems is told the first of them.

use crate::{invalid, Attention, Config, ConfigError, DType, Device, Matmul, PpSchedule};
use crate::{MAX_COUNT, MAX_SYNTHETIC_VOCAB};

impl Config {
    /// Checks every relation between fields.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate()?;
        self.validate_device()?;
        self.validate_degrees()?;
        self.validate_pipeline()?;
        self.validate_experts()?;
        self.validate_communication()?;
        self.validate_train()?;
        self.validate_data_and_output()
    }

    /// What the device allows: TF32 on GPUs, the host matmul library on the CPU, bf16
    /// products in the bf16 regime.
    fn validate_device(&self) -> Result<(), ConfigError> {
        if self.train.tf32 && self.train.device != Device::Cuda {
            return Err(invalid(
                "train.tf32",
                "train.tf32 = true applies to GPU matmuls: set train.device = \"cuda\" or drop it",
            ));
        }
        if self.train.attention == Attention::Products {
            if self.train.device != Device::Cuda {
                return Err(invalid(
                    "train.attention",
                    "train.attention = \"products\" runs attention's products on cuBLASLt: set train.device = \"cuda\" or drop it",
                ));
            }
            if self.parallel.cp > 1 {
                return Err(invalid(
                    "train.attention",
                    "train.attention = \"products\" runs attention over whole sequences; with parallel.cp > 1 attention runs as ring blocks in the tiled kernels: drop it",
                ));
            }
            if self.data.document_mask {
                return Err(invalid(
                    "train.attention",
                    "train.attention = \"products\" runs plain causal attention; with data.document_mask attention runs as masked blocks in the tiled kernels: drop it",
                ));
            }
        }
        if self.train.matmul == Matmul::OpenBlas && self.train.device != Device::Cpu {
            return Err(invalid(
                "train.matmul",
                "train.matmul = \"openblas\" chooses the host's matmul library: with train.device = \"cuda\" drop it (or set \"bf16\" for bf16 products on the GPU)",
            ));
        }
        if self.train.matmul == Matmul::Bf16 && self.train.dtype != DType::Bf16 {
            return Err(invalid(
                "train.matmul",
                "train.matmul = \"bf16\" rounds the products' operands to bf16, which only the bf16 regime may do: set train.dtype = \"bf16\" or train.matmul = \"gemm\"",
            ));
        }
        Ok(())
    }

    /// Degrees of at least 1; `tp` dividing the heads, key/value heads, MLP width and
    /// vocabulary; context and sequence parallelism's even splits of the tokens.
    fn validate_degrees(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        for (name, value) in [
            ("parallel.dp", p.dp),
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
            ("parallel.cp", p.cp),
            ("parallel.ep", p.ep),
        ] {
            if value == 0 {
                return Err(invalid(name, format!("{name}=0: must be at least 1")));
            }
        }
        let m = &self.model;
        for (field, what, n) in [
            ("model.heads", "heads", m.heads),
            ("model.kv_heads", "kv_heads", m.kv_heads),
            ("model.ffn", "ffn", m.ffn),
        ] {
            if !n.is_multiple_of(p.tp) {
                return Err(invalid(
                    field,
                    format!(
                        "tp={} does not divide {what}={n}: choose tp among the divisors of {what}",
                        p.tp
                    ),
                ));
            }
        }
        // The zig-zag split cuts every sequence into 2·cp equal chunks (playbook §4, CP).
        if p.cp > 1 && !m.seq_len.is_multiple_of(2 * p.cp) {
            return Err(invalid(
                "model.seq_len",
                format!(
                    "seq_len={} is not divisible by 2 × parallel.cp = {}: context parallelism cuts each sequence into 2·cp equal zig-zag chunks; choose seq_len a multiple of {} or another cp",
                    m.seq_len,
                    2 * p.cp,
                    2 * p.cp
                ),
            ));
        }
        self.validate_ulysses()?;
        let rank_tokens = self.train.micro_batch * m.seq_len / p.cp;
        if p.sequence_parallel && !rank_tokens.is_multiple_of(p.tp) {
            return Err(invalid(
                "parallel.sequence_parallel",
                format!(
                    "tp={} does not divide the micro-batch's {} tokens on each rank (micro_batch × seq_len / cp): sequence parallelism splits tokens evenly",
                    p.tp, rank_tokens
                ),
            ));
        }
        Ok(())
    }

    /// Ulysses context parallelism deals each tensor-parallel rank's query heads out over the
    /// context-parallel ranks, and its key/value heads too (or each to the ranks sharing it).
    fn validate_ulysses(&self) -> Result<(), ConfigError> {
        let (p, m) = (&self.parallel, &self.model);
        if p.cp_kind != crate::CpKind::Ulysses || p.cp <= 1 {
            return Ok(());
        }
        let (heads, kv) = (m.heads / p.tp, m.kv_heads / p.tp);
        let fix = |what: &str, local: usize| {
            invalid(
                "parallel.cp_kind",
                format!(
                    "\"ulysses\" deals the {local} {what} of each tensor-parallel rank ({what}={} / tp={}) over cp={} ranks, {}: choose another cp, or cp_kind = \"ring\"",
                    if what == "heads" { m.heads } else { m.kv_heads },
                    p.tp,
                    p.cp,
                    if what == "heads" {
                        "which does not divide them"
                    } else {
                        "which neither divides them nor is a multiple of them"
                    }
                ),
            )
        };
        if !heads.is_multiple_of(p.cp) {
            return Err(fix("heads", heads));
        }
        if !(kv.is_multiple_of(p.cp) || p.cp.is_multiple_of(kv)) {
            return Err(fix("kv_heads", kv));
        }
        Ok(())
    }

    /// Pipeline parallelism: virtual stages, the micro-batches each schedule needs, the
    /// stage split (the one `ferrotron_schedule` runs), and what it does not combine with.
    fn validate_pipeline(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        let v = p.virtual_stages;
        if v == 0 {
            return Err(invalid("parallel.virtual_stages", "must be at least 1"));
        }
        match p.pp_schedule {
            PpSchedule::Interleaved if v < 2 => {
                return Err(invalid(
                    "parallel.virtual_stages",
                    "the interleaved schedule needs virtual_stages ≥ 2 (or use pp_schedule = \"1f1b\")",
                ))
            }
            PpSchedule::Interleaved if !self.train.grad_accum.is_multiple_of(p.pp) => {
                return Err(invalid(
                    "train.grad_accum",
                    format!(
                        "interleaved schedules need micro-batches (grad_accum={}) divisible by stages (pp={})",
                        self.train.grad_accum, p.pp
                    ),
                ))
            }
            PpSchedule::Interleaved => {}
            PpSchedule::DualPipeV if v != 1 => {
                return Err(invalid(
                    "parallel.virtual_stages",
                    "DualPipeV holds 2 chunks per rank (stages r and 2p−1−r) by itself; leave virtual_stages at 1",
                ))
            }
            PpSchedule::DualPipeV if p.pp > 1 && self.train.grad_accum < 2 * p.pp => {
                return Err(invalid(
                    "train.grad_accum",
                    format!(
                        "DualPipeV needs at least 2·pp micro-batches (pp={}, so {}), got grad_accum={}; raise train.grad_accum or lower parallel.pp",
                        p.pp,
                        2 * p.pp,
                        self.train.grad_accum
                    ),
                ))
            }
            _ if v != 1 => {
                return Err(invalid("parallel.virtual_stages", "only the interleaved schedule uses virtual stages; set it to 1"))
            }
            _ => {}
        }
        // The one stage split (crates/schedule): what validation accepts is what runs.
        let list = p.pp_layers.as_deref();
        match ferrotron_schedule::check_split(self.model.layers, p.pp, p.chunks_per_rank(), list) {
            Ok(()) => {}
            Err(e @ ferrotron_schedule::ScheduleError::BadStageList { .. }) => {
                return Err(invalid("parallel.pp_layers", e.to_string()))
            }
            Err(e) => return Err(invalid("model.layers", e.to_string())),
        }
        // DualPipeV holds the embedding and the head on rank 0: a tied pair stays one weight.
        if p.pp > 1 && self.model.tie_embeddings && p.pp_schedule != PpSchedule::DualPipeV {
            return Err(invalid(
                "model.tie_embeddings",
                "tied embeddings under pipeline parallelism need the embedding and the head on one rank: set parallel.pp_schedule = \"dualpipev\" (both on rank 0), or set it to false",
            ));
        }
        if p.pp > 1 && p.zero >= 2 {
            return Err(invalid(
                "parallel.zero",
                format!("zero={} with pipeline parallelism is not supported (the playbook pairs PP with ZeRO-1); use zero ≤ 1", p.zero),
            ));
        }
        Ok(())
    }

    /// Expert parallelism: `ep` ranks of the data-parallel dimension split every
    /// mixture-of-experts block's experts evenly.
    fn validate_experts(&self) -> Result<(), ConfigError> {
        let (p, m) = (&self.parallel, &self.model);
        if m.moe_capacity_factor.is_some() && p.cp > 1 {
            return Err(invalid(
                "model.moe_capacity_factor",
                format!(
                    "with cp={}: an expert's capacity counts the micro-batch's tokens, and each \
                     context-parallel rank routes only its share of them, so the tokens dropped \
                     would depend on the layout; use cp = 1, or dropless routing (no \
                     moe_capacity_factor)",
                    p.cp
                ),
            ));
        }
        if p.ep == 1 {
            return Ok(());
        }
        if m.experts == 0 {
            return Err(invalid(
                "parallel.ep",
                format!(
                    "ep={} needs a mixture-of-experts model: set model.experts > 0 or ep = 1",
                    p.ep
                ),
            ));
        }
        if !m.experts.is_multiple_of(p.ep) {
            return Err(invalid(
                "parallel.ep",
                format!(
                    "ep={} does not divide experts={}: each expert-parallel rank holds experts/ep experts, so choose ep among the divisors of model.experts",
                    p.ep, m.experts
                ),
            ));
        }
        if !p.dp.is_multiple_of(p.ep) {
            return Err(invalid(
                "parallel.ep",
                format!(
                    "ep={} does not divide dp={}: expert parallelism is folded into data parallelism, so choose ep among the divisors of parallel.dp",
                    p.ep, p.dp
                ),
            ));
        }
        Ok(())
    }

    /// ZeRO's stage, the gradient buckets and the collectives' timeout.
    fn validate_communication(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        if p.zero > 3 {
            return Err(invalid(
                "parallel.zero",
                format!("zero={}: ZeRO stages are 0, 1, 2 and 3", p.zero),
            ));
        }
        if !(p.bucket_mb > 0.0) {
            return Err(invalid("parallel.bucket_mb", "must be positive"));
        }
        if !(p.comm_timeout_s > 0.0) {
            return Err(invalid("parallel.comm_timeout_s", "must be positive"));
        }
        Ok(())
    }

    /// Batch counts, the optimizer's hyperparameters and the gradient accumulation's
    /// precision.
    fn validate_train(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        for (name, value) in [
            ("train.micro_batch", t.micro_batch),
            ("train.grad_accum", t.grad_accum),
            ("train.loss_chunk", t.loss_chunk),
        ] {
            if value == 0 || value > MAX_COUNT {
                return Err(invalid(
                    name,
                    format!("{value}: must be in 1..={MAX_COUNT}"),
                ));
            }
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            return Err(invalid(
                "train.lr",
                format!(
                    "lr={}: the learning rate must be a finite number above 0",
                    t.lr
                ),
            ));
        }
        if !(t.min_lr >= 0.0) || t.min_lr > t.lr {
            return Err(invalid("train.min_lr", "need 0 <= min_lr <= lr"));
        }
        if !(0.0..1.0).contains(&t.beta1) {
            return Err(invalid("train.beta1", "must be in [0, 1)"));
        }
        if !(0.0..1.0).contains(&t.beta2) {
            return Err(invalid("train.beta2", "must be in [0, 1)"));
        }
        if !(t.eps > 0.0 && t.eps.is_finite()) {
            return Err(invalid("train.eps", "must be a finite number above 0"));
        }
        if !(t.weight_decay >= 0.0 && t.weight_decay.is_finite()) {
            return Err(invalid(
                "train.weight_decay",
                "must be a finite number, 0 or more",
            ));
        }
        if !(t.grad_clip >= 0.0 && t.grad_clip.is_finite()) {
            return Err(invalid(
                "train.grad_clip",
                "must be a finite number, 0 or more (0 disables)",
            ));
        }
        if t.fp32_grad_accum && t.dtype == DType::F32 {
            return Err(invalid(
                "train.fp32_grad_accum",
                "only meaningful with train.dtype = \"bf16\" (f32 gradients already accumulate in fp32; fp16 ones always do)",
            ));
        }
        self.validate_fp8()?;
        self.validate_amax_history()?;
        self.validate_fp16()?;
        if t.optimizer == crate::Optimizer::AdamW && t.muon != crate::MuonConfig::default() {
            return Err(invalid(
                "train.muon",
                "is read only by Muon: set train.optimizer = \"muon\", or remove the [train.muon] \
                 settings",
            ));
        }
        t.muon.validate()
    }

    /// `train.fp8`: emulated on the CPU's f32 products, for dense blocks.
    fn validate_fp8(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        if t.fp8 == crate::Fp8::Off {
            return Ok(());
        }
        let refuse = |why: String| {
            Err(invalid(
                "train.fp8",
                format!("\"{}\" {why}; set train.fp8 = \"off\"", t.fp8.name()),
            ))
        };
        if t.device == Device::Cuda {
            return refuse(
                "is emulated on the CPU only: cuBLASLt's FP8 products are not wired yet".into(),
            );
        }
        if t.matmul == Matmul::Bf16 {
            return refuse(
                "emulates FP8 on f32 products, and train.matmul = \"bf16\" runs them in bf16"
                    .into(),
            );
        }
        if self.model.experts > 0 {
            return refuse(
                "covers the dense blocks' linear layers, not yet a mixture of experts'".into(),
            );
        }
        if self.parallel.cp > 1 {
            return refuse(format!(
                "with cp={}: each context-parallel rank holds a share of the tokens, whose \
                 scales are not yet reduced over the CP group",
                self.parallel.cp
            ));
        }
        Ok(())
    }

    /// `data.blend`: instead of `data.path`, with finite positive weights.
    fn validate_blend(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        if d.path.is_some() && !d.blend.is_empty() {
            return Err(invalid(
                "data.blend",
                "set data.path or data.blend, not both (a blend of one corpus is data.path)",
            ));
        }
        if let Some((w, p)) = d.blend.iter().find(|(w, _)| !(w.is_finite() && *w > 0.0)) {
            return Err(invalid(
                "data.blend",
                format!(
                    "{} has weight {w}: every weight must be a finite number above 0",
                    p.display()
                ),
            ));
        }
        Ok(())
    }

    /// `data.document_mask` with its end-of-document token, inside the vocabulary.
    fn validate_documents(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        match (d.document_mask, d.eos_id) {
            (true, None) => Err(invalid(
                "data.eos_id",
                "data.document_mask = true needs the end-of-document token: set data.eos_id to \
                 your tokenizer's end-of-text id (256 for prepare-data's byte tokenizer)",
            )),
            (false, Some(_)) => Err(invalid(
                "data.eos_id",
                "is read only by document masking: set data.document_mask = true, or remove \
                 data.eos_id",
            )),
            (true, Some(eos)) if eos as usize >= self.model.vocab => Err(invalid(
                "data.eos_id",
                format!(
                    "{eos} is outside the model's vocabulary of {} ids",
                    self.model.vocab
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The built-in corpus's vocabulary bound, evaluation's layouts, checkpoints kept and
    /// the log interval.
    fn validate_data_and_output(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        self.validate_blend()?;
        self.validate_documents()?;
        if !self.data.reads_files() && self.model.vocab > MAX_SYNTHETIC_VOCAB {
            return Err(invalid(
                "model.vocab",
                format!(
                    "vocab={}: the built-in synthetic corpus is built for vocabularies up to \
                     {MAX_SYNTHETIC_VOCAB} (about 10 s); set data.path to a token file for a \
                     larger one",
                    self.model.vocab
                ),
            ));
        }
        if self.data.eval_path.is_some() && (p.pp > 1 || p.cp > 1) {
            return Err(invalid(
                "data.eval_path",
                "evaluation during training runs without pipeline or context parallelism: remove data.eval_path and evaluate the saved model with `ferrotron eval`",
            ));
        }
        if (self.checkpoint.every > 0 || self.checkpoint.on_stop) && self.checkpoint.keep == 0 {
            return Err(invalid(
                "checkpoint.keep",
                "must be at least 1 when checkpoint.every > 0 or checkpoint.on_stop = true (0 would delete every checkpoint)",
            ));
        }
        if self.checkpoint.background && self.checkpoint.every == 0 {
            return Err(invalid(
                "checkpoint.async",
                "writes periodic saves in the background, and checkpoint.every = 0 asks for none (a stopped run's save is written at once): set checkpoint.every, or drop checkpoint.async",
            ));
        }
        if self.run.log_every == 0 {
            return Err(invalid("run.log_every", "must be at least 1"));
        }
        let grace = self.run.signal_grace_s;
        if !(grace > 0.0 && grace <= 86_400.0) {
            return Err(invalid(
                "run.signal_grace_s",
                "must be a number of seconds in (0, 86400]: the time a signalled run has to save its checkpoint",
            ));
        }
        Ok(())
    }
}

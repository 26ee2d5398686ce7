//! `ferrotron generate`: a model directory continues a prompt, token by token, printed as they
//! come. Greedy by default (as transformers' `generate(do_sample=False)`); with
//! `--temperature` it samples, restricted to the nucleus of `--top-p`, reproducibly for a
//! `--seed`. The key/value cache makes each token one pass over the blocks for one position.
//! The generation itself is the library's ([`ferrotron_train::generate`]); this command reads
//! the arguments and the tokenizer and prints.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use ferrotron_config::DType;
use ferrotron_tokenize::TextCodec;
use ferrotron_train::generate::{check_settings, GenerateOptions, Generation, Sampling};
use ferrotron_train::hf::load_model;
use ferrotron_train::on_device::DeviceModel;

use crate::device::{inference_backend, DeviceArg};

/// Arguments of `generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A Hugging Face model directory (config.json and weights), e.g. from `train --save-model`.
    #[arg(long)]
    model: PathBuf,
    /// The prompt, tokenized with the directory's tokenizer.json, or as bytes without one.
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// The prompt as token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Vec<u32>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy (the most probable token every time).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f64,
    /// Sample only among the most probable tokens whose probabilities add up to this.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f64,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep going past the model's end-of-sequence token (config.json `eos_token_id`).
    #[arg(long)]
    ignore_eos: bool,
    /// Recompute the whole sequence for every token instead of using the key/value cache.
    #[arg(long)]
    no_cache: bool,
    /// Print the generated token ids (space separated) instead of text.
    #[arg(long)]
    ids: bool,
    /// Where the model runs: the host, or GPU 0 (a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t)]
    device: DeviceArg,
}

/// Checks the arguments and reads the prompt's ids and the tokenizer.
fn prompt(a: &GenerateArgs, vocab: usize) -> anyhow::Result<(Vec<u32>, TextCodec)> {
    let sampling = Sampling {
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
    };
    check_settings(&sampling, a.max_new_tokens)?;
    let text = TextCodec::for_model_dir(&a.model)?;
    if text.is_bytes() && (a.prompt.is_some() || !a.ids) {
        eprintln!(
            "warning: {} has no tokenizer.json: text is read and written as bytes, right \
             only for a model trained on byte tokens (prepare-data's default); for another \
             put its tokenizer.json there, or use --prompt-ids and --ids",
            a.model.display()
        );
    }
    let ids = match &a.prompt {
        None => a.prompt_ids.clone(),
        Some(p) => text.encode(p)?,
    };
    anyhow::ensure!(
        !ids.is_empty(),
        "the prompt is empty: pass --prompt TEXT or --prompt-ids 1,2,3"
    );
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        anyhow::bail!(
            "prompt token {bad} is outside the model's vocabulary of {vocab}{}",
            if a.prompt.is_some() && text.is_bytes() {
                ": without a tokenizer.json the prompt is read as bytes; pass --prompt-ids"
            } else {
                ""
            }
        );
    }
    Ok((ids, text))
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let loaded = load_model(&a.model)?;
    let (ids, text) = prompt(&a, loaded.config.vocab)?;
    let trained = loaded.config.seq_len;
    let total = ids.len() + a.max_new_tokens;
    if total > trained {
        eprintln!(
            "warning: the prompt and the new tokens take {total} positions, {} past the \
             model's max_position_embeddings = {trained}: its output there is untested",
            total - trained
        );
    }
    let backend = inference_backend(a.device)?;
    let model = DeviceModel::new(&loaded.config, &loaded.weights, DType::F32, backend);
    drop(loaded);
    let decoder = model.decoder(total);
    let options = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        sampling: Sampling {
            temperature: a.temperature,
            top_p: a.top_p,
            seed: a.seed,
        },
        eos: (!a.ignore_eos)
            .then(|| ferrotron_train::hf::eos_token_id(&a.model))
            .flatten(),
        recompute: a.no_cache,
    };
    let prompt_len = ids.len();
    let mut out = std::io::stdout().lock();
    let mut printed = String::new();
    let mut generation = Generation::new(decoder, &ids, options);
    while let Some(next) = generation.next() {
        let ids = generation.ids();
        if a.ids {
            let gap = if ids.len() > prompt_len + 1 { " " } else { "" };
            write!(out, "{gap}{next}")?;
        } else {
            let now = text.decode(&ids[prompt_len..]);
            write!(
                out,
                "{}",
                now.strip_prefix(printed.as_str()).unwrap_or(&now)
            )?;
            printed = now;
        }
        out.flush().context("writing to stdout")?;
    }
    writeln!(out)?;
    Ok(())
}

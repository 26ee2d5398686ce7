//! `ferrotron generate`: a model directory continues a prompt, token by token, printed as they
//! come. Greedy by default (as transformers' `generate(do_sample=False)`); with
//! `--temperature` it samples, restricted to the nucleus of `--top-p`, reproducibly for a
//! `--seed`. The key/value cache makes each token one pass over the blocks for one position.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use ferrotron_model::decode::Decoder;
use ferrotron_model::Llama;
use ferrotron_tensor::{Category, Device, Ledger, Store};
use ferrotron_tokenize::{ByteTokenizer, HfTokenizer};
use ferrotron_train::hf::load_model;

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

/// The most generated tokens a call may ask for.
const MAX_NEW: usize = 1 << 20;

enum Text {
    Hf(Box<HfTokenizer>),
    Bytes,
}

impl Text {
    fn decode(&self, ids: &[u32]) -> String {
        match self {
            Text::Hf(t) => t.inner().decode(ids, true).unwrap_or_default(),
            Text::Bytes => ByteTokenizer.decode_lossy(ids),
        }
    }
}

/// Checks the arguments and reads the prompt's ids and the tokenizer.
fn prompt(a: &GenerateArgs, vocab: usize) -> anyhow::Result<(Vec<u32>, Text)> {
    anyhow::ensure!(
        a.temperature >= 0.0 && a.temperature.is_finite(),
        "--temperature {}: use 0 (greedy) or a positive number",
        a.temperature
    );
    anyhow::ensure!(
        a.top_p > 0.0 && a.top_p <= 1.0,
        "--top-p {}: use a number in (0, 1]",
        a.top_p
    );
    anyhow::ensure!(
        (1..=MAX_NEW).contains(&a.max_new_tokens),
        "--max-new-tokens {}: use 1 to {MAX_NEW}",
        a.max_new_tokens
    );
    let tokenizer_path = a.model.join("tokenizer.json");
    let text = if tokenizer_path.is_file() {
        Text::Hf(Box::new(HfTokenizer::from_file(&tokenizer_path)?))
    } else {
        if a.prompt.is_some() || !a.ids {
            eprintln!(
                "warning: {} has no tokenizer.json: text is read and written as bytes, right \
                 only for a model trained on byte tokens (prepare-data's default); for another \
                 put its tokenizer.json there, or use --prompt-ids and --ids",
                a.model.display()
            );
        }
        Text::Bytes
    };
    let ids = match (&a.prompt, &text) {
        (None, _) => a.prompt_ids.clone(),
        (Some(p), Text::Hf(t)) => t
            .inner()
            .encode(p.as_str(), true)
            .map_err(|e| anyhow::anyhow!("--prompt: {e}"))?
            .get_ids()
            .to_vec(),
        (Some(p), Text::Bytes) => p.bytes().map(u32::from).collect(),
    };
    anyhow::ensure!(
        !ids.is_empty(),
        "the prompt is empty: pass --prompt TEXT or --prompt-ids 1,2,3"
    );
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        anyhow::bail!(
            "prompt token {bad} is outside the model's vocabulary of {vocab}{}",
            if a.prompt.is_some() && matches!(text, Text::Bytes) {
                ": without a tokenizer.json the prompt is read as bytes; pass --prompt-ids"
            } else {
                ""
            }
        );
    }
    Ok((ids, text))
}

/// The end-of-sequence id of the directory's config.json, if any.
fn eos(model: &std::path::Path) -> Option<u32> {
    let text = std::fs::read_to_string(model.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("eos_token_id")?.as_u64().map(|x| x as u32)
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let loaded = load_model(&a.model)?;
    let (mut ids, text) = prompt(&a, loaded.config.vocab)?;
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
    let ledger = backend.memory().map_or_else(Ledger::new, Ledger::on);
    let dev = Device {
        ledger: &ledger,
        backend: &*backend,
    };
    let model = Llama::new(&loaded.config);
    let weights = Store::F32(ledger.upload(Category::Weights, "weights", &loaded.weights));
    drop(loaded);
    let decoder = Decoder::new(&model, &weights, dev, total);
    let eos = (!a.ignore_eos).then(|| eos(&a.model)).flatten();
    let mut rng = SplitMix(a.seed);
    let mut cache = decoder.cache();
    let mut logits = decoder.forward(&ids, &mut cache);
    let prompt_len = ids.len();
    let mut out = std::io::stdout().lock();
    let mut printed = String::new();
    for _ in 0..a.max_new_tokens {
        let next = pick(&logits, a.temperature, a.top_p, &mut rng);
        if Some(next) == eos {
            break;
        }
        ids.push(next);
        if a.ids {
            write!(
                out,
                "{}{next}",
                if ids.len() > prompt_len + 1 { " " } else { "" }
            )?;
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
        logits = if a.no_cache {
            decoder.forward(&ids, &mut decoder.cache())
        } else {
            decoder.forward(&[next], &mut cache)
        };
    }
    writeln!(out)?;
    Ok(())
}

/// The next token: the most probable (the first on ties) at temperature 0, else a sample
/// from the softmax at `temperature` restricted to the smallest set of most probable tokens
/// whose probability reaches `top_p`.
fn pick(logits: &[f32], temperature: f64, top_p: f64, rng: &mut SplitMix) -> u32 {
    if temperature == 0.0 {
        let mut best = 0;
        for (i, &z) in logits.iter().enumerate() {
            if z > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &z)| (i, ((z as f64 - max) / temperature).exp()))
        .collect();
    let sum: f64 = p.iter().map(|x| x.1).sum();
    p.iter_mut().for_each(|x| x.1 /= sum);
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0.0;
    let mut n = 0;
    while n < p.len() && (n == 0 || kept < top_p) {
        kept += p[n].1;
        n += 1;
    }
    let mut u = rng.next_f64() * kept;
    for &(i, q) in &p[..n] {
        if u < q {
            return i as u32;
        }
        u -= q;
    }
    p[n - 1].0 as u32
}

/// SplitMix64: the sampling's random numbers, from the seed alone.
struct SplitMix(u64);

impl SplitMix {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_top_p_keeps_the_nucleus() {
        let mut rng = SplitMix(1);
        assert_eq!(pick(&[0.0, 3.0, 3.0, 1.0], 0.0, 1.0, &mut rng), 1);
        // One token holds 99.9% of the mass: a nucleus of 0.5 is that token alone.
        let logits = [0.0, 10.0, 0.0, 0.0];
        for _ in 0..100 {
            assert_eq!(pick(&logits, 1.0, 0.5, &mut rng), 1);
        }
        // Uniform logits at top_p 1: every token comes up.
        let mut seen = [0; 4];
        for _ in 0..400 {
            seen[pick(&[1.0; 4], 1.0, 1.0, &mut rng) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
    }
}

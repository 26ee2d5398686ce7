//! A note for pipeline runs on the even stage split: the last stage also computes the LM
//! head, so with equal block counts it carries the most work and sets the pace of every
//! stage. The note names the compute-balanced split `ferrotron plan` uses
//! ([`balanced_pp_layers`]) and what it saves; the run itself keeps the split it was given.

use ferrotron_config::{Config, PpSchedule};
use ferrotron_plan::{balanced_pp_layers, head_blocks, Job};

/// Smallest saving on the slowest stage worth a note.
const MIN_GAIN: f64 = 0.02;

/// The note for `config`, or `None` when it gives `parallel.pp_layers` itself, runs the
/// interleaved schedule, has one stage, or the balanced split saves less than [`MIN_GAIN`].
pub fn hint(config: &Config) -> Option<String> {
    let p = &config.parallel;
    if p.pp < 2 || p.pp_layers.is_some() || p.pp_schedule == PpSchedule::Interleaved {
        return None;
    }
    let job = Job::from_config(config).ok()?;
    let model = &job.model;
    let head = head_blocks(model);
    // Compute of the slowest stage, in blocks, the head counted on the last stage.
    let slowest = |sizes: &[usize]| {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| n as f64 + if i + 1 == sizes.len() { head } else { 0.0 })
            .fold(0.0, f64::max)
    };
    let even = config.stage_layers();
    let balanced = balanced_pp_layers(model, p.pp);
    let (before, after) = (slowest(&even), slowest(&balanced));
    if after > before * (1.0 - MIN_GAIN) {
        return None;
    }
    let shown = |s: &[usize]| s.iter().map(usize::to_string).collect::<Vec<_>>().join("/");
    Some(format!(
        "note: pipeline stages of {} blocks: the last also computes the LM head (≈ {head:.1} \
         blocks of compute) and sets the pace; parallel.pp_layers = {balanced:?} balances \
         them (slowest stage {before:.1} → {after:.1} blocks of compute, −{:.0}%), as \
         `ferrotron plan` splits",
        shown(&even),
        100.0 * (1.0 - after / before),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(pp: usize) -> Config {
        let sets: Vec<String> = [
            "model.vocab=8192",
            "model.hidden=512",
            "model.layers=8",
            "model.heads=8",
            "model.kv_heads=4",
            "model.ffn=1536",
            "model.seq_len=256",
            "train.grad_accum=8",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("parallel.pp={pp}")])
        .collect();
        Config::load(None, &sets).unwrap()
    }

    #[test]
    fn small_pp2_is_told_the_balanced_split() {
        // Head 2·512·8192 = 8.39 MFLOP per token; a block 1.05 (QKV) + 0.52 (output) + 4.72
        // (MLP) + 0.52 (attention, full s × s) = 6.82: 1.23 blocks. Even: 4 and 4 + 1.23 =
        // 5.23; [5, 3]: max(5, 4.23) = 5, 4.4% less.
        let note = hint(&small(2)).expect("a note");
        assert!(note.contains("stages of 4/4 blocks"), "{note}");
        assert!(note.contains("parallel.pp_layers = [5, 3]"), "{note}");
        assert!(note.contains("5.2 → 5.0"), "{note}");
        assert!(note.contains("−4%"), "{note}");
    }

    #[test]
    fn no_note_without_pipeline_or_with_a_split_given() {
        assert_eq!(hint(&small(1)), None);
        let mut c = small(2);
        c.parallel.pp_layers = Some(vec![5, 3]);
        assert_eq!(hint(&c), None);
        // tiny: 4 blocks of hidden 128 and a vocabulary of 256; the head is ~0.1 blocks.
        let tiny = Config::load(None, &["parallel.pp=2".to_string()]).unwrap();
        assert_eq!(hint(&tiny), None);
    }
}

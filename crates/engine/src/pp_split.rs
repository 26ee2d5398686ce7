//! A note for pipeline runs on the even stage split: the last stage also computes the LM
//! head, so with equal block counts it carries the most work and sets the pace of every
//! stage. The note names the compute-balanced split `ferrotron plan` uses
//! ([`balanced_pp_layers`]) and what it saves; the run itself keeps the split it was given.

use ferrotron_config::{Config, PpSchedule};
use ferrotron_plan::{balanced_pp_layers, balanced_v_layers, head_blocks, Job};

/// Smallest saving on the slowest stage worth a note.
const MIN_GAIN: f64 = 0.02;

/// The note for `config`, or `None` when it gives `parallel.pp_layers` itself, runs the
/// interleaved schedule, has one stage, or the balanced split saves less than `MIN_GAIN`.
pub fn hint(config: &Config) -> Option<String> {
    let p = &config.parallel;
    if p.pp < 2 || p.pp_layers.is_some() || p.pp_schedule == PpSchedule::Interleaved {
        return None;
    }
    let job = Job::from_config(config).ok()?;
    let model = &job.model;
    let head = head_blocks(model);
    let v = p.pp_schedule == PpSchedule::DualPipeV;
    // Compute of the slowest rank, in blocks, the head counted on the rank holding it (the
    // last; rank 0 under DualPipeV, whose rank r holds stages r and 2p−1−r).
    let slowest = |sizes: &[usize]| {
        (0..p.pp)
            .map(|r| {
                let own = match v {
                    true => sizes[r] + sizes[2 * p.pp - 1 - r],
                    false => sizes[r],
                };
                let holds_head = if v { r == 0 } else { r + 1 == p.pp };
                own as f64 + if holds_head { head } else { 0.0 }
            })
            .fold(0.0, f64::max)
    };
    let even = config.stage_layers();
    let balanced = match v {
        true => balanced_v_layers(model, p.pp)?,
        false => balanced_pp_layers(model, p.pp),
    };
    let (before, after) = (slowest(&even), slowest(&balanced));
    if after > before * (1.0 - MIN_GAIN) {
        return None;
    }
    let shown = |s: &[usize]| s.iter().map(usize::to_string).collect::<Vec<_>>().join("/");
    Some(format!(
        "note: pipeline stages of {} blocks: the {} also computes the LM head (≈ {head:.1} \
         blocks of compute) and sets the pace; parallel.pp_layers = {balanced:?} balances \
         them (slowest rank {before:.1} → {after:.1} blocks of compute, −{:.0}%), as \
         `ferrotron plan` splits",
        shown(&even),
        if v { "rank holding the first" } else { "last" },
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
    fn dualpipev_is_told_its_v_split() {
        // Rank 0 holds stages 0 and 3 and the head: 2 + 2 + 1.23 against rank 1's 4. The
        // balanced V gives rank 0 three blocks (stages 0 and 3: 2 and 1), rank 1 five.
        let mut c = small(2);
        c.parallel.pp_schedule = PpSchedule::DualPipeV;
        let note = hint(&c).expect("a note");
        assert!(note.contains("stages of 2/2/2/2 blocks"), "{note}");
        assert!(note.contains("rank holding the first"), "{note}");
        assert!(note.contains("parallel.pp_layers = [2, 3, 2, 1]"), "{note}");
        assert!(note.contains("5.2 → 5.0"), "{note}");
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

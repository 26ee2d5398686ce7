//! Which transformer blocks each pipeline rank holds: the one stage split that config
//! validation, the engine, the estimator and the planner all use.
//!
//! The model's `layers` blocks are cut, in forward order, into `p·v` virtual stages, laid on
//! the ranks by the schedule's [`Placement`]: virtual stage `k` belongs to pipeline rank
//! `k mod p` as its chunk `k div p` (Megatron's interleaving; with `v = 1` rank `r` simply
//! holds stage `r`), or DualPipeV's V. Stage 0 also holds the embedding, stage `p·v − 1` the
//! final norm and LM head.

use std::ops::Range;

use crate::{Placement, ScheduleError};

/// Blocks of each virtual stage, in pipeline order: `pp_layers` when given, else `layers`
/// split evenly over `p·v` stages. [`check_split`] says whether the split is usable; for an
/// input it refuses, this still returns a split that covers every block once (the first
/// `layers mod p·v` stages one block more), so arithmetic over it never loses blocks.
pub fn stage_sizes(layers: usize, p: usize, v: usize, pp_layers: Option<&[usize]>) -> Vec<usize> {
    let n = p.max(1).saturating_mul(v.max(1));
    match pp_layers {
        Some(list) if list.len() == n => list.to_vec(),
        _ => (0..n)
            .map(|k| layers / n + usize::from(k < layers % n))
            .collect(),
    }
}

/// Checks that the split of `layers` blocks over `p` ranks of `v` chunks is one the engine
/// runs: an even split, or a `pp_layers` list of `p·v` positive entries summing to `layers`.
pub fn check_split(
    layers: usize,
    p: usize,
    v: usize,
    pp_layers: Option<&[usize]>,
) -> Result<(), ScheduleError> {
    if p == 0 {
        return Err(ScheduleError::ZeroStages);
    }
    if v == 0 {
        return Err(ScheduleError::ZeroVirtualStages);
    }
    let Some(stages) = p.checked_mul(v) else {
        return Err(ScheduleError::LayersNotDivisible { layers, p, v });
    };
    match pp_layers {
        Some(list)
            if list.len() != stages
                || list.contains(&0)
                || list.iter().sum::<usize>() != layers =>
        {
            Err(ScheduleError::BadStageList {
                stages,
                layers,
                got: list.to_vec(),
            })
        }
        Some(_) => Ok(()),
        None if !layers.is_multiple_of(stages) => {
            Err(ScheduleError::LayersNotDivisible { layers, p, v })
        }
        None => Ok(()),
    }
}

/// The blocks of pipeline rank `rank` of `p`, one global range per chunk in chunk order
/// (chunk `c` is virtual stage `placement.stage(p, rank, c)`), from the stage sizes of
/// [`stage_sizes`].
pub fn rank_chunks(
    sizes: &[usize],
    p: usize,
    rank: usize,
    placement: Placement,
) -> Vec<Range<usize>> {
    let p = p.max(1);
    let starts: Vec<usize> = sizes
        .iter()
        .scan(0, |start, &n| {
            *start += n;
            Some(*start - n)
        })
        .collect();
    placement
        .stages_of(p, sizes.len() / p, rank)
        .into_iter()
        .filter(|&s| s < sizes.len())
        .map(|s| starts[s]..starts[s] + sizes[s])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_and_listed_splits() {
        assert_eq!(stage_sizes(8, 2, 2, None), vec![2, 2, 2, 2]);
        assert_eq!(stage_sizes(8, 3, 1, None), vec![3, 3, 2]);
        assert_eq!(stage_sizes(8, 2, 1, Some(&[5, 3])), vec![5, 3]);
        let sizes = stage_sizes(8, 2, 2, Some(&[1, 3, 2, 2]));
        let looped = Placement::Looped;
        assert_eq!(rank_chunks(&sizes, 2, 0, looped), vec![0..1, 4..6]);
        assert_eq!(rank_chunks(&sizes, 2, 1, looped), vec![1..4, 6..8]);
        assert_eq!(rank_chunks(&sizes, 2, 0, Placement::V), vec![0..1, 6..8]);
        assert_eq!(rank_chunks(&sizes, 2, 1, Placement::V), vec![1..4, 4..6]);
        let one = stage_sizes(6, 1, 1, None);
        assert_eq!(rank_chunks(&one, 1, 0, looped), vec![0..6]);
    }

    #[test]
    fn refuses_what_the_engine_cannot_run() {
        assert_eq!(check_split(8, 2, 2, None), Ok(()));
        assert_eq!(
            check_split(8, 3, 1, None),
            Err(ScheduleError::LayersNotDivisible {
                layers: 8,
                p: 3,
                v: 1
            })
        );
        assert_eq!(check_split(8, 3, 1, Some(&[3, 3, 2])), Ok(()));
        for bad in [&[4, 4][..], &[8, 0, 0], &[3, 3, 3]] {
            let e = check_split(8, 3, 1, Some(bad)).unwrap_err();
            assert!(e.to_string().contains("needs 3 entries"), "{e}");
        }
        assert_eq!(check_split(8, 0, 1, None), Err(ScheduleError::ZeroStages));
        assert_eq!(
            check_split(8, 1, 0, None),
            Err(ScheduleError::ZeroVirtualStages)
        );
    }
}

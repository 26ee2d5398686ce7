//! Layout-independent initialisation: every full parameter is drawn from its own stream,
//! seeded by (run seed, parameter name). The stream is counter-based, so any element of the
//! full tensor can be drawn on its own: a rank draws exactly the elements of its slice (and
//! under ZeRO-3 of its shard), never the full tensor, and every layout starts from identical
//! weights.

use std::ops::Range;

use crate::layout::Split;
use crate::ParamLayout;

/// FNV-1a of the name mixed with the seed: a stable per-parameter seed.
pub fn param_seed(seed: u64, name: &str) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in name.bytes() {
        hash ^= b as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01B3);
    }
    hash
}

/// SplitMix64: draw `k` of a stream is a pure function of (seed, k).
struct Stream(u64);

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl Stream {
    /// The stream of `seed` positioned before its draw `k`.
    fn at(seed: u64, k: u64) -> Self {
        Stream(seed.wrapping_add(k.wrapping_mul(GOLDEN)))
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// Fills `out` (one whole parameter) with N(0, std²) drawn by Box–Muller from `seed`.
pub fn fill_normal(out: &mut [f32], seed: u64, std: f64) {
    fill_normal_from(out, seed, std, 0);
}

/// Elements `start..start + out.len()` of [`fill_normal`]'s draw, bit for bit: elements
/// `2j` and `2j+1` are the cosine and sine of the pair made of draws `2j` and `2j+1`.
pub fn fill_normal_from(out: &mut [f32], seed: u64, std: f64, start: usize) {
    let mut i = 0;
    while i < out.len() {
        let e = start + i;
        let mut s = Stream::at(seed, (e & !1) as u64);
        let (u1, u2) = (s.unit(), s.unit());
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let th = std::f64::consts::TAU * u2;
        if e.is_multiple_of(2) {
            out[i] = (r * th.cos()) as f32;
            if i + 1 < out.len() {
                out[i + 1] = (r * th.sin()) as f32;
            }
            i += 2;
        } else {
            out[i] = (r * th.sin()) as f32;
            i += 1;
        }
    }
}

/// Initialises the flat buffer `out` (this rank's `layout.total` elements) with this rank's
/// slice of every full parameter.
pub fn init_params(layout: &ParamLayout, seed: u64, out: &mut [f32]) {
    init_range(layout, seed, 0..layout.total, out);
}

/// Elements `range` of the flat buffer [`init_params`] fills, into `out`
/// (`range.len()` elements), drawing only those elements.
pub fn init_range(layout: &ParamLayout, seed: u64, range: Range<usize>, out: &mut [f32]) {
    assert_eq!(out.len(), range.len(), "init_range: output length");
    assert!(
        range.end <= layout.total,
        "init_range: {range:?} beyond the layout's {} elements",
        layout.total
    );
    let (t, r) = (layout.tp, layout.tp_rank);
    // Parameters lie in the flat buffer in order: skip to the first that reaches `range`.
    let first = layout
        .params
        .partition_point(|p| p.range().end <= range.start);
    for spec in &layout.params[first..] {
        let own = spec.range();
        if own.start >= range.end {
            break;
        }
        let (lo, hi) = (own.start.max(range.start), own.end.min(range.end));
        if lo >= hi {
            continue;
        }
        let dst = &mut out[lo - range.start..hi - range.start];
        let std = match spec.init_std {
            None => {
                dst.fill(1.0);
                continue;
            }
            Some(0.0) => {
                dst.fill(0.0);
                continue;
            }
            Some(std) => std,
        };
        let seed = param_seed(seed, &spec.name);
        // Offsets inside this rank's slice, and where its rows start in the full tensor.
        let (a, b) = (lo - own.start, hi - own.start);
        match spec.split {
            Split::Replicated => fill_normal_from(dst, seed, std, a),
            Split::Rows => {
                // Element `a` of the slice is full element r·len + a; a padded slice's rows
                // past the full shape (the vocabulary under TP) stay zero.
                let full = spec.full_shape.iter().product::<usize>();
                let real = full.saturating_sub(r * own.len() + a).min(b - a);
                fill_normal_from(&mut dst[..real], seed, std, r * own.len() + a);
                dst[real..].fill(0.0);
            }
            Split::Cols => {
                // Local row i, column k is full element i·cols + r·c + k.
                let cols = spec.full_shape[1];
                let c = cols / t;
                let mut at = a;
                while at < b {
                    let (row, k) = (at / c, at % c);
                    let n = (c - k).min(b - at);
                    let full = row * cols + r * c + k;
                    fill_normal_from(&mut dst[at - a..at - a + n], seed, std, full);
                    at += n;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_draw_has_the_requested_moments() {
        let mut x = vec![0.0f32; 100_000];
        fill_normal(&mut x, 3, 0.02);
        let mean = x.iter().map(|v| *v as f64).sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / x.len() as f64;
        assert!(mean.abs() < 3e-4, "{mean}");
        assert!((var.sqrt() - 0.02).abs() < 3e-4, "{}", var.sqrt());
    }

    /// The generator as it was first written: one sequential stream, pairs in order. Every
    /// checkpoint and test of the project was drawn with it.
    fn sequential_reference(out: &mut [f32], seed: u64, std: f64) {
        let mut s = Stream(seed);
        for pair in out.chunks_mut(2) {
            let (u1, u2) = (s.unit(), s.unit());
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let th = std::f64::consts::TAU * u2;
            pair[0] = (r * th.cos()) as f32;
            if pair.len() > 1 {
                pair[1] = (r * th.sin()) as f32;
            }
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn any_range_of_the_draw_equals_the_sequential_draw() {
        let mut whole = vec![0.0f32; 101];
        sequential_reference(&mut whole, 7, 0.5);
        let mut again = vec![0.0f32; 101];
        fill_normal(&mut again, 7, 0.5);
        assert_eq!(bits(&again), bits(&whole));
        for (start, len) in [
            (0, 101),
            (1, 5),
            (2, 1),
            (3, 0),
            (50, 51),
            (99, 2),
            (100, 1),
        ] {
            let mut part = vec![0.0f32; len];
            fill_normal_from(&mut part, 7, 0.5, start);
            assert_eq!(
                bits(&part),
                bits(&whole[start..start + len]),
                "{start}+{len}"
            );
        }
    }

    /// Ranges of a rank's flat buffer, drawn alone, equal the full tensors drawn whole and
    /// sliced — for every tensor-parallel rank, with ranges that start and end inside
    /// parameters and inside rows of column-split matrices.
    #[test]
    fn a_range_of_a_rank_equals_the_sliced_full_draw() {
        let mut c = ferrotron_config::Config::default();
        c.model.hidden = 32;
        c.model.ffn = 64;
        c.model.heads = 4;
        c.model.kv_heads = 4;
        c.model.layers = 2;
        for tp in [1, 2, 4] {
            for rank in 0..tp {
                let layout = ParamLayout::tensor_parallel(&c.model, tp, rank);
                let mut want = vec![0.0f32; layout.total];
                for spec in &layout.params {
                    let dst = &mut want[spec.range()];
                    match spec.init_std {
                        Some(std) => {
                            let mut full = vec![0.0f32; spec.full_shape.iter().product()];
                            sequential_reference(&mut full, param_seed(9, &spec.name), std);
                            layout.slice_into(spec, &full, dst);
                        }
                        None => dst.fill(1.0),
                    }
                }
                let n = layout.total;
                for (a, b) in [(0, n), (1, n - 1), (7, 7), (5, 200), (n / 3, n / 2 + 13)] {
                    let mut got = vec![0.0f32; b - a];
                    init_range(&layout, 9, a..b, &mut got);
                    assert_eq!(
                        bits(&got),
                        bits(&want[a..b]),
                        "tp {tp} rank {rank} {a}..{b}"
                    );
                }
                // Chunk by chunk, as a rank fills its weights.
                let mut got = vec![0.0f32; n];
                for start in (0..n).step_by(37) {
                    let end = (start + 37).min(n);
                    init_range(&layout, 9, start..end, &mut got[start..end]);
                }
                assert_eq!(bits(&got), bits(&want), "tp {tp} rank {rank} in chunks");
            }
        }
    }

    #[test]
    fn layout_parameters_lie_in_flat_order() {
        // `init_range` relies on it to find the first parameter of a range.
        let mut c = ferrotron_config::Config::default();
        c.model.experts = 4;
        let later_stage = crate::StageParts {
            layers: (1..c.model.layers).collect(),
            embed: false,
            head: true,
        };
        let shard = crate::Shard {
            tp: 2,
            tp_rank: 1,
            ep: 2,
            ep_rank: 1,
        };
        for layout in [
            ParamLayout::tensor_parallel(&c.model, 2, 1),
            ParamLayout::sharded(&c.model, shard, &later_stage),
        ] {
            let mut end = 0;
            for p in &layout.params {
                assert_eq!(p.offset, end, "{}", p.name);
                end = p.range().end;
            }
            assert_eq!(end, layout.total);
        }
    }

    #[test]
    fn seed_depends_on_name_only_through_the_name() {
        assert_eq!(param_seed(1, "a"), param_seed(1, "a"));
        assert_ne!(param_seed(1, "a"), param_seed(1, "b"));
        assert_ne!(param_seed(1, "a"), param_seed(2, "a"));
    }
}

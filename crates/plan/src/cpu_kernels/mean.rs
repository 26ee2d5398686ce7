//! Two timings of the same kernels averaged: `validate-cost` times a layout's kernels
//! before and after its run, so that a machine whose speed drifts over seconds moves the
//! prediction as it moved the run.

use super::KernelRates;

/// The mean of `a` and, where `b` times the same shape, `b`.
fn mean_of<S: PartialEq + Copy, T: Copy>(
    a: &[(S, T)],
    b: &[(S, T)],
    avg: impl Fn(T, T) -> T,
) -> Vec<(S, T)> {
    a.iter()
        .map(|&(s, x)| match b.iter().find(|(t, _)| *t == s) {
            Some(&(_, y)) => (s, avg(x, y)),
            None => (s, x),
        })
        .collect()
}

/// [`mean_of`] for shapes timed forward and backward.
fn mean_of_pairs<S: PartialEq + Copy>(
    a: &[(S, f64, f64)],
    b: &[(S, f64, f64)],
) -> Vec<(S, f64, f64)> {
    a.iter()
        .map(|&(s, f, w)| match b.iter().find(|(t, ..)| *t == s) {
            Some(&(_, g, x)) => (s, avg(f, g), avg(w, x)),
            None => (s, f, w),
        })
        .collect()
}

/// The mean of two rates or times; a side that was not measured (0) leaves the other.
fn avg(x: f64, y: f64) -> f64 {
    match (x > 0.0, y > 0.0) {
        (true, true) => 0.5 * (x + y),
        (true, false) => x,
        _ => y,
    }
}

impl KernelRates {
    /// Every time and rate the mean of this timing's and `other`'s (shapes only this one
    /// timed keep their time; shapes only `other` timed are left out). The threads and
    /// cores are this timing's.
    pub fn mean(&self, other: &KernelRates) -> KernelRates {
        KernelRates {
            threads: self.threads,
            cores: self.cores,
            gemm: mean_of(&self.gemm, &other.gemm, avg),
            attention: mean_of_pairs(&self.attention, &other.attention),
            elementwise: mean_of_pairs(&self.elementwise, &other.elementwise),
            head: mean_of(&self.head, &other.head, avg),
            bandwidth: avg(self.bandwidth, other.bandwidth),
            call_s: avg(self.call_s, other.call_s),
            wake_s: avg(self.wake_s, other.wake_s),
            zero_fill: avg(self.zero_fill, other.zero_fill),
            skew: if self.skew.len() == other.skew.len()
                && self.skew.iter().zip(&other.skew).all(|(a, b)| a.0 == b.0)
            {
                self.skew
                    .iter()
                    .zip(&other.skew)
                    .map(|(a, b)| (a.0, 0.5 * (a.1 + b.1)))
                    .collect()
            } else {
                self.skew.clone()
            },
            peak_flops: avg(self.peak_flops, other.peak_flops),
        }
    }
}

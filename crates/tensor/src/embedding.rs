//! Token embedding lookup.

use rayon::prelude::*;

/// `x[r] = table[tokens[r]]` for rows of width `h`.
pub fn embedding_forward(x: &mut [f32], table: &[f32], tokens: &[u32], h: usize) {
    x.par_chunks_mut(h)
        .zip(tokens.par_iter())
        .for_each(|(row, &t)| {
            let t = t as usize;
            row.copy_from_slice(&table[t * h..(t + 1) * h]);
        });
}

/// `dtable[tokens[r]] += dx[r]`. Serial: rows may share a token.
pub fn embedding_backward(dtable: &mut [f32], dx: &[f32], tokens: &[u32], h: usize) {
    for (row, &t) in dx.chunks(h).zip(tokens) {
        let t = t as usize;
        dtable[t * h..(t + 1) * h]
            .iter_mut()
            .zip(row)
            .for_each(|(d, g)| *d += g);
    }
}

/// Vocabulary-parallel embedding forward: rows of tokens this rank's slice `[v0, v0+vl)`
/// holds, zeros elsewhere (the partial sums tensor parallelism's `f̄` reduces).
pub fn embedding_forward_slice(x: &mut [f32], table: &[f32], tokens: &[u32], h: usize, v0: usize) {
    let vl = table.len() / h;
    x.par_chunks_mut(h)
        .zip(tokens.par_iter())
        .for_each(|(row, &t)| {
            let t = t as usize;
            if (v0..v0 + vl).contains(&t) {
                row.copy_from_slice(&table[(t - v0) * h..(t - v0 + 1) * h]);
            } else {
                row.fill(0.0);
            }
        });
}

/// Vocabulary-parallel embedding backward: accumulates the rows this rank owns.
pub fn embedding_backward_slice(
    dtable: &mut [f32],
    dx: &[f32],
    tokens: &[u32],
    h: usize,
    v0: usize,
) {
    let vl = dtable.len() / h;
    for (row, &t) in dx.chunks(h).zip(tokens) {
        let t = t as usize;
        if (v0..v0 + vl).contains(&t) {
            dtable[(t - v0) * h..(t - v0 + 1) * h]
                .iter_mut()
                .zip(row)
                .for_each(|(d, g)| *d += g);
        }
    }
}

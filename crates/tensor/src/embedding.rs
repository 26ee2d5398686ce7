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

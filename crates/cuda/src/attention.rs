//! Attention's launches on the CUDA backend: whole sequences (as batched products with a
//! score scratch, else as one ring block) and ring blocks on the tiled kernels (head_dim ≤
//! [`ATTENTION_TILE_DIM`]) or one warp per row past it. The `Backend` methods of
//! `kernels.rs` call these.

use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::kernels::{AttentionKernels, Elementwise};
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::{AttnGrads, DeviceSlice, KvBlock, RingBlock};

use crate::backend::{block_shape, full_block, CudaBackend};
use crate::launch::{at, at_mut, elementwise, launch, tiles, warp_per_row, ATTENTION_TILE_DIM};
use crate::score_attention::{Backward, Forward};

impl CudaBackend {
    /// Whole sequences: as batched products where the rank has a score scratch
    /// (`train.attention = "products"`), else one ring block with positions `0..seq`.
    pub(crate) fn whole_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        shape: AttnShape,
    ) {
        let t = Forward {
            out: at_mut(out),
            lse: at_mut(lse),
            q: at(q),
            k: at(k),
            v: at(v),
        };
        if !self.forward_by_products(t, shape) {
            let pos: Vec<usize> = (0..shape.seq).collect();
            let block = KvBlock {
                q_pos: &pos,
                kv_pos: &pos,
                q_start: None,
                shape: full_block(shape),
            };
            self.attention_block_forward(out, lse, q, k, v, block)
        }
    }
    /// Whole sequences' backward: `delta`, then as batched products or as one ring block.
    pub(crate) fn whole_backward(
        &self,
        g: AttnGrads<'_>,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        saved: AttnSaved<'_, DeviceSlice<f32>>,
        shape: AttnShape,
    ) {
        // Whole sequences are one ring block with positions 0..seq on both sides.
        let bs = full_block(shape);
        self.attention_delta(delta, dout, saved.out, bs);
        let t = Backward {
            dq: at_mut(g.dq),
            dk: at_mut(g.dk),
            dv: at_mut(g.dv),
            dout: at(dout),
            q: at(saved.q),
            k: at(saved.k),
            v: at(saved.v),
            lse: at(saved.lse),
            delta: at(delta),
        };
        if self.backward_by_products(t, shape) {
            return;
        }
        self.fill(g.dq, 0.0);
        let pos: Vec<usize> = (0..shape.seq).collect();
        let saved = RingBlock {
            q: saved.q,
            k: saved.k,
            v: saved.v,
            lse: saved.lse,
            delta,
        };
        let block = KvBlock {
            q_pos: &pos,
            kv_pos: &pos,
            q_start: None,
            shape: bs,
        };
        self.attention_block_backward(g, dout, saved, block)
    }
    /// One key/value block on the tiled kernels (head_dim ≤ [`ATTENTION_TILE_DIM`]) or one
    /// warp per query row.
    pub(crate) fn block_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        block: KvBlock<'_>,
    ) {
        let sh = block.shape;
        let s = block_shape(sh);
        let (qp, kp) = (self.upload_u32(block.q_pos), self.upload_u32(block.kv_pos));
        let starts = block.q_start.map(|st| self.upload_u32(st));
        let qs = starts.as_ref().map_or(0u64, |st| st.ptr());
        let scale = 1.0 / (sh.head_dim as f32).sqrt();
        if sh.head_dim <= ATTENTION_TILE_DIM {
            launch!(self, "attention_tile_forward", tiles(sh.q_len, sh.heads, sh.batch);
                at_mut(out), at_mut(lse), at(q), at(k), at(v), qp.ptr(), kp.ptr(), qs, s, scale);
            return;
        }
        let rows = sh.batch * sh.heads * sh.q_len;
        launch!(self, "attention_block_forward", warp_per_row(rows);
            at_mut(out), at_mut(lse), at(q), at(k), at(v), qp.ptr(), kp.ptr(), qs, s, scale);
    }
    /// One key/value block's backward: query gradients, then key and value gradients.
    pub(crate) fn block_backward(
        &self,
        g: AttnGrads<'_>,
        dout: &DeviceSlice<f32>,
        s: RingBlock<'_>,
        block: KvBlock<'_>,
    ) {
        let sh = block.shape;
        let shape = block_shape(sh);
        let (qp, kp) = (self.upload_u32(block.q_pos), self.upload_u32(block.kv_pos));
        let starts = block.q_start.map(|st| self.upload_u32(st));
        let qs = starts.as_ref().map_or(0u64, |st| st.ptr());
        let (dq, dk, dv) = (g.dq, g.dk, g.dv);
        let scale = 1.0 / (sh.head_dim as f32).sqrt();
        if sh.head_dim <= ATTENTION_TILE_DIM {
            launch!(self, "attention_tile_backward_q", tiles(sh.q_len, sh.heads, sh.batch);
                at_mut(dq), at(dout), at(s.q), at(s.k), at(s.v), at(s.lse), at(s.delta),
                qp.ptr(), kp.ptr(), qs, shape, scale);
            launch!(self, "attention_tile_backward_kv", tiles(sh.kv_len, sh.kv_heads, sh.batch);
                at_mut(dk), at_mut(dv), at(dout), at(s.q), at(s.k), at(s.v), at(s.lse), at(s.delta),
                qp.ptr(), kp.ptr(), qs, shape, scale);
            return;
        }
        launch!(self, "attention_block_backward_q", warp_per_row(sh.batch * sh.heads * sh.q_len);
            at_mut(dq), at(dout), at(s.q), at(s.k), at(s.v), at(s.lse), at(s.delta),
            qp.ptr(), kp.ptr(), qs, shape, scale);
        launch!(self, "attention_block_backward_kv", warp_per_row(sh.batch * sh.kv_heads * sh.kv_len);
            at_mut(dk), at_mut(dv), at(dout), at(s.q), at(s.k), at(s.v), at(s.lse), at(s.delta),
            qp.ptr(), kp.ptr(), qs, shape, scale);
    }
    /// Merges a partial result into `out`, `lse` with the online softmax.
    pub(crate) fn merge_partial(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        part_out: &DeviceSlice<f32>,
        part_lse: &DeviceSlice<f32>,
        sh: BlockShape,
    ) {
        let s = block_shape(sh);
        let n = out.len();
        launch!(self, "attention_merge", elementwise(n); at_mut(out), at(lse), at(part_out), at(part_lse), s);
        let rows = lse.len();
        launch!(self, "attention_merge_lse", elementwise(rows); at_mut(lse), at(part_lse), rows as u64);
    }
    /// `delta = rowsum(dout ∘ out)`, one warp per row.
    pub(crate) fn delta_of(
        &self,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        out: &DeviceSlice<f32>,
        sh: BlockShape,
    ) {
        let rows = sh.batch * sh.heads * sh.q_len;
        launch!(self, "attention_delta", warp_per_row(rows); at_mut(delta), at(dout), at(out), block_shape(sh));
    }
}

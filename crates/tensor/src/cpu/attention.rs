//! The CPU backend's attention kernels: whole causal sequences, ring attention's blocks, RoPE.

use super::CpuBackend;
use crate::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};
use crate::backend::{AttnGrads, KvBlock, RingBlock};
use crate::kernels::AttentionKernels;
use crate::ring_attention::{self, BlockShape};
use crate::rope::{rope_apply, RopeTable};
use crate::DeviceSlice;

impl AttentionKernels for CpuBackend {
    fn rope(
        &self,
        x: &mut DeviceSlice<f32>,
        positions: &[usize],
        heads: usize,
        table: &RopeTable,
        inverse: bool,
    ) {
        rope_apply(x.host_mut(), positions, heads, table, inverse)
    }
    fn attention_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        shape: AttnShape,
    ) {
        let (q, k, v) = (q.host(), k.host(), v.host());
        attention_forward(out.host_mut(), lse.host_mut(), q, k, v, shape)
    }
    fn attention_backward(
        &self,
        g: AttnGrads<'_>,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        saved: AttnSaved<'_, DeviceSlice<f32>>,
        shape: AttnShape,
    ) {
        let (dq, dk, dv) = (g.dq.host_mut(), g.dk.host_mut(), g.dv.host_mut());
        let (delta, dout) = (delta.host_mut(), dout.host());
        attention_backward(dq, dk, dv, delta, dout, saved.host(), shape)
    }
    fn attention_block_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        b: KvBlock<'_>,
    ) {
        let (out, lse, q, k, v) = (out.host_mut(), lse.host_mut(), q.host(), k.host(), v.host());
        ring_attention::block_forward(out, lse, q, k, v, b)
    }
    fn attention_merge(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        part_out: &DeviceSlice<f32>,
        part_lse: &DeviceSlice<f32>,
        sh: BlockShape,
    ) {
        let (out, lse) = (out.host_mut(), lse.host_mut());
        ring_attention::merge_partial(out, lse, part_out.host(), part_lse.host(), sh)
    }
    fn attention_delta(
        &self,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        out: &DeviceSlice<f32>,
        sh: BlockShape,
    ) {
        ring_attention::attention_delta(delta.host_mut(), dout.host(), out.host(), sh)
    }
    fn attention_block_backward(
        &self,
        g: AttnGrads<'_>,
        dout: &DeviceSlice<f32>,
        s: RingBlock<'_>,
        b: KvBlock<'_>,
    ) {
        ring_attention::block_backward(
            g.dq.host_mut(),
            g.dk.host_mut(),
            g.dv.host_mut(),
            dout.host(),
            s.q.host(),
            s.k.host(),
            s.v.host(),
            s.lse.host(),
            s.delta.host(),
            b,
        )
    }
}

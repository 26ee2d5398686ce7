//! The CPU backend's element-wise kernels: SwiGLU, embeddings, residual adds, copies, fills
//! and casts.

use super::CpuBackend;
use crate::elementwise::{self, add};
use crate::embedding::{
    embedding_backward, embedding_backward_slice, embedding_forward, embedding_forward_slice,
};
use crate::fp8::{apply_scales, group_amax, Fp8Quant};
use crate::kernels::Elementwise;
use crate::store::{round_f16_into, round_into, widen_f16_into, widen_into};
use crate::swiglu::{swiglu_backward, swiglu_forward};
use crate::{bf16, f16, DeviceSlice};

impl Elementwise for CpuBackend {
    fn swiglu_forward(
        &self,
        act: &mut DeviceSlice<f32>,
        gate: &DeviceSlice<f32>,
        up: &DeviceSlice<f32>,
    ) {
        swiglu_forward(act.host_mut(), gate.host(), up.host())
    }
    fn swiglu_backward(
        &self,
        dgate: &mut DeviceSlice<f32>,
        dup: &mut DeviceSlice<f32>,
        dact: &DeviceSlice<f32>,
        gate: &DeviceSlice<f32>,
        up: &DeviceSlice<f32>,
    ) {
        let (dg, du) = (dgate.host_mut(), dup.host_mut());
        swiglu_backward(dg, du, dact.host(), gate.host(), up.host())
    }
    fn embedding_forward(
        &self,
        x: &mut DeviceSlice<f32>,
        table: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
    ) {
        embedding_forward(x.host_mut(), table.host(), tokens.host(), h)
    }
    fn embedding_backward(
        &self,
        dtable: &mut DeviceSlice<f32>,
        dx: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
    ) {
        embedding_backward(dtable.host_mut(), dx.host(), tokens.host(), h)
    }
    fn embedding_forward_slice(
        &self,
        x: &mut DeviceSlice<f32>,
        table: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
        v0: usize,
    ) {
        embedding_forward_slice(x.host_mut(), table.host(), tokens.host(), h, v0)
    }
    fn embedding_backward_slice(
        &self,
        dtable: &mut DeviceSlice<f32>,
        dx: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
        v0: usize,
    ) {
        embedding_backward_slice(dtable.host_mut(), dx.host(), tokens.host(), h, v0)
    }
    fn add(&self, out: &mut DeviceSlice<f32>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>) {
        add(out.host_mut(), a.host(), b.host())
    }
    fn copy(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>) {
        elementwise::copy(dst.host_mut(), src.host())
    }
    fn copy_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<bf16>) {
        elementwise::copy(dst.host_mut(), src.host())
    }
    fn fill(&self, dst: &mut DeviceSlice<f32>, value: f32) {
        elementwise::fill(dst.host_mut(), value)
    }
    fn fill_bf16(&self, dst: &mut DeviceSlice<bf16>, value: bf16) {
        elementwise::fill(dst.host_mut(), value)
    }
    fn add_assign(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>) {
        elementwise::add_assign(dst.host_mut(), src.host())
    }
    fn add_assign_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>) {
        elementwise::add_assign_bf16(dst.host_mut(), src.host())
    }
    fn scale(&self, dst: &mut DeviceSlice<f32>, s: f32) {
        elementwise::scale(dst.host_mut(), s)
    }
    fn round_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>) {
        round_into(dst.host_mut(), src.host())
    }
    fn widen_bf16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<bf16>) {
        widen_into(dst.host_mut(), src.host())
    }
    fn fill_f16(&self, dst: &mut DeviceSlice<f16>, value: f16) {
        elementwise::fill(dst.host_mut(), value)
    }
    fn add_assign_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>) {
        elementwise::add_assign_f16(dst.host_mut(), src.host())
    }
    fn round_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>) {
        round_f16_into(dst.host_mut(), src.host())
    }
    fn widen_f16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f16>) {
        widen_f16_into(dst.host_mut(), src.host())
    }
    fn fp8_amax(&self, out: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, q: Fp8Quant) {
        group_amax(out.host_mut(), src.host(), q)
    }
    fn fp8_apply(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        amax: &DeviceSlice<f32>,
        q: Fp8Quant,
    ) {
        apply_scales(dst.host_mut(), src.host(), amax.host(), q)
    }
}

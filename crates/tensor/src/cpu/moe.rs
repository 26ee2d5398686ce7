//! The CPU backend's mixture-of-experts kernels: routing, its statistics, and the rows'
//! way to and from the experts.

use super::CpuBackend;
use crate::backend::{AuxLoss, RouteShape, Routed};
use crate::kernels::MoeKernels;
use crate::moe::{self, AuxStats, Dispatch, Routing};
use crate::{DeviceSlice, Ledger};

impl MoeKernels for CpuBackend {
    fn moe_route(
        &self,
        ledger: &Ledger,
        logits: &DeviceSlice<f32>,
        bias: Option<&[f32]>,
        sh: RouteShape,
    ) -> Routing {
        let routing = moe::route_biased(logits.host(), bias, sh.t, sh.experts, sh.top_k);
        ledger.count_to_host("expert routing", routing.heap_bytes());
        routing
    }
    fn moe_route_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        d_gates: &DeviceSlice<f32>,
        routing: &Routing,
        sh: RouteShape,
    ) {
        let (dl, dg) = (d_logits.host_mut(), d_gates.host());
        moe::route_backward(dl, dg, routing, sh.t, sh.experts, sh.top_k)
    }
    fn moe_aux_stats(&self, routing: &Routing, sh: RouteShape) -> AuxStats {
        moe::aux_stats(routing, sh.t, sh.experts, sh.top_k)
    }
    fn moe_aux_loss_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        aux: AuxLoss<'_>,
        routing: &Routing,
        sh: RouteShape,
    ) {
        let AuxLoss {
            coef,
            stats,
            tokens,
        } = aux;
        let dl = d_logits.host_mut();
        moe::aux_loss_backward(dl, coef, stats, tokens, routing, sh.t, sh.experts)
    }
    fn moe_gather_rows(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        h: usize,
        dispatch: &Dispatch,
    ) {
        moe::gather_rows(dst.host_mut(), src.host(), h, dispatch)
    }
    fn moe_scatter_add_rows(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        h: usize,
        dispatch: &Dispatch,
    ) {
        moe::scatter_add_rows(dst.host_mut(), src.host(), h, dispatch)
    }
    fn moe_combine_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        r: Routed<'_>,
    ) {
        let (out, eo) = (out.host_mut(), expert_out.host());
        moe::combine_forward(out, eo, h, r.routing, r.dispatch)
    }
    fn moe_combine_backward(
        &self,
        d_expert_out: &mut DeviceSlice<f32>,
        d_gates: &mut DeviceSlice<f32>,
        d_out: &DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        r: Routed<'_>,
    ) {
        let (deo, dg) = (d_expert_out.host_mut(), d_gates.host_mut());
        let (dout, eo) = (d_out.host(), expert_out.host());
        moe::combine_backward(deo, dg, dout, eo, h, r.routing, r.dispatch)
    }
}

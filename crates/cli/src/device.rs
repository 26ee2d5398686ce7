//! `--device` of `generate` and `eval`; the backends themselves are `ferrotron_devices`'.

use ferrotron_config::Device;

/// Where `generate` and `eval` run a model (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceArg {
    /// The host.
    #[default]
    Cpu,
    /// GPU 0, through CUDA (a build with `--features cuda`).
    Cuda,
}

/// The backend `--device` names (see [`ferrotron_devices::inference_backend`]).
pub fn inference_backend(
    device: DeviceArg,
) -> anyhow::Result<std::sync::Arc<dyn ferrotron_devices::Backend>> {
    let device = match device {
        DeviceArg::Cpu => Device::Cpu,
        DeviceArg::Cuda => Device::Cuda,
    };
    Ok(ferrotron_devices::inference_backend(device)?)
}

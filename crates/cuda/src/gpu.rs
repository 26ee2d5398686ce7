//! One GPU as the ranks on it share it: its CUDA context and the step's kernels, compiled once
//! per run with NVRTC for the device's architecture and loaded once.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use crate::nvrtc::{self, CompileError};
use crate::SOURCES;

/// Why a GPU could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The driver library could not be loaded or initialised.
    #[error(
        "could not use the CUDA driver (libcuda.so): {0}. Install the NVIDIA driver (the \
         `nvidia-smi` command shows it), or set train.device = \"cpu\""
    )]
    Driver(String),
    /// The requested device does not exist.
    #[error("GPU {ordinal} does not exist: this machine has {count} (CUDA_VISIBLE_DEVICES may hide some)")]
    NoDevice {
        /// Requested device.
        ordinal: usize,
        /// Devices visible.
        count: usize,
    },
    /// A kernel source did not compile.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// A compiled module or one of its kernels could not be loaded.
    #[error("loading the {source_name} kernels on GPU {ordinal}: {message}")]
    Load {
        /// The source's name.
        source_name: &'static str,
        /// Device.
        ordinal: usize,
        /// The driver's message.
        message: String,
    },
    /// cuBLASLt could not be loaded or initialised.
    #[error(
        "could not use cuBLASLt (libcublasLt.so.13): {0}. Install the CUDA 13 toolkit's \
         libraries or `pip install nvidia-cublas` and add its lib folder to LD_LIBRARY_PATH"
    )]
    Blas(String),
    /// Another CUDA call failed while setting up a rank.
    #[error("CUDA {what} failed on GPU {ordinal}: {message}")]
    Call {
        /// The call.
        what: &'static str,
        /// Device.
        ordinal: usize,
        /// The driver's message.
        message: String,
    },
}

/// Runs `f`, turning cudarc's panic when a dynamically loaded library is missing (and the
/// library's own error) into a message.
pub(crate) fn loaded<T, E: std::fmt::Display>(
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Err(panic) => Err(nvrtc::panic_message(&*panic)),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(v)) => Ok(v),
    }
}

/// A GPU: its context and every kernel of the step, by name.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    arch: String,
    functions: HashMap<&'static str, CudaFunction>,
    /// Byte size of every parameter of every kernel, from its PTX.
    params: HashMap<&'static str, Vec<usize>>,
}

/// Byte sizes of the parameters of `kernel` in `ptx` (`.param .u64 …`, `.param .align 4 .b8
/// name[24]` for a struct by value), or `None` when the PTX has no such entry.
pub fn ptx_params(ptx: &str, kernel: &str) -> Option<Vec<usize>> {
    let start = ptx.find(&format!(".entry {kernel}("))?;
    let list = &ptx[start..];
    let list = &list[list.find('(')? + 1..list.find(')')?];
    let size = |param: &str| -> usize {
        if let (Some(a), Some(b)) = (param.find('['), param.find(']')) {
            return param[a + 1..b].trim().parse().unwrap_or(0);
        }
        let ty = param.split_whitespace().find(|t| {
            t.len() > 2 && t.starts_with('.') && t[2..].chars().all(|c| c.is_ascii_digit())
        });
        ty.and_then(|t| t[2..].parse::<usize>().ok())
            .map_or(0, |bits| bits / 8)
    };
    Some(
        list.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(size)
            .collect(),
    )
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GPU {} ({}, {})", self.ordinal, self.name, self.arch)
    }
}

impl Gpu {
    /// Number of GPUs the driver sees.
    pub fn count() -> Result<usize, GpuError> {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::Driver(
                "libcuda.so is not on the loader's path".into(),
            ));
        }
        loaded(CudaContext::device_count)
            .map(|n| n.max(0) as usize)
            .map_err(GpuError::Driver)
    }

    /// Opens GPU `ordinal`: its primary context, and the kernels compiled for its
    /// architecture (`sm_XY` from its compute capability) and loaded.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, GpuError> {
        let count = Gpu::count()?;
        if ordinal >= count {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = loaded(|| CudaContext::new(ordinal)).map_err(GpuError::Driver)?;
        let call = |what: &'static str| {
            move |message: String| GpuError::Call {
                what,
                ordinal,
                message,
            }
        };
        let (major, minor) = loaded(|| ctx.compute_capability()).map_err(call("device query"))?;
        let name = loaded(|| ctx.name()).map_err(call("device query"))?;
        let arch = format!("sm_{major}{minor}");
        let (mut functions, mut params) = (HashMap::new(), HashMap::new());
        for source in &SOURCES {
            let ptx = nvrtc::compile(source, &arch)?;
            for &kernel in source.kernels {
                params.insert(kernel, ptx_params(&ptx, kernel).unwrap_or_default());
            }
            let load = |message: String| GpuError::Load {
                source_name: source.name,
                ordinal,
                message,
            };
            let module = loaded(|| ctx.load_module(Ptx::from_src(ptx))).map_err(load)?;
            for &kernel in source.kernels {
                let f = loaded(|| module.load_function(kernel)).map_err(load)?;
                functions.insert(kernel, f);
            }
        }
        Ok(Arc::new(Gpu {
            ctx,
            ordinal,
            name,
            arch,
            functions,
            params,
        }))
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Device number.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture the kernels were compiled for, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> usize {
        self.ctx.total_mem().unwrap_or(0)
    }

    /// Checks the byte sizes of a launch's arguments against the kernel's PTX parameters.
    ///
    /// # Panics
    /// On a mismatch, naming the kernel: arguments that do not match would be read as garbage.
    pub(crate) fn check_args(&self, name: &str, sizes: &[usize]) {
        let want = self.params.get(name).map(Vec::as_slice).unwrap_or_default();
        assert_eq!(
            sizes, want,
            "CUDA kernel {name}: argument sizes {sizes:?} do not match its parameters {want:?}"
        );
    }

    /// The kernel `name` (one of [`crate::SOURCES`]' kernels).
    ///
    /// # Panics
    /// If no source defines it (a bug of the backend, caught by the GPU check).
    pub(crate) fn function(&self, name: &str) -> &CudaFunction {
        self.functions
            .get(name)
            .unwrap_or_else(|| panic!("no CUDA kernel named {name}"))
    }
}

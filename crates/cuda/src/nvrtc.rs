//! Compiling the kernel sources to PTX with NVRTC, loaded at run time by cudarc: no CUDA
//! installation is needed to build, only `libnvrtc` to compile (the `nvidia-cuda-nvrtc`
//! wheel provides it; put its `lib` folder on the loader's path).

use crate::Source;

/// Why a source did not become PTX.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// NVRTC could not be loaded.
    #[error(
        "could not load NVRTC (libnvrtc): {0}. Install the CUDA toolkit or \
         `pip install nvidia-cuda-nvrtc==13.0.88` and add its nvidia/cu13/lib folder to \
         LD_LIBRARY_PATH"
    )]
    Library(String),
    /// The source did not compile.
    #[error("{source_name}.cu for {arch} did not compile:\n{log}")]
    Source {
        /// The source's name.
        source_name: &'static str,
        /// The target architecture, e.g. `sm_90`.
        arch: String,
        /// NVRTC's message.
        log: String,
    },
}

/// PTX of `source` for the GPU architecture `arch` (e.g. `sm_90`).
pub fn compile(source: &Source, arch: &str) -> Result<String, CompileError> {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CompileError::Library(
            "libnvrtc.so is not on the loader's path".into(),
        ));
    }
    let program = source.program();
    let mut opts = cudarc::nvrtc::CompileOptions::default();
    opts.options.push(format!("--gpu-architecture={arch}"));
    opts.options.push("--std=c++17".into());
    // cudarc panics when the library cannot be loaded: that becomes an error naming it.
    let outcome = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(program, opts));
    match outcome {
        Err(panic) => Err(CompileError::Library(panic_message(&*panic))),
        Ok(Err(e)) => Err(CompileError::Source {
            source_name: source.name,
            arch: arch.into(),
            log: e.to_string(),
        }),
        Ok(Ok(ptx)) => Ok(ptx.to_src()),
    }
}

pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown failure".into())
}

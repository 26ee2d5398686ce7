//! Every kernel source compiles with NVRTC for every target architecture, and its PTX has an
//! entry point for each kernel the index lists. Needs `libnvrtc` (CI installs the
//! `nvidia-cuda-nvrtc` wheel); no GPU.

#![cfg(feature = "cuda")]

use ferrotron_cuda::nvrtc::compile;
use ferrotron_cuda::{ARCHS, SOURCES};

#[test]
fn every_kernel_compiles_for_every_architecture() {
    for arch in ARCHS {
        for source in SOURCES {
            let ptx = compile(&source, arch).unwrap_or_else(|e| panic!("{e}"));
            let target = format!(".target {arch}");
            assert!(
                ptx.contains(&target),
                "{}.cu: no `{target}` in the PTX",
                source.name
            );
            for kernel in source.kernels {
                let entry = format!(".entry {kernel}(");
                assert!(
                    ptx.contains(&entry),
                    "{}.cu for {arch}: no {kernel}",
                    source.name
                );
            }
        }
    }
}

#[test]
fn a_source_with_an_error_is_reported_with_nvrtcs_message() {
    let broken = ferrotron_cuda::Source {
        name: "broken",
        text: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        kernels: &["k"],
    };
    let err = compile(&broken, "sm_80").unwrap_err().to_string();
    assert!(
        err.contains("broken.cu for sm_80") && err.contains("undefined_name"),
        "{err}"
    );
}

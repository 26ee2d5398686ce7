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

#[test]
fn ptx_parameters_have_the_sizes_the_launches_pass() {
    use ferrotron_cuda::gpu::ptx_params;
    let src = |name: &str| SOURCES.iter().find(|s| s.name == name).copied().unwrap();
    let attn = compile(&src("attention"), "sm_90").unwrap();
    // out, lse, q, k, v, q_pos, kv_pos, q_start: pointers; the Shape struct by value; the
    // scale.
    assert_eq!(
        ptx_params(&attn, "attention_block_forward").unwrap(),
        [8, 8, 8, 8, 8, 8, 8, 8, 24, 4]
    );
    let elem = compile(&src("elementwise"), "sm_90").unwrap();
    assert_eq!(ptx_params(&elem, "fill_bf16").unwrap(), [8, 2, 8]);
    let optim = compile(&src("optim"), "sm_90").unwrap();
    assert_eq!(
        ptx_params(&optim, "adamw").unwrap(),
        [8, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4]
    );
    assert!(ptx_params(&optim, "no_such_kernel").is_none());
    // s, lse: pointers; the ScoreRows struct (five u32) by value.
    let scores = compile(&src("scores"), "sm_90").unwrap();
    assert_eq!(ptx_params(&scores, "scores_softmax").unwrap(), [8, 8, 20]);
    assert_eq!(ptx_params(&scores, "scores_grad").unwrap(), [8, 8, 8, 20]);
}

/// The `launch!` calls of the backend's source as (kernel, number of arguments).
fn launches(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for piece in text.split("launch!(").skip(1) {
        let Some(name) = piece.split('"').nth(1) else {
            continue;
        };
        let Some(args_at) = piece.find(';') else {
            continue;
        };
        // Arguments up to the macro's closing parenthesis, commas at depth 0.
        let (mut depth, mut count, mut any) = (0i32, 0usize, false);
        for c in piece[args_at + 1..].chars() {
            match c {
                '(' | '[' => depth += 1,
                ')' | ']' if depth == 0 => break,
                ')' | ']' => depth -= 1,
                ',' if depth == 0 => {
                    count += usize::from(any);
                    any = false;
                }
                c if !c.is_whitespace() => any = true,
                _ => {}
            }
        }
        out.push((name.to_string(), count + usize::from(any))); // a trailing comma adds none
    }
    out
}

#[test]
fn every_launch_passes_as_many_arguments_as_its_kernel_has_parameters() {
    use ferrotron_cuda::gpu::ptx_params;
    let ptx: Vec<(ferrotron_cuda::Source, String)> = SOURCES
        .iter()
        .map(|s| (*s, compile(s, "sm_90").unwrap()))
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    for text in [
        include_str!("../src/kernels.rs"),
        include_str!("../src/backend.rs"),
        include_str!("../src/scores.rs"),
        include_str!("../src/attention.rs"),
        include_str!("../src/xent.rs"),
    ] {
        for (name, args) in launches(text) {
            let (_, p) = ptx
                .iter()
                .find(|(s, _)| s.kernels.contains(&name.as_str()))
                .unwrap_or_else(|| panic!("launch of {name}, which no source defines"));
            let params = ptx_params(p, &name).unwrap();
            assert_eq!(
                args,
                params.len(),
                "launch of {name}: {args} arguments, {} parameters",
                params.len()
            );
            seen.insert(name);
        }
    }
    // Every kernel of every source is launched somewhere.
    let all: std::collections::BTreeSet<String> = SOURCES
        .iter()
        .flat_map(|s| s.kernels.iter().map(|k| k.to_string()))
        .collect();
    let missing: Vec<_> = all.difference(&seen).collect();
    assert!(missing.is_empty(), "kernels never launched: {missing:?}");
}

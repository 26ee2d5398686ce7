//! Checkpoints: bitwise resume on a 3D layout, resharding between layouts (context-parallel
//! ones included) and precisions against the uninterrupted run, and integrity errors naming
//! the damaged file.
//!
//! Tolerances: resuming under the same layout must be bitwise (same loss bits every step).
//! Resharding changes only the summation order of the reductions, so the parity tolerance of
//! `dp_parity.rs` applies: loss per step within relative 1e-5, every parameter tensor within
//! relative 1e-5 (L2).

mod common;

use std::path::{Path, PathBuf};

use ferrotron_config::{Config, DType, PpSchedule};
use ferrotron_model::ParamLayout;
use ferrotron_train::checkpoint::{Checkpoint, Kind};
use ferrotron_train::{Init, Trainer};

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 32;
    c.model.layers = 4;
    c.model.heads = 8;
    c.model.kv_heads = 4;
    c.model.ffn = 64;
    c.model.seq_len = 16;
    c.train.steps = 20;
    c.train.micro_batch = 2;
    c.train.grad_accum = 4;
    c.train.warmup_steps = 3;
    c.train.threads = 1;
    c.parallel.bucket_mb = 0.01;
    c.parallel.comm_timeout_s = 60.0;
    c
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotron-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn assert_close(what: &str, a: &[f64], b: &[f64], pa: &[f32], pb: &[f32], model: &Config) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{what} step {}: {x} vs {y}",
            i + 1
        );
    }
    let (tensor, _, name) = common::compare(&ParamLayout::new(&model.model), pa, pb);
    assert!(tensor <= 1e-5, "{what} {name}: {tensor}");
}

#[test]
fn resume_on_a_3d_layout_is_bitwise() {
    let cases = [
        (DType::F32, 1, PpSchedule::OneFOneB),
        (DType::Bf16, 0, PpSchedule::OneFOneB),
        (DType::F32, 1, PpSchedule::DualPipeV),
    ];
    for (dtype, zero, schedule) in cases {
        let mut c = base();
        (c.parallel.dp, c.parallel.tp, c.parallel.pp) = (2, 2, 2);
        c.parallel.zero = zero;
        c.parallel.pp_schedule = schedule;
        c.train.dtype = dtype;
        let (straight, p_straight) = common::run(&c, Init::Fresh, 20, None);
        let root = scratch(&format!("bitwise-{dtype:?}-{schedule}"));
        let (first, _) = common::run(&c, Init::Fresh, 10, Some(&root));
        let ck = Checkpoint::open(&root).unwrap();
        assert_eq!(
            (ck.manifest.step, ck.manifest.samples_done),
            (10, 10 * 2 * 4 * 2)
        );
        let (second, p_resumed) = common::run(&c, Init::Checkpoint(&ck), 10, None);
        let resumed: Vec<f64> = first.into_iter().chain(second).collect();
        for (i, (a, b)) in resumed.iter().zip(&straight).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{dtype:?} step {}: {a} vs {b}",
                i + 1
            );
        }
        assert_eq!(
            p_resumed, p_straight,
            "{dtype:?}: parameters after 20 steps"
        );
    }
}

fn layout(dp: usize, tp: usize, pp: usize, zero: u8) -> impl Fn(&mut Config) {
    move |c: &mut Config| {
        (c.parallel.dp, c.parallel.tp, c.parallel.pp, c.parallel.zero) = (dp, tp, pp, zero);
        // The global batch stays 2 × 8 sequences: fewer data-parallel ranks accumulate more.
        c.train.grad_accum = 8 / dp;
    }
}

/// A mixture-of-experts model (4 experts, top-2, every second block) on dp = 4 with
/// expert parallelism `ep` and ZeRO stage `zero`.
fn experts(ep: usize, zero: u8) -> impl Fn(&mut Config) {
    move |c: &mut Config| {
        layout(4, 1, 1, zero)(c);
        (c.model.experts, c.model.top_k, c.model.moe_every) = (4, 2, 2);
        c.model.router_aux_loss_coef = 0.1;
        c.parallel.ep = ep;
    }
}

fn with_cp(set: impl Fn(&mut Config), cp: usize) -> impl Fn(&mut Config) {
    move |c: &mut Config| {
        set(c);
        c.parallel.cp = cp;
    }
}

/// A vocabulary no tp divides, padded under TP to a multiple of `multiple × tp` rows.
fn with_vocab(set: impl Fn(&mut Config), vocab: usize, multiple: usize) -> impl Fn(&mut Config) {
    move |c: &mut Config| {
        set(c);
        (c.model.vocab, c.model.vocab_multiple) = (vocab, multiple);
    }
}

fn with_qkv_bias(set: impl Fn(&mut Config)) -> impl Fn(&mut Config) {
    move |c: &mut Config| {
        set(c);
        c.model.qkv_bias = true;
    }
}

#[test]
fn a_checkpoint_reshards_into_other_layouts() {
    let interleaved = |c: &mut Config| {
        layout(1, 1, 2, 0)(c);
        c.parallel.pp_schedule = PpSchedule::Interleaved;
        c.parallel.virtual_stages = 2;
    };
    let one_f_one_b = |c: &mut Config| {
        layout(1, 1, 4, 0)(c);
        c.parallel.pp_schedule = PpSchedule::OneFOneB;
    };
    // fp16: the fp32 master and the loss scale reshard like any state (to a layout without
    // TP, which would move activations across fp16 rounding boundaries: fp16.rs).
    let fp16 = |set: fn(&mut Config)| {
        move |c: &mut Config| {
            set(c);
            c.train.dtype = DType::F16;
        }
    };
    // DualPipeV's rank 0 holds blocks 0 and 3 with the embedding and the head.
    let dualpipev = |c: &mut Config| {
        layout(2, 1, 2, 1)(c);
        c.parallel.pp_schedule = PpSchedule::DualPipeV;
    };
    type Setter = Box<dyn Fn(&mut Config)>;
    let pairs: Vec<(&str, Setter, Setter)> = vec![
        (
            "dp4 → tp2·pp2",
            Box::new(layout(4, 1, 1, 0)),
            Box::new(layout(1, 2, 2, 0)),
        ),
        (
            "tp2 → tp4",
            Box::new(layout(1, 2, 1, 0)),
            Box::new(layout(1, 4, 1, 0)),
        ),
        (
            "zero1·dp4 → zero3·dp2",
            Box::new(layout(4, 1, 1, 1)),
            Box::new(layout(2, 1, 1, 3)),
        ),
        (
            "pp2 interleaved → pp4 1f1b",
            Box::new(interleaved),
            Box::new(one_f_one_b),
        ),
        (
            "zero1·dp2·pp2 dualpipev → pp4 1f1b",
            Box::new(dualpipev),
            Box::new(one_f_one_b),
        ),
        (
            "tp2·pp2 1f1b → zero1·dp2·pp2 dualpipev",
            Box::new(layout(1, 2, 2, 0)),
            Box::new(dualpipev),
        ),
        (
            "fp16 zero1·dp2 → fp16 zero3·dp2",
            Box::new(fp16(|c| layout(2, 1, 1, 1)(c))),
            Box::new(fp16(|c| layout(2, 1, 1, 3)(c))),
        ),
        (
            "zero2·dp2·tp2 → single rank",
            Box::new(layout(2, 2, 1, 2)),
            Box::new(layout(1, 1, 1, 0)),
        ),
        // Experts are stored once under their global names: by expert-data index 0 under
        // ZeRO-0, sharded over the expert-data group under ZeRO-1.
        (
            "ep2 → ep4",
            Box::new(experts(2, 0)),
            Box::new(experts(4, 0)),
        ),
        (
            "zero1·ep4 → zero1·ep2",
            Box::new(experts(4, 1)),
            Box::new(experts(2, 1)),
        ),
        (
            "zero1·ep2·cp2 → ep4",
            Box::new(with_cp(experts(2, 1), 2)),
            Box::new(experts(4, 0)),
        ),
        // Context parallelism: ZeRO-0 writes from index 0 of the data × context group only;
        // ZeRO-1 shards over that group, each rank writing its own pieces.
        // Qwen2's biases are split by rows like their projections.
        (
            "q/k/v biases: zero1·dp2·tp2 → tp4",
            Box::new(with_qkv_bias(layout(2, 2, 1, 1))),
            Box::new(with_qkv_bias(layout(1, 4, 1, 0))),
        ),
        // Checkpoints hold the vocabulary's real rows: a padded one reshards to any tp.
        (
            "vocab 257: zero1·dp2·tp2 → tp4",
            Box::new(with_vocab(layout(2, 2, 1, 1), 257, 128)),
            Box::new(with_vocab(layout(1, 4, 1, 0), 257, 128)),
        ),
        (
            "vocab 257: tp4, padded to 260 → single rank",
            Box::new(with_vocab(layout(1, 4, 1, 0), 257, 1)),
            Box::new(with_vocab(layout(1, 1, 1, 0), 257, 128)),
        ),
        (
            "cp2 → cp1",
            Box::new(with_cp(layout(1, 1, 1, 0), 2)),
            Box::new(layout(1, 1, 1, 0)),
        ),
        (
            "zero1·dp2·cp2 → tp2·cp2",
            Box::new(with_cp(layout(2, 1, 1, 1), 2)),
            Box::new(with_cp(layout(1, 2, 1, 0), 2)),
        ),
    ];
    for (what, from, to) in pairs {
        let (mut a, mut b) = (base(), base());
        from(&mut a);
        to(&mut b);
        let (straight, p_straight) = common::run(&a, Init::Fresh, 20, None);
        let root = scratch(&format!("reshard-{}", what.len()));
        let (first, _) = common::run(&a, Init::Fresh, 10, Some(&root));
        let ck = Checkpoint::open(&root).unwrap();
        let (second, p_resharded) = common::run(&b, Init::Checkpoint(&ck), 10, None);
        let resharded: Vec<f64> = first.into_iter().chain(second).collect();
        assert_close(what, &resharded, &straight, &p_resharded, &p_straight, &a);
        std::fs::remove_dir_all(&root).unwrap();
    }
}

#[test]
fn precision_changes_keep_the_fp32_master() {
    // bf16 → f32 → bf16 round trip at step 10: the master survives, so the bf16 run goes on
    // bitwise as if never interrupted.
    let mut bf16 = base();
    bf16.train.dtype = DType::Bf16;
    let f32c = base();
    let (straight, p_straight) = common::run(&bf16, Init::Fresh, 20, None);
    let (root_a, root_b) = (scratch("bf16-a"), scratch("bf16-b"));
    let (first, _) = common::run(&bf16, Init::Fresh, 10, Some(&root_a));
    let ck = Checkpoint::open(&root_a).unwrap();
    let (_, p_f32) = common::run(&f32c, Init::Checkpoint(&ck), 0, Some(&root_b));
    let ck_f32 = Checkpoint::open(&root_b).unwrap();
    let layout = ParamLayout::new(&base().model);
    for kind in Kind::ALL {
        assert_eq!(
            ck.local(kind, &layout).unwrap(),
            ck_f32.local(kind, &layout).unwrap()
        );
    }
    assert_eq!(p_f32, ck.local(Kind::Master, &layout).unwrap());
    let (second, p_back) = common::run(&bf16, Init::Checkpoint(&ck_f32), 10, None);
    let resumed: Vec<f64> = first.into_iter().chain(second).collect();
    assert_eq!(resumed, straight);
    assert_eq!(p_back, p_straight);
    // f32 → bf16: the bf16 weights are the master rounded once; the run goes on within the
    // bf16 tolerance of the f32 run.
    let (straight, _) = common::run(&f32c, Init::Fresh, 20, None);
    let root_c = scratch("f32");
    common::run(&f32c, Init::Fresh, 10, Some(&root_c));
    let ck = Checkpoint::open(&root_c).unwrap();
    let mut t = Trainer::resume(bf16.clone(), &ck).unwrap();
    let losses: Vec<f64> = t.run(|_| {}).unwrap().iter().map(|s| s.loss).collect();
    for (a, b) in losses.iter().zip(&straight[10..]) {
        assert!((a - b).abs() <= 3e-3 * b, "bf16 after f32: {a} vs {b}");
    }
    for r in [root_a, root_b, root_c] {
        std::fs::remove_dir_all(r).unwrap();
    }
}

/// Copies every file of `src` into a fresh `dst`.
fn copy_dir(src: &Path, dst: &Path) {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

#[test]
fn damaged_files_are_named_before_training() {
    let mut c = base();
    (c.parallel.dp, c.parallel.zero) = (2, 1);
    let root = scratch("damage");
    common::run(&c, Init::Fresh, 2, Some(&root));
    let good = Checkpoint::open(&root).unwrap().dir;
    assert_eq!(good.file_name().unwrap(), "step_00000002");
    let ck = Checkpoint::open(&good).unwrap();
    let names: Vec<&str> = ck.manifest.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["rank_00000.safetensors", "rank_00001.safetensors"]);
    // Under ZeRO-1 the two shards partition every state: each element is stored once.
    let stored: u64 = ck.manifest.files.iter().map(|f| f.bytes).sum();
    let params = ParamLayout::new(&c.model).total as u64;
    assert!(
        stored > 12 * params && stored < 12 * params + 200_000,
        "{stored}"
    );

    type Damage<'a> = (&'a str, &'a dyn Fn(&Path));
    let cases: [Damage; 4] = [
        ("truncated", &|d| {
            let f = d.join("rank_00001.safetensors");
            let len = std::fs::metadata(&f).unwrap().len();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&f)
                .unwrap()
                .set_len(len / 2)
                .unwrap();
        }),
        ("altered", &|d| {
            let f = d.join("rank_00000.safetensors");
            let mut bytes = std::fs::read(&f).unwrap();
            let i = bytes.len() - 7;
            bytes[i] ^= 0x10;
            std::fs::write(&f, bytes).unwrap();
        }),
        ("missing", &|d| {
            std::fs::remove_file(d.join("rank_00001.safetensors")).unwrap()
        }),
        ("manifest", &|d| {
            std::fs::write(d.join("manifest.json"), "{\"format\":").unwrap()
        }),
    ];
    for (what, damage) in cases {
        let dir = root.join(format!("damaged-{what}"));
        copy_dir(&good, &dir);
        damage(&dir);
        let err = Checkpoint::open(&dir).err().expect(what).to_string();
        let expect = match what {
            "truncated" => ["rank_00001.safetensors", "truncated"],
            "altered" => ["rank_00000.safetensors", "SHA-256"],
            "missing" => ["rank_00001.safetensors", "missing"],
            _ => ["manifest.json", "not a valid manifest"],
        };
        for needle in expect {
            assert!(err.contains(needle), "{what}: {err}");
        }
    }
    // A checkpoint of another model is refused naming the field.
    let mut other = c.clone();
    other.model.hidden = 64;
    let err = Trainer::resume(other, &ck).err().unwrap().to_string();
    assert!(err.contains("model.hidden = 64"), "{err}");
    let mut reseeded = c.clone();
    reseeded.train.seed += 1;
    let err = Trainer::resume(reseeded, &ck).err().unwrap().to_string();
    assert!(err.contains("train.seed"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn hugging_face_round_trip_keeps_the_master_bitwise() {
    for vocab in [64, 257] {
        hugging_face_round_trip(vocab);
    }
}

/// A tp2·pp2 checkpoint (its vocabulary padded under TP) exported to Hugging Face and
/// imported back: the master weights unchanged, the exported model the unpadded one.
fn hugging_face_round_trip(vocab: usize) {
    let mut c = base();
    (c.parallel.tp, c.parallel.pp) = (2, 2);
    c.model.vocab = vocab;
    let root = scratch(&format!("hf-{vocab}"));
    common::run(&c, Init::Fresh, 3, Some(&root));
    let ck = Checkpoint::open(&root).unwrap();
    ferrotron_train::checkpoint::export_hf(
        &ck,
        &root.join("hf"),
        DType::F32,
        ferrotron_train::hf::shards::DEFAULT_MAX_SHARD,
    )
    .unwrap();
    let back =
        ferrotron_train::checkpoint::import_hf(&root.join("hf"), &root.join("back"), &c).unwrap();
    let ck2 = Checkpoint::open(&back).unwrap();
    let layout = ParamLayout::new(&c.model);
    let master = ck.local(Kind::Master, &layout).unwrap();
    assert_eq!(ck2.local(Kind::Master, &layout).unwrap(), master);
    assert!(ck2
        .local(Kind::ExpAvg, &layout)
        .unwrap()
        .iter()
        .all(|x| *x == 0.0));
    assert_eq!(ck2.manifest.step, 0);
    // The exported model is what the trainer's gathered weights were.
    let loaded = ferrotron_train::hf::load_model(&root.join("hf")).unwrap();
    assert_eq!(loaded.weights, master);
    std::fs::remove_dir_all(&root).unwrap();
}

/// Rewrites one tensor's metadata in `file` with `edit` and updates the manifest's size and
/// checksum, as a foreign or buggy writer would leave it.
fn rewrite_meta(dir: &Path, file: &str, edit: impl Fn(&mut serde_json::Value)) {
    use safetensors::SafeTensors;
    let path = dir.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    let name = st
        .names()
        .into_iter()
        .find(|n| n.contains('@'))
        .unwrap()
        .to_string();
    let mut v: serde_json::Value = serde_json::from_str(&meta[&name]).unwrap();
    edit(&mut v);
    meta.insert(name, v.to_string());
    let blob = safetensors::serialize(st.tensors(), Some(meta)).unwrap();
    std::fs::write(&path, &blob).unwrap();
    let mpath = dir.join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    for f in manifest["files"].as_array_mut().unwrap() {
        if f["name"] == file {
            f["bytes"] = blob.len().into();
            f["sha256"] = ferrotron_train::checkpoint::format::sha256_hex(&blob).into();
        }
    }
    std::fs::write(&mpath, manifest.to_string()).unwrap();
}

#[test]
fn inconsistent_metadata_is_an_error_not_a_panic() {
    let mut c = base();
    (c.parallel.dp, c.parallel.zero) = (2, 1);
    let root = scratch("metadata");
    common::run(&c, Init::Fresh, 1, Some(&root));
    let good = Checkpoint::open(&root).unwrap().dir;
    let layout = ParamLayout::new(&c.model);
    type Edit<'a> = (&'a str, &'a dyn Fn(&mut serde_json::Value), &'a str);
    let cases: [Edit; 4] = [
        ("tp0", &|v| v["tp"] = 0.into(), "tensor-parallel slice"),
        // Padded rows far beyond any vocabulary's (or on a slice that is not by rows).
        ("rows", &|v| v["rows"] = (1u64 << 40).into(), "slicing"),
        ("backwards", &|v| v["end"] = 0.into(), "elements"),
        // Shifted by one element: overlaps its neighbour and leaves a gap.
        (
            "overlap",
            &|v| {
                let (s, e) = (v["start"].as_u64().unwrap(), v["end"].as_u64().unwrap());
                (v["start"], v["end"]) = ((s - 1).into(), (e - 1).into());
            },
            "exactly once",
        ),
    ];
    for (what, edit, needle) in cases {
        let dir = root.join(what);
        copy_dir(&good, &dir);
        rewrite_meta(&dir, "rank_00001.safetensors", edit);
        let err = match Checkpoint::open(&dir) {
            Err(e) => e.to_string(),
            Ok(ck) => Kind::ALL
                .iter()
                .find_map(|k| ck.local(*k, &layout).err())
                .expect(what)
                .to_string(),
        };
        assert!(err.contains(needle), "{what}: {err}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn resaving_and_pruning_keep_the_newest_and_spare_later_steps() {
    let c = base();
    let root = scratch("prune");
    let mut t = Trainer::new(c.clone()).unwrap();
    for step in 1..=30 {
        t.step().unwrap();
        if step % 10 == 0 {
            t.save_checkpoint(&root, 5).unwrap();
        }
    }
    // Back to step 10; save 20 again (replacing it) with keep = 1.
    let ck = Checkpoint::open(&root.join("step_00000010")).unwrap();
    let mut t = Trainer::resume(c.clone(), &ck).unwrap();
    drop(ck);
    for _ in 0..10 {
        t.step().unwrap();
    }
    t.save_checkpoint(&root, 1).unwrap();
    let steps: Vec<usize> = ferrotron_train::checkpoint::list_checkpoints(&root)
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    // Step 10 is pruned; 30, from the abandoned continuation, is newer and left alone.
    assert_eq!(steps, [20, 30]);
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap(),
        "step_00000020\n"
    );
    assert_eq!(Checkpoint::open(&root).unwrap().manifest.step, 20);
    // A save whose rank files are not all visible (unshared filesystem) is refused.
    let partial = ferrotron_train::checkpoint::prepare_partial(&root, 40).unwrap();
    std::fs::write(partial.join("rank_00000.safetensors"), b"x").unwrap();
    let manifest = Checkpoint::open(&root).unwrap().manifest;
    let err = ferrotron_train::checkpoint::finalize(&root, &partial, manifest, 1, 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank_00001.safetensors") && err.contains("shares"),
        "{err}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

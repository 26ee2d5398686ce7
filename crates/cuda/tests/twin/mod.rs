//! Twin runs of a kernel: the same buffers on the CPU backend and on a CUDA rank of GPU 0,
//! filled with the same pseudo-random values, then compared.

#![allow(dead_code)]

use std::sync::Arc;

use ferrotron_cuda::{CudaBackend, CudaOptions, Gpu};
use ferrotron_tensor::{bf16, f16, ArenaBackend, Backend, Buf, Category, CpuBackend, Ledger};

/// Normwise relative tolerance of f32 results.
pub const F32: f64 = 1e-5;

/// One side's buffers, by the ids [`Twin`] hands out.
pub struct Bufs {
    pub f: Vec<Buf<f32>>,
    pub u: Vec<Buf<u32>>,
    pub d: Vec<Buf<f64>>,
    pub b: Vec<Buf<bf16>>,
    pub h: Vec<Buf<f16>>,
}

struct Side {
    backend: Arc<dyn Backend>,
    ledger: Ledger,
    bufs: Bufs,
}

/// The CPU and the GPU side.
pub struct Twin {
    sides: [Side; 2],
}

/// Values in [-1, 1) from a seed (a 64-bit LCG): the same on both sides.
pub fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

impl Twin {
    /// A CPU side and a rank on GPU 0.
    pub fn new() -> Twin {
        Twin::gpu(CudaOptions::default())
    }

    /// A CPU side and a rank on GPU 0 with `options`.
    pub fn gpu(options: CudaOptions) -> Twin {
        let gpu = Gpu::open(0).unwrap_or_else(|e| panic!("{e}"));
        let cuda = CudaBackend::new(gpu, options).unwrap_or_else(|e| panic!("{e}"));
        Twin::with(Arc::new(cuda))
    }

    /// A CPU side and the arena backend (CPU kernels over device memory) in the GPU's place:
    /// to check the checks without a GPU.
    pub fn arena() -> Twin {
        Twin::with(Arc::new(ArenaBackend::opaque(64 << 20)))
    }

    fn with(other: Arc<dyn Backend>) -> Twin {
        let side = |backend: Arc<dyn Backend>| {
            let ledger = backend.memory().map(Ledger::on).unwrap_or_default();
            Side {
                backend,
                ledger,
                bufs: Bufs {
                    f: vec![],
                    u: vec![],
                    d: vec![],
                    b: vec![],
                    h: vec![],
                },
            }
        };
        Twin {
            sides: [side(Arc::new(CpuBackend::default())), side(other)],
        }
    }

    /// A buffer of `cpu` on the CPU side and of `other` on the other; its id.
    pub fn f32_sides(&mut self, cpu: &[f32], other: &[f32]) -> usize {
        for (s, values) in self.sides.iter_mut().zip([cpu, other]) {
            let b = s.ledger.upload(Category::Activations, "test", values);
            s.bufs.f.push(b);
        }
        self.sides[0].bufs.f.len() - 1
    }

    /// A buffer of `values` on both sides; its id.
    pub fn f32_of(&mut self, values: &[f32]) -> usize {
        for s in &mut self.sides {
            let b = s.ledger.upload(Category::Activations, "test", values);
            s.bufs.f.push(b);
        }
        self.sides[0].bufs.f.len() - 1
    }

    /// `n` pseudo-random values in [-1, 1) on both sides.
    pub fn f32s(&mut self, n: usize, seed: u64) -> usize {
        self.f32_of(&random(n, seed))
    }

    /// `n` zeros on both sides.
    pub fn zeros(&mut self, n: usize) -> usize {
        self.f32_of(&vec![0.0; n])
    }

    /// Integers (token ids, targets) on both sides.
    pub fn u32_of(&mut self, values: &[u32]) -> usize {
        for s in &mut self.sides {
            let b = s.ledger.upload(Category::Activations, "test", values);
            s.bufs.u.push(b);
        }
        self.sides[0].bufs.u.len() - 1
    }

    /// `n` f64 zeros on both sides.
    pub fn f64_zeros(&mut self, n: usize) -> usize {
        for s in &mut self.sides {
            let b = s.ledger.zeros::<f64>(Category::Activations, n);
            s.bufs.d.push(b);
        }
        self.sides[0].bufs.d.len() - 1
    }

    /// bf16 values on both sides.
    pub fn bf16_of(&mut self, values: &[f32]) -> usize {
        let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
        for s in &mut self.sides {
            let b = s.ledger.upload(Category::Activations, "test", &v);
            s.bufs.b.push(b);
        }
        self.sides[0].bufs.b.len() - 1
    }

    /// IEEE-half values on both sides.
    pub fn f16_of(&mut self, values: &[f32]) -> usize {
        let v: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
        for s in &mut self.sides {
            let b = s.ledger.upload(Category::Activations, "test", &v);
            s.bufs.h.push(b);
        }
        self.sides[0].bufs.h.len() - 1
    }

    /// Asserts that IEEE-half buffer `id` is bit for bit the same.
    pub fn exact_f16(&self, what: &str, id: usize) {
        let get = |s: &Side| s.ledger.download("test", &s.bufs.h[id]);
        let (c, g) = (get(&self.sides[0]), get(&self.sides[1]));
        let bits = |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&c), bits(&g), "{what}: f16 bits differ");
    }

    /// Runs `f` on the CPU side, then on the GPU side; both results.
    pub fn each<R>(&mut self, f: impl Fn(&dyn Backend, &Ledger, &mut Bufs) -> R) -> [R; 2] {
        let [a, b] = &mut self.sides;
        let ra = f(&*a.backend, &a.ledger, &mut a.bufs);
        let rb = f(&*b.backend, &b.ledger, &mut b.bufs);
        b.backend.synchronize();
        [ra, rb]
    }

    /// Both sides' values of f32 buffer `id`.
    pub fn values(&self, id: usize) -> [Vec<f32>; 2] {
        let get = |s: &Side| s.ledger.download("test", &s.bufs.f[id]);
        [get(&self.sides[0]), get(&self.sides[1])]
    }

    /// Asserts that f32 buffer `id` agrees: `max |gpu − cpu| ≤ tol · max |cpu|`.
    pub fn same(&self, what: &str, id: usize, tol: f64) {
        let [c, g] = self.values(id);
        close(what, &c, &g, tol);
    }

    /// Asserts that f64 buffer `id` agrees within `tol` (normwise).
    pub fn same_f64(&self, what: &str, id: usize, tol: f64) {
        let get = |s: &Side| s.ledger.download("test", &s.bufs.d[id]);
        let (c, g) = (get(&self.sides[0]), get(&self.sides[1]));
        let c32: Vec<f32> = c.iter().map(|&x| x as f32).collect();
        let g32: Vec<f32> = g.iter().map(|&x| x as f32).collect();
        close(what, &c32, &g32, tol);
    }

    /// Asserts that bf16 buffer `id` is bit for bit the same.
    pub fn exact_bf16(&self, what: &str, id: usize) {
        let get = |s: &Side| s.ledger.download("test", &s.bufs.b[id]);
        let (c, g) = (get(&self.sides[0]), get(&self.sides[1]));
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&c), bits(&g), "{what}: bf16 bits differ");
    }

    /// Asserts that f32 buffer `id` is bit for bit the same.
    pub fn exact(&self, what: &str, id: usize) {
        let [c, g] = self.values(id);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&c), bits(&g), "{what}: bits differ");
    }
}

/// Asserts `max |g − c| ≤ tol · max |c|` (and equal lengths, and no NaN on one side only).
pub fn close(what: &str, c: &[f32], g: &[f32], tol: f64) {
    assert_eq!(c.len(), g.len(), "{what}: lengths");
    let scale = c
        .iter()
        .fold(0.0f64, |m, &x| m.max((x as f64).abs()))
        .max(1e-30);
    let (mut worst, mut at) = (0.0f64, 0);
    for (i, (&x, &y)) in c.iter().zip(g).enumerate() {
        if x.is_nan() != y.is_nan() || x.is_infinite() != y.is_infinite() {
            panic!("{what}: element {i} is {x} on the CPU and {y} on the GPU");
        }
        if x.is_finite() {
            let e = (x as f64 - y as f64).abs() / scale;
            if e > worst {
                (worst, at) = (e, i);
            }
        }
    }
    eprintln!("{what}: normwise error {worst:.2e}");
    assert!(
        worst <= tol,
        "{what}: error {worst:.2e} > {tol:.0e} at element {at} ({} vs {})",
        c[at],
        g[at]
    );
}

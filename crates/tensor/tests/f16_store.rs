//! fp16 storage (`train.dtype = "fp16"`): the CPU's casts at IEEE half's edges, against
//! values worked out by hand from the format (1 sign, 5 exponent, 10 fraction bits), and a
//! store's rounding points.

use ferrotron_tensor::{Category, CpuBackend, Device, Ledger, Store, StoreDType};

/// (input, its IEEE-half value): round to nearest, ties to even.
const CASES: [(f32, f32); 12] = [
    (1.0, 1.0),
    (1.0 + 1.0 / 2048.0, 1.0),               // a tie: to the even 1.0
    (1.0 + 3.0 / 2048.0, 1.0 + 1.0 / 512.0), // a tie: to the even 1 + 2^-9
    (1.0 / 3.0, 0.333_251_95),               // 1365 · 2^-12
    (65504.0, 65504.0),                      // the largest finite half
    (65519.0, 65504.0),                      // below the tie: down
    (65520.0, f32::INFINITY),                // the tie past 65504: to infinity
    (-1e6, f32::NEG_INFINITY),
    (5.960_464_5e-8, 5.960_464_5e-8), // 2^-24, the smallest subnormal
    (2.980_232_2e-8, 0.0),            // 2^-25: a tie, to even (zero)
    (8.940_697e-8, 1.192_092_9e-7),   // 3·2^-25: a tie, to even (2^-23)
    (1e-9, 0.0),                      // underflow
];

fn device() -> (Ledger, CpuBackend) {
    (Ledger::default(), CpuBackend::default())
}

#[test]
fn casts_round_to_nearest_even_overflow_and_underflow() {
    let (ledger, be) = device();
    let dev = Device {
        ledger: &ledger,
        backend: &be,
    };
    let input: Vec<f32> = CASES.iter().map(|c| c.0).collect();
    let data = ledger.upload(Category::Workspace, "test", &input);
    let store = Store::keep(dev, Category::Activations, StoreDType::F16, data);
    assert_eq!(store.dtype(), StoreDType::F16);
    assert_eq!(
        ledger.snapshot().current(Category::Activations),
        2 * CASES.len()
    );
    let back = ledger.download("test", &store.view_all(dev));
    for ((x, want), got) in CASES.iter().zip(&back) {
        assert_eq!(got.to_bits(), want.to_bits(), "{x} → {got}, want {want}");
    }
    assert!(
        store.operand().is_none(),
        "products read fp16 through f32 views"
    );
}

#[test]
fn a_store_adds_in_f32_and_rounds_once() {
    let (ledger, be) = device();
    let dev = Device {
        ledger: &ledger,
        backend: &be,
    };
    let mut store = Store::zeros(&ledger, Category::Gradients, StoreDType::F16, 3);
    let one = ledger.upload(Category::Workspace, "test", &[1.0f32, 60000.0, 1e-8]);
    let tiny = ledger.upload(
        Category::Workspace,
        "test",
        &[1.0f32 / 4096.0, 6000.0, 1e-8],
    );
    store.add(&be, 0..3, &one);
    store.add(&be, 0..3, &tiny);
    let got = ledger.download("test", &store.view_all(dev));
    // 1 + 2^-12 rounds back to 1; 66000 overflows; 1e-8 underflows to 0 twice over.
    assert_eq!(got, vec![1.0, f32::INFINITY, 0.0]);
    store.fill_zero(&be);
    assert_eq!(ledger.download("test", &store.view_all(dev)), vec![0.0; 3]);
    let bytes = store.to_le_bytes(&ledger, "test", 0..3);
    assert_eq!(bytes.len(), 6);
}

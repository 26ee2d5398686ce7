//! The payload of every operation: a ledger-counted buffer of f32 or bf16 elements.

use std::fmt;

use ferrotron_tensor::{bf16, Buf, Category, Device, DeviceSlice, Ledger};

/// Element type of a [`CommBuf`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16; reductions accumulate in f32 and round once.
    Bf16,
}

impl DType {
    /// Lower-case name: `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The transfer label of a collective's buffers copied between a device the host cannot
/// access and the host, for a transport that reads and writes host memory.
pub const STAGING: &str = "collective staging";

/// A buffer sent or received: f32 or bf16 elements held in a [`Ledger`].
///
/// Operations take their input by value (no copy is made; the input stays counted on the
/// ledger it was allocated on until every peer has read it) and return a fresh buffer
/// allocated on the calling rank's ledger under [`Category::Communication`].
#[derive(Debug)]
pub enum CommBuf {
    /// f32 elements.
    F32(Buf<f32>),
    /// bf16 elements.
    Bf16(Buf<bf16>),
}

impl CommBuf {
    /// Copies host `data` into a new buffer counted under [`Category::Communication`] (tests
    /// and tools; the engine copies device memory with [`CommBuf::copy_of`]).
    pub fn from_f32_slice(ledger: &Ledger, data: &[f32]) -> CommBuf {
        CommBuf::F32(ledger.from_vec(Category::Communication, data.to_vec()))
    }

    /// Copies `data` into a new buffer counted under [`Category::Communication`].
    pub fn from_bf16_slice(ledger: &Ledger, data: &[bf16]) -> CommBuf {
        CommBuf::Bf16(ledger.from_vec(Category::Communication, data.to_vec()))
    }

    /// Rounds `data` to bf16 into a new buffer counted under [`Category::Communication`].
    pub fn bf16_from_f32_slice(ledger: &Ledger, data: &[f32]) -> CommBuf {
        let v = data.iter().map(|&x| bf16::from_f32(x)).collect();
        CommBuf::Bf16(ledger.from_vec(Category::Communication, v))
    }

    /// A zero-filled buffer of `len` elements counted under [`Category::Communication`].
    pub fn zeros(ledger: &Ledger, dtype: DType, len: usize) -> CommBuf {
        match dtype {
            DType::F32 => CommBuf::F32(ledger.zeros(Category::Communication, len)),
            DType::Bf16 => CommBuf::Bf16(ledger.zeros(Category::Communication, len)),
        }
    }

    /// A copy of this buffer (allocated on `source`) on `target`: between a device whose
    /// memory the host cannot access and a host staging ledger. Counted on both ledgers as
    /// [`STAGING`] transfers.
    pub(crate) fn restaged(&self, source: &Ledger, target: &Ledger) -> CommBuf {
        let cat = Category::Communication;
        match self {
            CommBuf::F32(b) => {
                CommBuf::F32(target.upload(cat, STAGING, &source.download(STAGING, b)))
            }
            CommBuf::Bf16(b) => {
                CommBuf::Bf16(target.upload(cat, STAGING, &source.download(STAGING, b)))
            }
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CommBuf::F32(b) => b.len(),
            CommBuf::Bf16(b) => b.len(),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            CommBuf::F32(_) => DType::F32,
            CommBuf::Bf16(_) => DType::Bf16,
        }
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    /// A copy of device memory `src` counted under [`Category::Communication`]: what an
    /// operation is given when its input must outlive the caller's buffer.
    pub fn copy_of(dev: Device<'_>, src: &DeviceSlice<f32>) -> CommBuf {
        let mut b = dev.ledger.zeros(Category::Communication, src.len());
        dev.backend.copy(&mut b, src);
        CommBuf::F32(b)
    }

    /// `src` rounded to bf16 into a new buffer counted under [`Category::Communication`].
    pub fn rounded_of(dev: Device<'_>, src: &DeviceSlice<f32>) -> CommBuf {
        let mut b = dev.ledger.zeros(Category::Communication, src.len());
        dev.backend.round_bf16(&mut b, src);
        CommBuf::Bf16(b)
    }

    /// The elements widened to f32 (exact for bf16): a host copy, for tests and tools.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            CommBuf::F32(b) => b.host().to_vec(),
            CommBuf::Bf16(b) => b.host().iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// The f32 elements, or `None` for a bf16 buffer.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            CommBuf::F32(b) => Some(b.host()),
            CommBuf::Bf16(_) => None,
        }
    }

    /// The bf16 elements, or `None` for an f32 buffer.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        match self {
            CommBuf::F32(_) => None,
            CommBuf::Bf16(b) => Some(b.host()),
        }
    }

    /// The f32 buffer, or `Err(self)` for a bf16 one.
    pub fn into_f32(self) -> Result<Buf<f32>, CommBuf> {
        match self {
            CommBuf::F32(b) => Ok(b),
            other => Err(other),
        }
    }

    /// The bf16 buffer, or `Err(self)` for an f32 one.
    pub fn into_bf16(self) -> Result<Buf<bf16>, CommBuf> {
        match self {
            CommBuf::Bf16(b) => Ok(b),
            other => Err(other),
        }
    }

    /// Overwrites `out` with elements `[start, start + out.len())` widened to f32.
    pub(crate) fn read_into(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            CommBuf::F32(b) => out.copy_from_slice(&b.host()[start..end]),
            CommBuf::Bf16(b) => out
                .iter_mut()
                .zip(&b.host()[start..end])
                .for_each(|(o, x)| *o = x.to_f32()),
        }
    }

    /// Adds elements `[start, start + acc.len())` to `acc`, widened to f32.
    pub(crate) fn add_into(&self, start: usize, acc: &mut [f32]) {
        let end = start + acc.len();
        match self {
            CommBuf::F32(b) => acc
                .iter_mut()
                .zip(&b.host()[start..end])
                .for_each(|(a, x)| *a += x),
            CommBuf::Bf16(b) => acc
                .iter_mut()
                .zip(&b.host()[start..end])
                .for_each(|(a, x)| *a += x.to_f32()),
        }
    }
}

impl From<Buf<f32>> for CommBuf {
    fn from(b: Buf<f32>) -> CommBuf {
        CommBuf::F32(b)
    }
}

impl From<Buf<bf16>> for CommBuf {
    fn from(b: Buf<bf16>) -> CommBuf {
        CommBuf::Bf16(b)
    }
}

/// Builds output buffers of one dtype on one ledger, under [`Category::Communication`].
pub(crate) struct Builder<'a> {
    pub ledger: &'a Ledger,
    pub dtype: DType,
}

impl Builder<'_> {
    /// Rounds (for bf16) f32 values into a new buffer: the single rounding of a reduction.
    /// The f32 values are counted under [`Category::Communication`] while they live beside
    /// the bf16 result (callers count them while they compute them).
    pub fn rounded(&self, v: Vec<f32>) -> CommBuf {
        match self.dtype {
            DType::F32 => CommBuf::F32(self.ledger.from_vec(Category::Communication, v)),
            DType::Bf16 => {
                let _f32 = self.ledger.hold(Category::Communication, 4 * v.len());
                CommBuf::bf16_from_f32_slice(self.ledger, &v)
            }
        }
    }

    /// Concatenates ranges `(buffer, start, end)` of source buffers (all of this builder's
    /// dtype; others are skipped) without rounding.
    pub fn concat(&self, parts: &[(&CommBuf, usize, usize)]) -> CommBuf {
        let total = parts.iter().map(|&(_, s, e)| e - s).sum();
        match self.dtype {
            DType::F32 => {
                let mut v = Vec::with_capacity(total);
                for &(b, s, e) in parts {
                    if let CommBuf::F32(b) = b {
                        v.extend_from_slice(&b.host()[s..e]);
                    }
                }
                CommBuf::F32(self.ledger.from_vec(Category::Communication, v))
            }
            DType::Bf16 => {
                let mut v = Vec::with_capacity(total);
                for &(b, s, e) in parts {
                    if let CommBuf::Bf16(b) = b {
                        v.extend_from_slice(&b.host()[s..e]);
                    }
                }
                CommBuf::Bf16(self.ledger.from_vec(Category::Communication, v))
            }
        }
    }
}

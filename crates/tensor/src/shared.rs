//! A raw output pointer that rayon tasks may share when each writes a disjoint set of
//! elements that `par_chunks_mut` cannot express (strided heads, several outputs per task).

/// A raw pointer that rayon tasks may share: each task writes a disjoint set of elements.
#[derive(Clone, Copy)]
pub(crate) struct Shared(pub(crate) *mut f32);
// SAFETY: callers only let tasks write elements of their own (batch, head) slices, which never
// overlap.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The whole buffer as a slice; callers only touch their own disjoint elements.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0, len)
    }
}

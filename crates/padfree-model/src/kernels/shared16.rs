//! One bf16 store of an activation that several ops keep for their
//! backward passes (`SharedInput16`): the bf16 linear layers that read one
//! norm's output, and the attention kernel with `o_proj`, which reads its
//! output.

use std::sync::{Arc, OnceLock};

use half::bf16;

use super::bf16::round_slice;
use super::gemm_bf16;

/// One input that several bf16 linear layers read (a norm's rounded
/// output: q, k and v read one, gate and up another), kept once for all
/// their backward passes, as bf16, by whichever of them runs first.
/// Apart, each kept the f32 tensor (shared, 4 bytes a value); now nothing
/// keeps it and the layers keep 2 bytes a value between them. Only where
/// the products pack their operands (the AMX and `vdpbf16ps` bodies),
/// which read the bf16 values as they are; the widened body would widen
/// them again in every backward product, so there the layers keep the f32
/// tensor, which it reads where it lies (as with the weights' copies).
///
/// The attention kernel under `--bf16` keeps its output in one for
/// `o_proj` ([`Self::keep`]), on every body: `o_proj` is its only reader,
/// and both kept a bf16 copy apart.
#[derive(Debug, Clone, Default)]
pub struct SharedInput16(Arc<OnceLock<Vec<bf16>>>);

impl SharedInput16 {
    /// A handle for the readers of one input, or `None` where the body
    /// widens its operands (see above).
    pub fn for_packed_bodies() -> Option<Self> {
        (!gemm_bf16::rounds_shared_operands_once()).then(Self::default)
    }

    /// The input as bf16, made from `x` (bf16 values) the first time.
    pub(crate) fn stored(&self, x: &[f32]) -> &[bf16] {
        self.0.get_or_init(|| round_slice(x))
    }

    /// Whether some reader has stored it.
    pub fn is_stored(&self) -> bool {
        self.0.get().is_some()
    }

    /// Stores `x` (bf16 values) as the op that makes it: the attention
    /// kernel keeps its output here for itself and `o_proj`. A second
    /// store is a bug in the caller (one handle per tensor).
    pub(crate) fn keep(&self, x: &[f32]) {
        let fresh = self.0.set(round_slice(x)).is_ok();
        assert!(fresh, "a shared bf16 input stored twice");
    }

    /// What was stored.
    ///
    /// # Panics
    /// Before anything is stored (a backward pass before its forward one).
    pub(crate) fn values(&self) -> &[bf16] {
        self.0.get().expect("stored by the forward pass")
    }
}

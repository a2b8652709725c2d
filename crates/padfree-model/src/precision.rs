//! `--bf16`: which precision the matmuls compute in, and the bf16 copies of
//! the weights they read.
//!
//! Master weights, gradients and optimizer state stay f32 whatever the
//! precision; under [`Precision::Bf16`] every linear layer and the LM head
//! multiply bf16 operands with f32 accumulation (`kernels/gemm_bf16/`):
//! the activation and the output gradient are rounded as the product reads
//! them, the weight comes from its bf16 copy here (or, where the products
//! widen everything to f32 anyway, from the f32 weight rounded as it is
//! read: `gemm_bf16::reads_weight_copies`). The copies are made by
//! [`crate::LlamaModel::refresh_bf16_weights`], which the trainer calls once
//! per optimizer step (after the update), never per micro-batch or layer call;
//! on the CPU the update writes them itself ([`CopyToWrite`]), after the
//! trainer let go of them for the backward pass
//! ([`crate::LlamaModel::release_bf16_copies`]).
//!
//! On a GPU the copies are device tensors of the runtime's 16-bit float
//! ([`HalfFloat`]: bf16 where the runtime has it, CUDA; f16 where it has
//! only that, WGSL's `shader-f16`), and the products are burn's matmul on
//! them with f32 accumulation (`kernels/linear/cube.rs`).

use std::sync::Arc;

use burn::tensor::{DType, FloatDType};
use half::bf16;
use serde::{Deserialize, Serialize};

use rayon::iter::{Either, IndexedParallelIterator};
use rayon::slice::ParallelSliceMut;

use crate::kernels::FreshArc;
use crate::kernels::bf16::{round_into, round_slice};
use crate::kernels::gemm_bf16;
use crate::tensor::{Tensor, with_host_values};

/// What the matmuls compute in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32 (the default).
    #[default]
    F32,
    /// bf16 matmul operands, f32 accumulation, f32 master weights (HF's `bf16=True`).
    Bf16,
}

impl Precision {
    /// The name in logs, reports and checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }

    /// What computes the bf16 products on this CPU, for the log: the
    /// AMX-BF16 or AVX512-BF16 kernel, or f32 products of the bf16 values, which round
    /// as bf16 does but run no faster (see [`Self::cpu_widened_because`]).
    pub fn cpu_matmul_body() -> &'static str {
        gemm_bf16::body().name()
    }

    /// Whether this CPU computes bf16 products with bf16 instructions.
    pub fn cpu_has_bf16_instructions() -> bool {
        gemm_bf16::body() != gemm_bf16::Body::Widened
    }

    /// Why `--bf16` multiplies in f32 on this CPU (no AVX512-BF16, an
    /// Intel CPU, or `PADFREE_BF16_MATMUL=widened`), for a note in the
    /// log; `None` where it runs the bf16 instructions.
    pub fn cpu_widened_because() -> Option<&'static str> {
        gemm_bf16::widened_because()
    }
}

/// The 16-bit float a GPU multiplies in under `--bf16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HalfFloat {
    /// bfloat16 (CUDA): f32's exponent range, 8 bits of mantissa.
    Bf16,
    /// IEEE half (WGSL has no bf16): 11 bits of mantissa but a range of
    /// +-65,504, so the products' output gradients are scaled into it
    /// (`kernels/linear/cube.rs`).
    F16,
}

impl HalfFloat {
    /// The name in logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }

    /// burn's float type (for `Tensor::cast`).
    pub fn dtype(self) -> FloatDType {
        match self {
            Self::Bf16 => FloatDType::BF16,
            Self::F16 => FloatDType::F16,
        }
    }

    /// burn's element type (for the kernels' casts and launches).
    pub fn storage(self) -> DType {
        self.dtype().into()
    }

    /// The 16-bit float of `dtype`, if it is one.
    pub fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::BF16 => Some(Self::Bf16),
            DType::F16 => Some(Self::F16),
            _ => None,
        }
    }
}

/// One weight's bf16 copy for the optimizer's update to write, as it
/// writes the weight: last step's copy in place, or a new one made as it
/// is written (the room taken only then, chunk by chunk: after the
/// backward pass freed last step's, the update makes each copy in the
/// room its weight's gradient leaves).
pub struct CopyToWrite<'a> {
    slot: &'a mut Option<Arc<[bf16]>>,
    len: usize,
    fresh: Option<FreshArc<bf16>>,
}

impl<'a> CopyToWrite<'a> {
    /// A copy of `len` values for `slot`: written in place where the slot
    /// holds one of that length that nothing else holds, else made new.
    pub fn new(slot: &'a mut Option<Arc<[bf16]>>, len: usize) -> Self {
        if slot
            .as_mut()
            .is_some_and(|copy| copy.len() != len || Arc::get_mut(copy).is_none())
        {
            *slot = None;
        }
        Self {
            slot,
            len,
            fresh: None,
        }
    }

    /// How many values the copy holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The copy's values in chunks of `size`, for the writer to set every
    /// one of (a new copy's are zeros until then).
    pub fn par_chunks_mut(
        &mut self,
        size: usize,
    ) -> impl IndexedParallelIterator<Item = &mut [bf16]> + '_ {
        match self.slot.as_mut().and_then(Arc::get_mut) {
            Some(copy) => Either::Left(copy.par_chunks_mut(size)),
            None => {
                let len = self.len;
                let fresh = self.fresh.get_or_insert_with(|| FreshArc::new(len));
                Either::Right(fresh.par_chunks_mut(size))
            }
        }
    }

    /// Puts a new copy in the model's place once written.
    ///
    /// # Panics
    /// When a new copy's chunks were not all handed out.
    pub fn done(self) {
        if let Some(fresh) = self.fresh {
            *self.slot = Some(fresh.finish());
        }
    }
}

/// The bf16 copies of the matrices the matmuls read, indexed like the
/// model's parameters (`None` where a parameter is no matmul operand).
#[derive(Debug, Clone)]
pub(crate) struct Bf16Weights {
    /// On the CPU: the copies as host bf16 values.
    pub copies: Vec<Option<Arc<[bf16]>>>,
    /// On a GPU (`half` set): the copies as device tensors of `half`, off
    /// the autodiff graph.
    pub device: Vec<Option<Tensor<2>>>,
    /// The GPU's 16-bit float; `None` on the CPU.
    pub half: Option<HalfFloat>,
    /// On the CPU: whether the dense weights get host copies at all
    /// (`gemm_bf16::reads_weight_copies`: not where the products widen
    /// everything to f32; they then read the f32 weights rounded).
    pub host_copies: bool,
    /// How many times the copies were made (tests check "once per step").
    pub refreshes: u64,
    /// The lengths of the copies let go of by [`Self::release`] (0 where
    /// none was), for the update to make again.
    pub released: Vec<usize>,
}

impl Default for Bf16Weights {
    fn default() -> Self {
        Self {
            copies: Vec::new(),
            device: Vec::new(),
            half: None,
            host_copies: gemm_bf16::reads_weight_copies(),
            refreshes: 0,
            released: Vec::new(),
        }
    }
}

impl Bf16Weights {
    /// Copies of `params` where `wanted` says, each rounded on rayon's
    /// threads straight from the weight's buffer, into last step's copy
    /// when nothing else holds it (no allocation), else into a new one.
    pub fn refresh(&mut self, params: &[&Tensor<2>], wanted: impl Fn(usize) -> bool) {
        if let Some(half) = self.half {
            // On the device: one cast kernel per weight, nothing read back.
            self.device = params
                .iter()
                .enumerate()
                .map(|(index, value)| {
                    wanted(index).then(|| (*value).clone().inner().cast(half.dtype()))
                })
                .collect();
            self.refreshes += 1;
            return;
        }
        let mut previous = std::mem::take(&mut self.copies).into_iter();
        self.copies = params
            .iter()
            .enumerate()
            .map(|(index, value)| {
                let last = previous.next().flatten();
                wanted(index).then(|| {
                    with_host_values((*value).clone(), |values| {
                        last.filter(|copy| copy.len() == values.len())
                            .and_then(|mut copy| {
                                round_into(values, Arc::get_mut(&mut copy)?);
                                Some(copy)
                            })
                            .unwrap_or_else(|| round_slice(values).into())
                    })
                })
            })
            .collect();
        self.released.clear();
        self.refreshes += 1;
    }

    /// Lets go of the host copies and returns the bytes let go of:
    /// whatever else holds one (the ops of a forward pass, for their
    /// backward pass) keeps it until done with it, and then its memory is
    /// free. [`Self::lend_for_writing`] makes them again; until then a copy
    /// let go of stays so (its length kept), however often this is called.
    pub fn release(&mut self) -> usize {
        let before = std::mem::take(&mut self.released);
        let mut bytes = 0;
        self.released = self
            .copies
            .iter_mut()
            .enumerate()
            .map(|(index, copy)| match copy.take() {
                Some(copy) => {
                    bytes += 2 * copy.len();
                    copy.len()
                }
                None => before.get(index).copied().unwrap_or(0),
            })
            .collect();
        bytes
    }

    /// The host copies for whoever updates their weights to write, in
    /// parameter order (`None` where a parameter has none): last step's
    /// in place where nothing else holds it, else (held elsewhere, or let
    /// go of by [`Self::release`]) a new one, allocated only when its
    /// writer starts on it. Counts as a refresh, which the writer owes:
    /// every value of every copy ([`CopyToWrite::done`]).
    pub fn lend_for_writing(&mut self) -> Vec<Option<CopyToWrite<'_>>> {
        self.refreshes += 1;
        let mut released = std::mem::take(&mut self.released).into_iter();
        self.copies
            .iter_mut()
            .map(|slot| {
                let was_released = released.next().unwrap_or(0);
                let len = match slot {
                    Some(copy) => copy.len(),
                    None => was_released,
                };
                (slot.is_some() || len > 0).then(|| CopyToWrite::new(slot, len))
            })
            .collect()
    }

    /// The copy of parameter `index`, if it has one.
    pub fn get(&self, index: usize) -> Option<&Arc<[bf16]>> {
        self.copies.get(index).and_then(Option::as_ref)
    }

    /// The device copy of parameter `index`, if it has one (on a GPU).
    pub fn get_device(&self, index: usize) -> Option<&Tensor<2>> {
        self.device.get(index).and_then(Option::as_ref)
    }

    /// Bytes the copies take.
    pub fn bytes(&self) -> usize {
        let host: usize = self.copies.iter().flatten().map(|c| 2 * c.len()).sum();
        let device: usize = self
            .device
            .iter()
            .flatten()
            .map(|c| 2 * c.shape().num_elements())
            .sum();
        host + device
    }
}

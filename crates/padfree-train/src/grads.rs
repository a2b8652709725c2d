//! The gradient sums of one optimizer step, where the model runs: host
//! vectors on the CPU (summed in micro-batch order, bit-exact), device
//! tensors on a GPU (nothing read back but the norm's one scalar per
//! parameter, and with several ranks one flat copy for the exchange).

use rayon::prelude::*;

use padfree_model::Param;
use padfree_model::tensor::{Device, IntoHostVec, Tensor, cat, float_tensor};

use crate::comm::Communicator;
use crate::error::TrainError;

/// Every parameter's gradient sum, in parameter order; empty (host) or
/// `None` (device) until a micro-batch reaches it.
#[derive(Debug)]
pub(crate) enum GradSums {
    /// On the CPU.
    Host(Vec<Vec<f32>>),
    /// On a GPU (no autodiff).
    Device(Vec<Option<Tensor<2>>>),
}

impl GradSums {
    /// No gradients yet for `params` parameters, on the host or the device.
    pub(crate) fn new(on_device: bool, params: usize) -> Self {
        if on_device {
            Self::Device(vec![None; params])
        } else {
            Self::Host(vec![Vec::new(); params])
        }
    }

    /// Adds one micro-batch's gradient of parameter `index`.
    pub(crate) fn add(&mut self, index: usize, gradient: Tensor<2>) {
        match self {
            Self::Host(sums) => {
                let g = gradient.into_vec();
                let acc = &mut sums[index];
                if acc.is_empty() {
                    *acc = g;
                } else {
                    acc.par_iter_mut().zip(g).for_each(|(a, v)| *a += v);
                }
            }
            Self::Device(sums) => {
                let acc = &mut sums[index];
                *acc = Some(match acc.take() {
                    Some(sum) => sum + gradient,
                    None => gradient,
                });
            }
        }
    }

    /// A parameter no micro-batch reached has a zero gradient.
    pub(crate) fn zero_where_missing(&mut self, params: &[&Param], device: &Device) {
        match self {
            Self::Host(sums) => {
                for (acc, param) in sums.iter_mut().zip(params) {
                    if acc.is_empty() {
                        *acc = vec![0.0; param.numel()];
                    }
                }
            }
            Self::Device(sums) => {
                for (acc, param) in sums.iter_mut().zip(params) {
                    if acc.is_none() {
                        let dims = param.value.dims();
                        *acc = Some(float_tensor(vec![0.0; param.numel()], dims, device));
                    }
                }
            }
        }
    }

    /// Sums the ranks' gradients through one flat host buffer in parameter
    /// order; every rank gets the same bits.
    pub(crate) fn all_reduce(
        &mut self,
        comm: &dyn Communicator,
        device: &Device,
    ) -> Result<(), TrainError> {
        let mut flat: Vec<f32> = Vec::new();
        match self {
            Self::Host(sums) => {
                flat.reserve(sums.iter().map(Vec::len).sum());
                for g in sums.iter() {
                    flat.extend_from_slice(g);
                }
                comm.all_reduce_sum_f32(&mut flat)?;
                let mut rest = flat.as_slice();
                for g in sums.iter_mut() {
                    let (head, tail) = rest.split_at(g.len());
                    g.copy_from_slice(head);
                    rest = tail;
                }
            }
            Self::Device(sums) => {
                let tensors: Vec<Tensor<2>> = sums.iter().flatten().cloned().collect();
                let dims: Vec<[usize; 2]> = tensors.iter().map(Tensor::dims).collect();
                let flattened: Vec<Tensor<1>> = tensors
                    .into_iter()
                    .map(|t| {
                        let n: usize = t.dims().iter().product();
                        t.reshape([n])
                    })
                    .collect();
                flat = cat(flattened, 0).into_vec();
                comm.all_reduce_sum_f32(&mut flat)?;
                let mut rest = flat.as_slice();
                for (acc, dims) in sums.iter_mut().zip(dims) {
                    let (head, tail) = rest.split_at(dims[0] * dims[1]);
                    *acc = Some(float_tensor(head.to_vec(), dims, device));
                    rest = tail;
                }
            }
        }
        Ok(())
    }

    /// The L2 norm of all gradients together. On the host in f64: each
    /// tensor's sum of squares on its own thread, in element order, the sums
    /// added in parameter order (the same value however many threads run).
    /// On a device each tensor's sum of squares is taken there in f32, and
    /// the per-tensor sums come back as one small vector.
    pub(crate) fn global_norm(&self) -> f64 {
        match self {
            Self::Host(sums) => {
                let per_tensor: Vec<f64> = sums
                    .par_iter()
                    .map(|g| g.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>())
                    .collect();
                per_tensor.iter().sum::<f64>().sqrt()
            }
            Self::Device(sums) => {
                let per_tensor: Vec<Tensor<1>> = sums
                    .iter()
                    .flatten()
                    .map(|g| g.clone().powi_scalar(2).sum())
                    .collect();
                if per_tensor.is_empty() {
                    return 0.0;
                }
                cat(per_tensor, 0)
                    .into_vec()
                    .iter()
                    .map(|&x| f64::from(x))
                    .sum::<f64>()
                    .sqrt()
            }
        }
    }
}

//! The gradient sums of one optimizer step, where the model runs: host
//! vectors on the CPU (summed in micro-batch order, bit-exact), device
//! tensors on a GPU (nothing read back but the norm's one scalar per
//! parameter, and with several ranks one flat copy for the exchange).

use rayon::prelude::*;

use padfree_model::Param;
use padfree_model::kernels::{
    ADD_PAIRS_GROUP, add_pairs, host_sum_of_squares, host_sums_of_squares, sums_of_squares,
};
use padfree_model::tensor::{Device, IntoHostVec, Tensor, cat, float_tensor, with_host_values};

use crate::comm::{Communicator, Flat};
use crate::config::Exchange;
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

/// Elements per chunk of the host gradient norm.
const NORM_CHUNK: usize = 1 << 16;
/// `acc += gradient` on the host; an empty `acc` (no micro-batch yet)
/// takes the gradient's buffer.
pub(crate) fn add_on_host(acc: &mut Vec<f32>, gradient: Tensor<2>) {
    if acc.is_empty() {
        *acc = gradient.into_vec();
    } else {
        with_host_values(gradient, |g| {
            acc.par_iter_mut().zip(g).for_each(|(a, v)| *a += v);
        });
    }
}

/// Sums host buffers over the ranks, laid end to end: the ring's
/// reduce-scatter then its all-gather, in place; every rank gets the same
/// bits. The sum order of an element depends on where it falls among the
/// `W` shards of these buffers, so the whole set and one bucket of it at a
/// time round differently (each deterministically).
pub(crate) fn ring_all_reduce(
    comm: &dyn Communicator,
    buffers: &mut [Vec<f32>],
) -> Result<(), TrainError> {
    let mut parts: Vec<&mut [f32]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
    comm.reduce_scatter_sum_f32(&mut parts)?;
    comm.all_gather_f32(&mut parts)?;
    Ok(())
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

    /// Adds one micro-batch's gradients, `(parameter index, gradient)` in
    /// any order. On a device the sums already started are added eight
    /// pairs a launch (`kernels::add_pairs`), where burn's `add` was a
    /// launch a parameter: each sum written into its new gradient, which
    /// the caller hands over as its buffer's only owner, and a group's old
    /// sums dropped before the next group runs. Each parameter's additions
    /// stay in micro-batch order (an index met twice adds the first first).
    pub(crate) fn add_all(&mut self, gradients: Vec<(usize, Tensor<2>)>) {
        let sums = match self {
            Self::Host(sums) => {
                for (index, gradient) in gradients {
                    add_on_host(&mut sums[index], gradient);
                }
                return;
            }
            Self::Device(sums) => sums,
        };
        let mut pending: Vec<(usize, (Tensor<2>, Tensor<2>))> = Vec::new();
        let flush = |sums: &mut Vec<Option<Tensor<2>>>, pending: &mut Vec<_>| {
            let (indices, pairs): (Vec<usize>, Vec<_>) =
                std::mem::take(pending).into_iter().unzip();
            for (index, sum) in indices.into_iter().zip(add_pairs(pairs)) {
                sums[index] = Some(sum);
            }
        };
        for (index, gradient) in gradients {
            if pending.iter().any(|(i, _)| *i == index) {
                flush(sums, &mut pending);
            }
            match sums[index].take() {
                Some(sum) => pending.push((index, (sum, gradient))),
                None => sums[index] = Some(gradient),
            }
            if pending.len() == ADD_PAIRS_GROUP {
                flush(sums, &mut pending);
            }
        }
        flush(sums, &mut pending);
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

    /// Sums the ranks' gradients, laid end to end in parameter order;
    /// every rank gets the same bits. The ring runs over the host sums
    /// where they are; gather-and-add (and a device's sums) go through one
    /// flat host copy.
    pub(crate) fn all_reduce(
        &mut self,
        comm: &dyn Communicator,
        device: &Device,
        exchange: Exchange,
    ) -> Result<(), TrainError> {
        let mut flat: Vec<f32> = Vec::new();
        match self {
            Self::Host(sums) if exchange == Exchange::Ring => ring_all_reduce(comm, sums)?,
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
                match exchange {
                    Exchange::Ring => {
                        comm.reduce_scatter_sum_f32(&mut [flat.as_mut_slice()])?;
                        comm.all_gather_f32(&mut [flat.as_mut_slice()])?;
                    }
                    Exchange::Gather => comm.all_reduce_sum_f32(&mut flat)?,
                }
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

    /// ZeRO stage 1: the ring's reduce-scatter alone, so this rank's shard
    /// of the host sums holds the sums over all ranks (the rest are partial
    /// sums, left unused). Returns the L2 norm of all gradients, from every
    /// rank's sum of squares of its shard, added in rank order in f64.
    pub(crate) fn reduce_scatter(
        &mut self,
        comm: &dyn Communicator,
        shard: std::ops::Range<usize>,
    ) -> Result<f64, TrainError> {
        let Self::Host(sums) = self else {
            return Err(TrainError::Config {
                flag: "zero-stage",
                message: "the sharded optimizer runs on the CPU only".into(),
                hint: "use --zero-stage 0 on a GPU",
            });
        };
        let mut parts: Vec<&mut [f32]> = sums.iter_mut().map(Vec::as_mut_slice).collect();
        comm.reduce_scatter_sum_f32(&mut parts)?;
        let flat = Flat::new(&mut parts);
        let per_chunk: Vec<f64> = (0..shard.len().div_ceil(NORM_CHUNK))
            .into_par_iter()
            .map(|k| {
                let start = shard.start + k * NORM_CHUNK;
                let mut own = Vec::new();
                flat.read(start..(start + NORM_CHUNK).min(shard.end), &mut own);
                host_sum_of_squares(&own)
            })
            .collect();
        let mut squares = [per_chunk.iter().sum::<f64>()];
        comm.all_reduce_sum_f64(&mut squares)?;
        Ok(squares[0].sqrt())
    }

    /// The L2 norm of all gradients together. On the host in f64, over
    /// fixed chunks of every tensor ([`NORM_CHUNK`] elements), each summed
    /// in eight interleaved lanes ([`host_sum_of_squares`], four chunks at a
    /// time: [`host_sums_of_squares`]) and the chunk sums added in
    /// order: the same value however many threads run, and the large
    /// tensors (embedding, head) spread over all threads instead of one
    /// serial f64 sum each (a 16M-element table took 25 ms that way).
    /// On a device each tensor's sum of squares is taken there in f32 (one
    /// fused launch a tensor and one to combine: `kernels::sums_of_squares`),
    /// and the per-tensor sums come back as one small vector.
    pub(crate) fn global_norm(&self) -> f64 {
        match self {
            Self::Host(sums) => {
                let chunks: Vec<&[f32]> = sums.iter().flat_map(|g| g.chunks(NORM_CHUNK)).collect();
                // Four chunks a task, summed in one loop (`host_sums_of_squares`:
                // each the bits of its own sum, four times the additions in flight).
                let per_four: Vec<Vec<f64>> =
                    chunks.par_chunks(4).map(host_sums_of_squares).collect();
                per_four.iter().flatten().sum::<f64>().sqrt()
            }
            Self::Device(sums) => {
                let present: Vec<Tensor<2>> = sums.iter().flatten().cloned().collect();
                let Some(per_tensor) = sums_of_squares(&present) else {
                    return 0.0;
                };
                per_tensor
                    .into_vec()
                    .iter()
                    .map(|&x| f64::from(x))
                    .sum::<f64>()
                    .sqrt()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunked, laned norm against one serial f64 sum, and the same
    /// bits on 1 and 3 threads, over tensors shorter and longer than a
    /// chunk (one not a multiple of the lanes; four whole chunks, which are
    /// summed together).
    #[test]
    fn host_norm_matches_a_serial_sum_on_any_thread_count() {
        let mut rng = padfree_pack::SplitMix64::new(7);
        let sums: Vec<Vec<f32>> = [NORM_CHUNK * 4 + 13, 5, 1000]
            .iter()
            .map(|&n| (0..n).map(|_| rng.standard_normal() as f32).collect())
            .collect();
        let serial: f64 = sums
            .iter()
            .flatten()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt();
        let grads = GradSums::Host(sums);
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("thread pool")
                .install(|| grads.global_norm())
        };
        let (one, three) = (on(1), on(3));
        assert_eq!(one.to_bits(), three.to_bits());
        // Four chunks at a time is the chunk-by-chunk sum, bit for bit.
        let GradSums::Host(sums) = &grads else {
            unreachable!("host sums")
        };
        let by_chunk = sums
            .iter()
            .flat_map(|g| g.chunks(NORM_CHUNK))
            .map(host_sum_of_squares)
            .sum::<f64>()
            .sqrt();
        assert_eq!(one.to_bits(), by_chunk.to_bits());
        assert!((one - serial).abs() <= 1e-12 * serial, "{one} vs {serial}");
    }

    /// The device sums' bookkeeping (run here on CPU tensors, where
    /// `add_pairs` falls back to burn's `add`): twenty parameters over
    /// three micro-batches, handed in shuffled orders, some missing from a
    /// micro-batch, one handed twice in a call, so that groups of eight
    /// fill, flush early on a repeated index and flush the rest at the
    /// end. Every sum is its parameter's gradients added in the order
    /// they came, bit for bit.
    #[test]
    fn device_sums_add_every_gradient_once_in_order() {
        use padfree_model::tensor::cpu_device;
        let device = cpu_device(false);
        let params = 20;
        let value = |micro: usize, index: usize, part: usize| {
            ((micro * 31 + index * 7 + part * 3) % 17) as f32 * 0.37 + 0.011
        };
        let gradient = |micro: usize, index: usize, part: usize| {
            let values: Vec<f32> = (0..6)
                .map(|e| value(micro, index, part) * (e as f32 + 1.5))
                .collect();
            float_tensor(values, [2, 3], &device)
        };
        let mut grads = GradSums::new(true, params);
        let mut expected: Vec<Option<Vec<f32>>> = vec![None; params];
        for micro in 0..3 {
            // Parameter 5 skips micro-batch 0; parameter 11 comes twice in
            // micro-batch 1.
            let mut order: Vec<(usize, usize)> = (0..params)
                .filter(|&i| !(micro == 0 && i == 5))
                .map(|i| ((i * 7 + micro * 3) % params, 0))
                .collect();
            if micro == 1 {
                order.insert(3, (11, 1));
            }
            let handed: Vec<(usize, Tensor<2>)> = order
                .iter()
                .map(|&(i, part)| (i, gradient(micro, i, part)))
                .collect();
            for (i, g) in &handed {
                let g = g.clone().into_vec();
                expected[*i] = Some(match expected[*i].take() {
                    Some(sum) => sum.iter().zip(&g).map(|(a, b)| a + b).collect(),
                    None => g,
                });
            }
            grads.add_all(handed);
        }
        let GradSums::Device(sums) = grads else {
            unreachable!("device sums")
        };
        for (i, (sum, want)) in sums.into_iter().zip(expected).enumerate() {
            let sum = sum.expect("every parameter reached").into_vec();
            let want = want.expect("every parameter reached");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&sum),
                bits(&want),
                "parameter {i}: {sum:?} vs {want:?}"
            );
        }
    }
}

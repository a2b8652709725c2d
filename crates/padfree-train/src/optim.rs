use std::ops::Range;

use half::bf16;
use padfree_model::CopyToWrite;
use padfree_model::kernels::{
    ADAMW_GROUP, AdamWState, AdamWStep, adamw_update_all, round_bf16, simd_dispatch,
};
use padfree_model::tensor::{Device, IntoHostVec, Tensor, float_tensor};
use rayon::prelude::*;

use crate::comm::{CommError, Communicator, shard_range};

/// AdamW with decoupled weight decay, step for step as PyTorch's
/// `torch.optim.AdamW` (non-fused) computes it, in f32.
///
/// Holds the master copy of every parameter on the host, so an update never
/// reads the weights back from the device, and a checkpoint of it is exact.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    /// Adam's first-moment decay.
    pub beta1: f64,
    /// Adam's second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub epsilon: f64,
    /// Decoupled weight decay for the parameters with `decays[i]`.
    pub weight_decay: f64,
    groups: Vec<ParamState>,
    step: u64,
}

/// One parameter's values and moments.
#[derive(Debug, Clone, PartialEq)]
struct ParamState {
    name: String,
    decays: bool,
    /// `[N]`, the whole parameter (every rank holds every weight).
    values: Vec<f32>,
    /// `N`.
    numel: usize,
    /// The elements this rank updates and keeps moments of: all of them
    /// unsharded, its part of the rank's shard with ZeRO stage 1 (maybe
    /// none).
    shard: Range<usize>,
    /// `[shard]`.
    exp_avg: Vec<f32>,
    /// `[shard]`.
    exp_avg_sq: Vec<f32>,
}

/// Elements per rayon task of an update: large enough to amortise scheduling.
const ELEMENTS_PER_TASK: usize = 1 << 15;

/// The scalars of one update step.
#[derive(Debug, Clone, Copy)]
struct Update {
    grad_scale: f32,
    decay: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    step_size: f32,
    bias_correction2_sqrt: f32,
}

impl Update {
    /// torch's formula for one element: updates its moments, returns its
    /// new value. Inlined into the loops below, which run in
    /// [`simd_dispatch`]'s body so that they vectorise for the CPU's
    /// instruction set.
    #[inline(always)]
    fn element(&self, value: f32, exp_avg: &mut f32, exp_avg_sq: &mut f32, raw: f32) -> f32 {
        let g = raw * self.grad_scale;
        let p = value * self.decay;
        let m = *exp_avg + (g - *exp_avg) * (1.0 - self.beta1);
        let v = *exp_avg_sq * self.beta2 + (1.0 - self.beta2) * g * g;
        let denom = v.sqrt() / self.bias_correction2_sqrt + self.eps;
        *exp_avg = m;
        *exp_avg_sq = v;
        p - self.step_size * (m / denom)
    }

    #[inline(always)]
    fn apply(&self, values: &mut [f32], exp_avg: &mut [f32], exp_avg_sq: &mut [f32], grad: &[f32]) {
        let moments = exp_avg.iter_mut().zip(exp_avg_sq.iter_mut());
        for ((value, (exp_avg, exp_avg_sq)), &raw) in values.iter_mut().zip(moments).zip(grad) {
            *value = self.element(*value, exp_avg, exp_avg_sq, raw);
        }
    }

    /// [`Self::apply`], also writing each new value rounded to bf16 into
    /// `copy` (`--bf16`'s weight copies, in the same pass).
    #[inline(always)]
    fn apply_rounding(
        &self,
        values: &mut [f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        grad: &[f32],
        copy: &mut [bf16],
    ) {
        let moments = exp_avg.iter_mut().zip(exp_avg_sq.iter_mut());
        let outputs = values.iter_mut().zip(copy.iter_mut());
        for (((value, copy), (exp_avg, exp_avg_sq)), &raw) in outputs.zip(moments).zip(grad) {
            *value = self.element(*value, exp_avg, exp_avg_sq, raw);
            *copy = round_bf16(*value);
        }
    }
}

/// Whether weight decay applies: HF's Trainer spares norm weights and biases.
pub(crate) fn decays(name: &str) -> bool {
    !(name.contains("norm") || name.ends_with(".bias"))
}

impl AdamW {
    /// Zero moments for parameters `(name, values)`, in model order.
    pub fn new(
        params: Vec<(String, Vec<f32>)>,
        beta1: f64,
        beta2: f64,
        epsilon: f64,
        weight_decay: f64,
    ) -> Self {
        let groups = params
            .into_iter()
            .map(|(name, values)| ParamState {
                decays: decays(&name),
                exp_avg: vec![0.0; values.len()],
                exp_avg_sq: vec![0.0; values.len()],
                numel: values.len(),
                shard: 0..values.len(),
                name,
                values,
            })
            .collect();
        Self {
            beta1,
            beta2,
            epsilon,
            weight_decay,
            groups,
            step: 0,
        }
    }

    /// Steps taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// ZeRO stage 1: from now on this rank keeps moments for, and updates,
    /// only `shard_range(N, W, rank)` of the parameters laid end to end in
    /// order (`N` elements). Moments outside it are dropped (call before
    /// the first step, or after [`Self::restore`] of whole moments).
    pub fn shard(&mut self, world_size: usize, rank: usize) {
        let total: usize = self.groups.iter().map(|g| g.numel).sum();
        let own = shard_range(total, world_size, rank);
        let mut start = 0;
        for group in &mut self.groups {
            let (lo, hi) = (own.start.max(start), own.end.min(start + group.numel));
            let local = if lo < hi {
                lo - start..hi - start
            } else {
                0..0
            };
            let keep = |v: &mut Vec<f32>, from: &Range<usize>| {
                let cut = local.start - from.start..local.end - from.start;
                *v = v[cut].to_vec();
            };
            let from = group.shard.clone();
            keep(&mut group.exp_avg, &from);
            keep(&mut group.exp_avg_sq, &from);
            group.shard = local;
            start += group.numel;
        }
    }

    /// Whether some parameter's moments are held only in part.
    pub fn is_sharded(&self) -> bool {
        self.groups.iter().any(|g| g.shard.len() != g.numel)
    }

    /// Bytes of moments this rank holds.
    pub fn moment_bytes(&self) -> usize {
        self.groups.iter().map(|g| 8 * g.exp_avg.len()).sum()
    }

    /// The same optimizer with every rank's moments gathered whole (for a
    /// checkpoint, which holds one set of moments whatever the world size);
    /// the values are left out (they are the model's).
    pub fn gathered(&self, comm: &dyn Communicator) -> Result<AdamW, CommError> {
        let whole = |pick: fn(&ParamState) -> &Vec<f32>| -> Vec<Vec<f32>> {
            self.groups
                .iter()
                .map(|g| {
                    let mut v = vec![0.0f32; g.numel];
                    v[g.shard.clone()].copy_from_slice(pick(g));
                    v
                })
                .collect()
        };
        let (mut exp_avg, mut exp_avg_sq) = (whole(|g| &g.exp_avg), whole(|g| &g.exp_avg_sq));
        for moments in [&mut exp_avg, &mut exp_avg_sq] {
            let mut parts: Vec<&mut [f32]> = moments.iter_mut().map(Vec::as_mut_slice).collect();
            comm.all_gather_f32(&mut parts)?;
        }
        let groups = self
            .groups
            .iter()
            .zip(exp_avg.into_iter().zip(exp_avg_sq))
            .map(|(g, (exp_avg, exp_avg_sq))| ParamState {
                name: g.name.clone(),
                decays: g.decays,
                values: Vec::new(),
                numel: g.numel,
                shard: 0..g.numel,
                exp_avg,
                exp_avg_sq,
            })
            .collect();
        Ok(AdamW {
            groups,
            ..self.clone_without_groups()
        })
    }

    fn clone_without_groups(&self) -> AdamW {
        AdamW {
            beta1: self.beta1,
            beta2: self.beta2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            groups: Vec::new(),
            step: self.step,
        }
    }

    /// Every parameter's whole values, for the all-gather of the weights
    /// each rank updated its shard of.
    pub(crate) fn values_mut(&mut self) -> Vec<&mut [f32]> {
        self.groups
            .iter_mut()
            .map(|g| g.values.as_mut_slice())
            .collect()
    }

    /// One update with `grads` (same order and sizes as the parameters),
    /// each multiplied by `grad_scale` first (the clipping coefficient).
    pub fn step(&mut self, grads: &[Vec<f32>], grad_scale: f32, lr: f64) {
        self.update(grads.iter().map(Vec::as_slice), grad_scale, lr, &mut []);
    }

    /// [`Self::step`], writing each updated parameter that has an entry in
    /// `copies` (same order; missing or `None`: none) rounded to bf16 there
    /// too, in the same pass (`--bf16`'s weight copies: the values
    /// `LlamaModel::refresh_bf16_weights` would make, without reading the
    /// weights again). Each gradient is freed once its parameter is
    /// updated, so that a copy made new here (its last one freed in the
    /// backward pass: `LlamaModel::release_bf16_copies`) takes the room
    /// of the gradients before it rather than adding to them; the
    /// longest copies are made last (`copy_order`).
    ///
    /// # Panics
    /// When a copy's length is not its parameter's, or a copy is given for
    /// a sharded parameter (this rank updates only part of it; the rest
    /// arrives with the all-gather, so the caller refreshes after that).
    pub fn step_writing_bf16(
        &mut self,
        grads: Vec<Vec<f32>>,
        grad_scale: f32,
        lr: f64,
        copies: &mut [Option<CopyToWrite<'_>>],
    ) {
        self.update(grads.into_iter(), grad_scale, lr, copies);
    }

    /// The update, each gradient dropped once its parameter is done.
    fn update<G: AsRef<[f32]>>(
        &mut self,
        grads: impl Iterator<Item = G>,
        grad_scale: f32,
        lr: f64,
        copies: &mut [Option<CopyToWrite<'_>>],
    ) {
        self.step += 1;
        let bias_correction1 = 1.0 - self.beta1.powi(self.step as i32);
        let bias_correction2 = 1.0 - self.beta2.powi(self.step as i32);
        let step_size = (lr / bias_correction1) as f32;
        let bias_correction2_sqrt = bias_correction2.sqrt() as f32;
        let (beta1, beta2, eps) = (self.beta1 as f32, self.beta2 as f32, self.epsilon as f32);
        let decay_factor = (1.0 - lr * self.weight_decay) as f32;
        let mut grads: Vec<Option<G>> = grads.map(Some).collect();
        assert_eq!(
            grads.len(),
            self.groups.len(),
            "AdamW: {} gradients for {} parameters",
            grads.len(),
            self.groups.len()
        );
        for index in copy_order(copies, grads.len()) {
            let state = &mut self.groups[index];
            let Some(grad) = grads[index].take() else {
                unreachable!("each parameter is updated once")
            };
            let grad = grad.as_ref();
            let update = Update {
                grad_scale,
                decay: if state.decays { decay_factor } else { 1.0 },
                beta1,
                beta2,
                eps,
                step_size,
                bias_correction2_sqrt,
            };
            // Every element is updated on its own, so splitting the work over
            // threads (or ranks) leaves the result bit-identical.
            let shard = state.shard.clone();
            let chunks = state.values[shard.clone()]
                .par_chunks_mut(ELEMENTS_PER_TASK)
                .zip(state.exp_avg.par_chunks_mut(ELEMENTS_PER_TASK))
                .zip(state.exp_avg_sq.par_chunks_mut(ELEMENTS_PER_TASK))
                .zip(grad[shard.clone()].par_chunks(ELEMENTS_PER_TASK));
            // Built for baseline x86-64 the loop's square roots and
            // divisions take 4 lanes at a time: 120-131 ms against 113-115
            // ms for SmolLM2-135M's 135M values on 2 threads (then it is
            // the memory's 34 GB/s). IEEE square roots and quotients round
            // the same in every width: the same bits.
            match copies.get_mut(index).and_then(Option::take) {
                None => chunks.for_each(|(((values, exp_avg), exp_avg_sq), grad)| {
                    simd_dispatch(
                        #[inline(always)]
                        || update.apply(values, exp_avg, exp_avg_sq, grad),
                    );
                }),
                Some(mut copy) => {
                    assert!(
                        copy.len() == state.numel && shard == (0..state.numel),
                        "parameter {}: a bf16 copy of {} values for an update of {:?} of {}",
                        state.name,
                        copy.len(),
                        shard,
                        state.numel
                    );
                    chunks.zip(copy.par_chunks_mut(ELEMENTS_PER_TASK)).for_each(
                        |((((values, exp_avg), exp_avg_sq), grad), copy)| {
                            simd_dispatch(
                                #[inline(always)]
                                || update.apply_rounding(values, exp_avg, exp_avg_sq, grad, copy),
                            );
                        },
                    );
                    copy.done();
                }
            }
        }
    }

    /// Current values of parameter `index` (empty while lent to the model).
    pub fn values(&self, index: usize) -> &[f32] {
        &self.groups[index].values
    }

    /// Moves parameter `index`'s values out, for the model to hold between
    /// steps: on the CPU they become its tensor without a copy (a copy of
    /// every weight per step was 3% of a short-example step on `medium`).
    pub(crate) fn lend_values(&mut self, index: usize) -> Vec<f32> {
        std::mem::take(&mut self.groups[index].values)
    }

    /// Whether parameter `index`'s values are lent out.
    pub(crate) fn is_lent(&self, index: usize) -> bool {
        self.groups[index].values.is_empty() && self.groups[index].numel > 0
    }

    /// Takes back what [`Self::lend_values`] lent (the same length).
    pub(crate) fn return_values(&mut self, index: usize, values: Vec<f32>) {
        let group = &mut self.groups[index];
        assert_eq!(
            values.len(),
            group.numel,
            "parameter {} came back with another size",
            group.name
        );
        group.values = values;
    }

    /// Number of parameters (tensors).
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// True when there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// `(name, exp_avg, exp_avg_sq)` of every parameter, for checkpoints
    /// (this rank's part of them when sharded: see [`Self::gathered`]).
    pub fn moments(&self) -> impl Iterator<Item = (&str, &[f32], &[f32])> {
        self.groups.iter().map(|g| {
            (
                g.name.as_str(),
                g.exp_avg.as_slice(),
                g.exp_avg_sq.as_slice(),
            )
        })
    }

    /// Restores moments and the step count saved by a checkpoint (whole
    /// moments, whatever world size wrote them: a sharded optimizer keeps
    /// its shard of them, cut again for this world size).
    pub(crate) fn restore(
        &mut self,
        step: u64,
        mut moments: impl FnMut(&str, usize) -> Result<(Vec<f32>, Vec<f32>), String>,
    ) -> Result<(), String> {
        for group in &mut self.groups {
            let (exp_avg, exp_avg_sq) = moments(&group.name, group.numel)?;
            group.exp_avg = exp_avg[group.shard.clone()].to_vec();
            group.exp_avg_sq = exp_avg_sq[group.shard.clone()].to_vec();
        }
        self.step = step;
        Ok(())
    }
}

/// AdamW's values and moments on a GPU, so a step reads nothing back to the
/// host: the same formula as [`Update::apply`], one fused kernel launch for
/// four parameters (`padfree_model::kernels::adamw_update_all`; f32 on the device,
/// its rounding the device's, not bit-identical to the host loop). The
/// host [`AdamW`] keeps the step count and hyperparameters and is brought
/// up to date from here before a checkpoint is written.
#[derive(Debug, Clone)]
pub(crate) struct DeviceAdamW {
    values: Vec<Tensor<2>>,
    exp_avg: Vec<Tensor<2>>,
    exp_avg_sq: Vec<Tensor<2>>,
}

impl DeviceAdamW {
    /// The current values of parameter `index`, on the device.
    pub(crate) fn values(&self, index: usize) -> &Tensor<2> {
        &self.values[index]
    }
}

impl AdamW {
    /// Uploads values and moments to `device` (no autodiff), each with the
    /// matrix shape of its parameter.
    pub(crate) fn to_device(&self, shapes: &[[usize; 2]], device: &Device) -> DeviceAdamW {
        let upload = |v: &[f32], shape: [usize; 2]| float_tensor(v.to_vec(), shape, device);
        let mut out = DeviceAdamW {
            values: Vec::with_capacity(self.groups.len()),
            exp_avg: Vec::with_capacity(self.groups.len()),
            exp_avg_sq: Vec::with_capacity(self.groups.len()),
        };
        for (group, &shape) in self.groups.iter().zip(shapes) {
            out.values.push(upload(&group.values, shape));
            out.exp_avg.push(upload(&group.exp_avg, shape));
            out.exp_avg_sq.push(upload(&group.exp_avg_sq, shape));
        }
        out
    }

    /// Copies the device's values and moments back (before a checkpoint).
    pub(crate) fn copy_from_device(&mut self, device: &DeviceAdamW) {
        for (i, group) in self.groups.iter_mut().enumerate() {
            group.values = device.values[i].clone().into_vec();
            group.exp_avg = device.exp_avg[i].clone().into_vec();
            group.exp_avg_sq = device.exp_avg_sq[i].clone().into_vec();
        }
    }

    /// [`Self::step`] on the device: `grads` are the device's gradient sums.
    pub(crate) fn step_on_device(
        &mut self,
        state: &mut DeviceAdamW,
        grads: &[Tensor<2>],
        grad_scale: f32,
        lr: f64,
    ) {
        self.step += 1;
        let bias_correction1 = 1.0 - self.beta1.powi(self.step as i32);
        let bias_correction2 = 1.0 - self.beta2.powi(self.step as i32);
        // Each scalar rounded to f32 once, from the f32 hyperparameters.
        let (beta1, beta2) = (f64::from(self.beta1 as f32), f64::from(self.beta2 as f32));
        let decays = AdamWStep {
            grad_scale,
            decay: (1.0 - lr * self.weight_decay) as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps: self.epsilon as f32,
            step_size: (lr / bias_correction1) as f32,
        };
        let keeps = AdamWStep {
            decay: 1.0,
            ..decays
        };
        // One launch updates a group of parameters with the same scalars
        // (those that decay, then those that do not). A group at a time,
        // each old state dropped as its group is done: all of a class at
        // once held every parameter's old and new values and moments on
        // the device together (12 bytes a weight more at the peak).
        for decaying in [true, false] {
            let indices: Vec<usize> = (0..grads.len())
                .filter(|&i| self.groups[i].decays == decaying)
                .collect();
            let step = if decaying { &decays } else { &keeps };
            for group in indices.chunks(ADAMW_GROUP) {
                let states: Vec<AdamWState> = group
                    .iter()
                    .map(|&i| {
                        [
                            state.values[i].clone(),
                            state.exp_avg[i].clone(),
                            state.exp_avg_sq[i].clone(),
                        ]
                    })
                    .collect();
                let group_grads: Vec<Tensor<2>> = group.iter().map(|&i| grads[i].clone()).collect();
                let updated = adamw_update_all(states, &group_grads, step);
                for (&i, [values, exp_avg, exp_avg_sq]) in group.iter().zip(updated) {
                    state.values[i] = values;
                    state.exp_avg[i] = exp_avg;
                    state.exp_avg_sq[i] = exp_avg_sq;
                }
            }
        }
    }
}

/// The order [`AdamW::step_writing_bf16`] updates the parameters in:
/// those without a bf16 copy to write first, then by the copy's length,
/// the longest last (ties in parameter order). A new copy is made while
/// its parameter's gradient is still alive, and each gradient is freed
/// once its parameter is done, so the first copy made adds to every
/// gradient at once: in parameter order that was the tied embedding's
/// (SmolLM2-135M: 54 MiB, which put the update's buffers 46 MiB over the
/// backward pass's most, in short steps the step's peak). Made last, it
/// finds most gradients' room free. Each value's update reads only its
/// own state, so the order changes no bit.
fn copy_order(copies: &[Option<CopyToWrite<'_>>], parameters: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..parameters).collect();
    order.sort_by_key(|&i| {
        copies
            .get(i)
            .and_then(Option::as_ref)
            .map_or(0, CopyToWrite::len)
    });
    order
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// The update compiled for this CPU's best instruction set gives the
    /// baseline build's bits (checkpoints and resumes do not depend on the
    /// CPU), over values, moments and gradients of many magnitudes, with
    /// and without decay, clipping and a remainder past the vector width.
    #[test]
    fn the_dispatched_update_is_the_baseline_update_bit_for_bit() {
        let len: usize = 1000 + 7;
        let wave = |seed: f32| -> Vec<f32> {
            (0..len)
                .map(|i| (i as f32 * 0.37 + seed).sin() * 10f32.powi(i as i32 % 9 - 4))
                .collect()
        };
        let (values, exp_avg, grad) = (wave(0.1), wave(0.7), wave(1.3));
        let exp_avg_sq: Vec<f32> = wave(2.9).iter().map(|x| x * x).collect();
        for (grad_scale, decay) in [(1.0, 0.999_95), (0.25, 1.0)] {
            let update = Update {
                grad_scale,
                decay,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                step_size: 3e-4,
                bias_correction2_sqrt: 0.0447,
            };
            let run = |dispatched: bool| {
                let (mut v, mut m, mut s) = (values.clone(), exp_avg.clone(), exp_avg_sq.clone());
                if dispatched {
                    simd_dispatch(
                        #[inline(always)]
                        || update.apply(&mut v, &mut m, &mut s, &grad),
                    );
                } else {
                    update.apply(&mut v, &mut m, &mut s, &grad);
                }
                [v, m, s].map(|x| x.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
            };
            assert_eq!(run(true), run(false), "scale {grad_scale}, decay {decay}");
        }
    }

    /// PyTorch's AdamW written out in f64 for one scalar, as the oracle.
    fn torch_adamw(p0: f64, grads: &[f64], lr: f64, b1: f64, b2: f64, eps: f64, wd: f64) -> f64 {
        let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
        for (t, g) in grads.iter().enumerate() {
            let t = (t + 1) as i32;
            p *= 1.0 - lr * wd;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let m_hat = m / (1.0 - b1.powi(t));
            let denom = v.sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
            p -= lr * m_hat / denom;
        }
        p
    }

    #[test]
    fn matches_torch_adamw_formula() {
        let grads = [0.3, -1.2, 0.05, 2.0, -0.7];
        let (lr, b1, b2, eps, wd) = (1e-2, 0.9, 0.999, 1e-8, 0.1);
        let mut adam = AdamW::new(
            vec![
                ("w".into(), vec![0.5]),
                ("model.norm.weight".into(), vec![0.5]),
            ],
            b1,
            b2,
            eps,
            wd,
        );
        for g in grads {
            adam.step(&[vec![g as f32], vec![g as f32]], 1.0, lr);
        }
        let expected = torch_adamw(0.5, &grads, lr, b1, b2, eps, wd);
        assert!(
            (f64::from(adam.values(0)[0]) - expected).abs() < 1e-6,
            "{} vs {expected}",
            adam.values(0)[0]
        );
        // Norm weights take no weight decay.
        let expected_no_decay = torch_adamw(0.5, &grads, lr, b1, b2, eps, 0.0);
        assert!((f64::from(adam.values(1)[0]) - expected_no_decay).abs() < 1e-6);
        assert!(
            (expected - expected_no_decay).abs() > 1e-4,
            "the test must tell decay from no decay"
        );
    }

    /// Three shards updated apart and put together are the unsharded
    /// update, bit for bit; the moments held add up to the unsharded ones.
    #[test]
    fn sharded_updates_put_together_are_the_unsharded_update() {
        let params = || -> Vec<(String, Vec<f32>)> {
            [
                ("a.weight", 7usize),
                ("model.norm.weight", 2),
                ("b.weight", 9),
            ]
            .iter()
            .enumerate()
            .map(|(k, &(name, n))| {
                let values = (0..n).map(|i| (i as f32 - 3.0) * 0.1 + k as f32).collect();
                (name.to_owned(), values)
            })
            .collect()
        };
        let grads: Vec<Vec<f32>> = params()
            .iter()
            .map(|(_, v)| v.iter().map(|x| x.sin()).collect())
            .collect();
        let mut whole = AdamW::new(params(), 0.9, 0.999, 1e-8, 0.1);
        for _ in 0..3 {
            whole.step(&grads, 0.7, 1e-2);
        }
        let mut bytes = 0;
        let mut combined: Vec<Vec<f32>> = params().into_iter().map(|(_, v)| v).collect();
        for rank in 0..3 {
            let mut part = AdamW::new(params(), 0.9, 0.999, 1e-8, 0.1);
            part.shard(3, rank);
            assert!(part.is_sharded());
            for _ in 0..3 {
                part.step(&grads, 0.7, 1e-2);
            }
            bytes += part.moment_bytes();
            for (index, group) in part.groups.iter().enumerate() {
                let shard = group.shard.clone();
                combined[index][shard.clone()].copy_from_slice(&part.values(index)[shard]);
            }
        }
        assert_eq!(bytes, whole.moment_bytes());
        for (index, values) in combined.iter().enumerate() {
            assert_eq!(values, whole.values(index), "parameter {index}");
        }
    }

    /// The parameters without a new copy first, then the copies by
    /// length, the longest last, ties and the parameters past `copies` in
    /// parameter order.
    #[test]
    fn the_longest_copies_are_made_last() {
        let mut slots: Vec<Option<Arc<[bf16]>>> = vec![None; 4];
        let mut it = slots.iter_mut();
        let mut slot = || it.next().expect("a slot");
        let copies = [
            Some(CopyToWrite::new(slot(), 500)),
            None,
            Some(CopyToWrite::new(slot(), 20)),
            Some(CopyToWrite::new(slot(), 500)),
            Some(CopyToWrite::new(slot(), 0)),
        ];
        assert_eq!(copy_order(&copies, 7), [1, 4, 5, 6, 2, 0, 3]);
        assert_eq!(copy_order(&[], 3), [0, 1, 2]);
    }

    #[test]
    fn bf16_copies_written_in_the_update_are_the_updated_values_rounded() {
        // Two parameters, the first longer than a rayon task (its copy is
        // written chunk by chunk); the second has no copy.
        let long = 2 * ELEMENTS_PER_TASK + 3;
        let wave = |len: usize, seed: f32| -> Vec<f32> {
            (0..len)
                .map(|i| (i as f32 * 0.37 + seed).sin() * 10f32.powi(i as i32 % 7 - 3))
                .collect()
        };
        let params = vec![
            ("model.layers.0.mlp.up_proj.weight".into(), wave(long, 0.1)),
            ("model.norm.weight".into(), wave(9, 0.5)),
        ];
        let grads = vec![wave(long, 1.3), wave(9, 2.1)];
        let mut plain = AdamW::new(params, 0.9, 0.999, 1e-8, 0.01);
        let mut writing = plain.clone();
        let mut slot: Option<Arc<[bf16]>> = None;
        for step in 0..4 {
            plain.step(&grads, 0.5, 1e-3);
            // Even steps make a new copy (none yet, or let go of: the
            // backward pass freed it); odd steps write last step's in
            // place, made stale first: every value must be written.
            let in_place = match &mut slot {
                Some(copy) if step % 2 == 1 => {
                    Arc::get_mut(copy)
                        .expect("nothing else holds it")
                        .fill(bf16::from_f32(f32::NAN));
                    Some(Arc::as_ptr(copy))
                }
                _ => {
                    slot = None;
                    None
                }
            };
            writing.step_writing_bf16(
                grads.clone(),
                0.5,
                1e-3,
                &mut [Some(CopyToWrite::new(&mut slot, long)), None],
            );
            assert_eq!(
                writing, plain,
                "step {step}: values and moments as a plain update"
            );
            let copy = slot.as_ref().expect("the update made the copy");
            if let Some(before) = in_place {
                assert_eq!(Arc::as_ptr(copy), before, "step {step}: written in place");
            }
            let rounded: Vec<u16> = plain
                .values(0)
                .iter()
                .map(|&v| bf16::from_f32(v).to_bits())
                .collect();
            let written: Vec<u16> = copy.iter().map(|c| c.to_bits()).collect();
            assert!(
                written == rounded,
                "step {step}: the copy is not the new values rounded"
            );
        }
    }

    #[test]
    #[should_panic(expected = "a bf16 copy of 3 values")]
    fn a_bf16_copy_of_another_length_is_refused() {
        let mut adamw = AdamW::new(vec![("w".into(), vec![1.0; 4])], 0.9, 0.999, 1e-8, 0.0);
        let mut copy: Option<Arc<[bf16]>> = Some(vec![bf16::ZERO; 3].into());
        adamw.step_writing_bf16(
            vec![vec![1.0; 4]],
            1.0,
            0.1,
            &mut [Some(CopyToWrite::new(&mut copy, 3))],
        );
    }

    #[test]
    fn grad_scale_scales_the_gradient_not_the_step() {
        // Adam is invariant to a constant gradient scale, up to epsilon.
        let mut a = AdamW::new(vec![("w".into(), vec![1.0])], 0.9, 0.999, 1e-8, 0.0);
        let mut b = a.clone();
        a.step(&[vec![4.0]], 0.5, 0.1);
        b.step(&[vec![2.0]], 1.0, 0.1);
        assert_eq!(a.values(0), b.values(0));
        assert!(decays("model.layers.0.mlp.up_proj.weight"));
        assert!(!decays("model.layers.0.input_layernorm.weight"));
    }
}

//! One optimizer step: every micro-batch of this rank's share forward and
//! backward, the exchange between ranks, clipping and the AdamW update.
//! The only part of the trainer that knows about gradient accumulation,
//! ranks, the overlapped exchange, ZeRO-1 shards and the GPU optimizer.

use std::borrow::Cow;
use std::path::Path;
use std::time::Instant;

use padfree_model::tensor::{
    Gradients, IntoHostVec, Tensor, backward, float_tensor, take_grad, trainable,
};
use padfree_model::{DropoutDraw, LlamaModel};
use padfree_pack::{Example, ExampleSet, PackError};

use super::identity::Fnv1a;
use super::memory_trace::mark;
use crate::AttentionMode;
use crate::collate::Collated;
use crate::comm::Communicator;
use crate::config::{Batching, TrainConfig};
use crate::error::TrainError;
use crate::grads::GradSums;
use crate::metrics::StepMetrics;
use crate::optim::{AdamW, DeviceAdamW};
use crate::overlap::{Overlapped, all_reduce_by_bucket, forward_backward_overlapped};
use crate::plan::PlannedStep;
use crate::workers::on_workers;

/// The model and what updates it: AdamW's master values and moments on
/// the host, and on a GPU their live copies there.
#[derive(Debug)]
pub(super) struct Engine {
    pub(super) model: LlamaModel,
    /// The master values and moments; on a GPU, as of the last checkpoint
    /// (the live ones are `device_optimizer`'s).
    pub(super) optimizer: AdamW,
    /// On a GPU: the values and moments the steps update there, made from
    /// `optimizer` at the first step (after a resume has filled it).
    device_optimizer: Option<DeviceAdamW>,
    /// Per-layer recomputation in the backward pass (`--gradient-checkpointing`).
    /// Not a setting of the run: it changes memory, not the result (beyond
    /// the order of a few f32 sums), so a resume may turn it on or off.
    pub(super) gradient_checkpointing: bool,
}

/// What one step is handed by the trainer.
pub(super) struct StepJob<'a> {
    /// The step's micro-batches on every rank.
    pub(super) planned: &'a PlannedStep,
    pub(super) examples: &'a ExampleSet,
    pub(super) config: &'a TrainConfig,
    pub(super) comm: &'a dyn Communicator,
    /// Steps taken before this one.
    pub(super) steps_taken: usize,
    pub(super) learning_rate: f64,
    /// Named when the loss or gradient is not finite.
    pub(super) last_checkpoint: Option<&'a Path>,
}

impl Engine {
    /// The optimizer over `model`'s trained values (sharded for ZeRO-1),
    /// and the model with its bf16 copies when `config` asks for bf16.
    pub(super) fn new(
        mut model: LlamaModel,
        config: &TrainConfig,
        comm: &dyn Communicator,
    ) -> Result<Self, TrainError> {
        let on_cpu = model.on_cpu();
        let device = model.device().clone();
        let (mut params, mut shapes) = (Vec::new(), Vec::new());
        for param in model.trainable_mut() {
            let name = param.name().to_owned();
            shapes.push(param.value.dims());
            // On the CPU the optimizer's master values are the model's
            // weights, lent back and forth without a copy; a copy made here
            // and kept by the model until the first update held every
            // trained weight twice through step 1, whose peak was the run's
            // (SmolLM2-135M: 513 MiB more than every later step). On a GPU
            // the host values are a copy of the device's by design.
            let values = if on_cpu {
                let placeholder = float_tensor(Vec::new(), [0, 0], &device);
                std::mem::replace(&mut param.value, placeholder).into_vec()
            } else {
                param.value.clone().into_vec()
            };
            params.push((name, values));
        }
        let mut optimizer = AdamW::new(
            params,
            config.adam_beta1,
            config.adam_beta2,
            config.adam_epsilon,
            config.weight_decay,
        );
        if on_cpu {
            for (index, param) in model.trainable_mut().into_iter().enumerate() {
                let values = optimizer.lend_values(index);
                param.value = trainable(float_tensor(values, shapes[index], &device));
            }
        }
        // bf16 copies of the weights from here on, remade after every update.
        let model = model.with_precision(config.precision)?;
        if config.zero_stage == 1 && comm.world_size() > 1 {
            if !model.on_cpu() {
                return Err(TrainError::Config {
                    flag: "zero-stage",
                    message: "the sharded optimizer runs on the CPU only".into(),
                    hint: "use --zero-stage 0 on a GPU",
                });
            }
            optimizer.shard(comm.world_size(), comm.rank());
        }
        Ok(Self {
            model,
            optimizer,
            device_optimizer: None,
            gradient_checkpointing: false,
        })
    }

    /// The optimizer as a checkpoint saves it: the live values and moments
    /// copied back from the GPU, sharded ones gathered whole (every rank
    /// takes part), so any world size can resume it. `None`: `optimizer`
    /// itself is whole.
    pub(super) fn optimizer_to_save(
        &mut self,
        comm: &dyn Communicator,
    ) -> Result<Option<AdamW>, TrainError> {
        if let Some(device) = &self.device_optimizer {
            self.optimizer.copy_from_device(device);
        }
        if self.optimizer.is_sharded() {
            return Ok(Some(self.optimizer.gathered(comm)?));
        }
        Ok(None)
    }

    /// One optimizer step: every micro-batch of the window forward and
    /// backward, the loss normalised by the window's label tokens, clipping,
    /// AdamW. Nothing is applied if the loss or gradient is not finite.
    pub(super) fn step(&mut self, job: StepJob<'_>) -> Result<StepMetrics, TrainError> {
        let StepJob {
            planned,
            examples: all_examples,
            config,
            comm,
            steps_taken,
            learning_rate,
            last_checkpoint,
        } = job;
        let started = Instant::now();
        // What every rank trains on in this step: the global figures come
        // from the shared plan and the set's lengths and loss-token counts,
        // so they need no communication and no other rank's tokens (a set
        // read from a cache entry reads only this rank's micro-batches).
        let indices = planned.examples();
        let label_tokens: usize = indices
            .iter()
            .map(|&i| all_examples.loss_tokens_of(i))
            .sum::<Result<usize, PackError>>()?;
        let sum_squared_lengths: u64 = indices
            .iter()
            .map(|&i| (all_examples.example_len(i) as u64).pow(2))
            .sum();
        let real_tokens: usize = indices.iter().map(|&i| all_examples.example_len(i)).sum();
        let examples = indices.len();
        let rank_real_tokens: Vec<usize> = planned
            .ranks
            .iter()
            .map(|batches| {
                batches
                    .iter()
                    .flatten()
                    .map(|&i| all_examples.example_len(i))
                    .sum()
            })
            .collect();
        let bin_capacity_tokens = match config.batching {
            Batching::Multipack(multipack) => {
                Some(planned.all_batches().count() * multipack.capacity)
            }
            _ => None,
        };
        let on_device = !self.model.on_cpu();
        let overlap = self.overlaps_exchange(config, comm)?;
        let mut grads = GradSums::new(on_device, self.model.trainable().len());
        let (mut loss_sum, mut fed_tokens) = (0.0, 0);
        let batches = planned.rank_batches(comm.rank());
        let mut overlapped: Option<Overlapped> = None;
        for (at, indices) in batches.iter().enumerate() {
            let batch: Vec<Example> = indices
                .iter()
                .map(|&i| all_examples.get(i).map(Cow::into_owned))
                .collect::<Result<_, PackError>>()?;
            self.model.set_lora_dropout(Some(DropoutDraw {
                seed: dropout_seed(config.seed, steps_taken),
                examples: indices.iter().map(|&i| i as u64).collect(),
            }));
            let last = at + 1 == batches.len();
            let (model, attention, checkpointed) = (
                &mut self.model,
                config.attention,
                self.gradient_checkpointing,
            );
            let pass = match &mut grads {
                // The window's last micro-batch completes the sums bucket by
                // bucket, so the exchange can start.
                GradSums::Host(sums) if overlap && last => {
                    let done = forward_backward_overlapped(
                        model,
                        attention,
                        &batch,
                        label_tokens.max(1),
                        sums,
                        comm,
                    )?;
                    let pass = Pass {
                        loss_sum: done.loss_sum,
                        fed_tokens: done.fed_tokens,
                    };
                    overlapped = Some(done);
                    pass
                }
                grads => on_workers(on_device, || {
                    forward_backward(
                        model,
                        PassSettings {
                            attention,
                            gradient_checkpointing: checkpointed,
                            releases_copies: last,
                        },
                        &batch,
                        label_tokens.max(1),
                        grads,
                    )
                })?,
            };
            loss_sum += pass.loss_sum;
            fed_tokens += pass.fed_tokens;
            mark("gradients taken");
        }
        self.model.set_lora_dropout(None);
        let device = self.model.device().clone().inner();
        grads.zero_where_missing(&self.model.trainable(), &device);
        let sharded = self.optimizer.is_sharded();
        let exchange_started = Instant::now();
        let mut norm_of_shards = None;
        if let (true, None, GradSums::Host(sums)) = (overlap, &overlapped, &mut grads) {
            // No micro-batch on this rank in this step: its (zero) sums
            // still join every bucket's all-reduce, in the same order.
            all_reduce_by_bucket(comm, &self.model.gradient_buckets(), sums)?;
        }
        if comm.world_size() > 1 {
            if sharded {
                let shard = self.shard(comm);
                norm_of_shards = Some(grads.reduce_scatter(comm, shard)?);
            } else if !overlap {
                grads.all_reduce(comm, &device, config.ddp_exchange)?;
            }
            let mut scalars = [loss_sum, fed_tokens as f64];
            comm.all_reduce_sum_f64(&mut scalars)?;
            (loss_sum, fed_tokens) = (scalars[0], scalars[1] as usize);
        }
        let mut exchange_seconds = exchange_started.elapsed().as_secs_f64();
        if let Some(timing) = overlapped {
            exchange_seconds += timing.exposed_seconds;
        }
        let step = steps_taken + 1;
        let loss = loss_sum / label_tokens.max(1) as f64;
        let grad_norm = match norm_of_shards {
            Some(norm) => norm,
            None => on_workers(on_device, || grads.global_norm()),
        };
        for (what, value) in [("loss", loss), ("gradient norm", grad_norm)] {
            if !value.is_finite() {
                return Err(TrainError::NonFinite {
                    step,
                    what,
                    value,
                    last_checkpoint: match last_checkpoint {
                        Some(dir) => format!("the last good checkpoint is {}", dir.display()),
                        None => "no checkpoint was written in this run".to_owned(),
                    },
                });
            }
        }
        let clip = if config.max_grad_norm > 0.0 {
            (config.max_grad_norm / (grad_norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        match grads {
            GradSums::Host(grads) => {
                let shapes = self.reclaim_optimizer_values();
                let optimizer = &mut self.optimizer;
                // --bf16 on the CPU: the update writes the weights' copies
                // as it goes; a rank that updates only its shard gets the
                // rest with the all-gather and refreshes after it.
                let mut copies = if sharded {
                    None
                } else {
                    self.model.bf16_copies_to_write()
                };
                let copies_written = copies.is_some();
                on_workers(on_device, || {
                    optimizer.step_writing_bf16(
                        grads,
                        clip as f32,
                        learning_rate,
                        copies.as_deref_mut().unwrap_or_default(),
                    );
                });
                mark("update");
                drop(copies);
                if sharded {
                    // Each rank updated its shard; every rank needs all of them.
                    let gathering = Instant::now();
                    comm.all_gather_f32(&mut self.optimizer.values_mut())?;
                    exchange_seconds += gathering.elapsed().as_secs_f64();
                }
                self.load_optimizer_values(&shapes);
                mark("values back");
                if !copies_written {
                    self.model.refresh_bf16_weights();
                }
            }
            GradSums::Device(grads) => {
                let grads: Vec<_> = grads.into_iter().flatten().collect();
                let shapes: Vec<[usize; 2]> = self
                    .model
                    .trainable()
                    .iter()
                    .map(|p| p.value.dims())
                    .collect();
                let state = self
                    .device_optimizer
                    .get_or_insert_with(|| self.optimizer.to_device(&shapes, &device));
                self.optimizer
                    .step_on_device(state, &grads, clip as f32, learning_rate);
                let strategy = self.model.device().gradient_checkpointing_strategy();
                for (index, param) in self.model.trainable_mut().into_iter().enumerate() {
                    let mut value = Tensor::from_inner(state.values(index).clone());
                    if let Some(strategy) = strategy {
                        value = value.with_gradient_checkpointing_strategy(strategy);
                    }
                    param.value = trainable(value);
                }
                self.model.refresh_bf16_weights();
            }
        }
        Ok(StepMetrics {
            step,
            epoch: planned.epoch_progress(),
            loss,
            grad_norm,
            learning_rate,
            examples,
            real_tokens,
            fed_tokens,
            label_tokens,
            sum_squared_lengths,
            rank_real_tokens,
            bin_capacity_tokens,
            exchange_seconds,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Whether this step's exchange runs bucket by bucket under the
    /// backward pass (`ddp_overlap`, several ranks); refuses the overlap
    /// where the backward pass does not hand its gradients over in parts.
    fn overlaps_exchange(
        &self,
        config: &TrainConfig,
        comm: &dyn Communicator,
    ) -> Result<bool, TrainError> {
        if !config.ddp_overlap || comm.world_size() == 1 {
            return Ok(false);
        }
        if !self.gradient_checkpointing {
            return Err(TrainError::Config {
                flag: "ddp-overlap",
                message: "the backward pass hands gradients over layer by layer only when it recomputes the layers".into(),
                hint: "add --gradient-checkpointing, or drop --ddp-overlap",
            });
        }
        if !self.model.on_cpu() {
            return Err(TrainError::Config {
                flag: "ddp-overlap",
                message: "the overlapped exchange runs on the CPU only".into(),
                hint: "drop --ddp-overlap on a GPU",
            });
        }
        Ok(true)
    }

    /// This rank's shard of the trained parameters laid end to end (ZeRO
    /// stage 1).
    fn shard(&self, comm: &dyn Communicator) -> std::ops::Range<usize> {
        let total: usize = self.model.trainable().iter().map(|p| p.numel()).sum();
        crate::comm::shard_range(total, comm.world_size(), comm.rank())
    }

    /// Puts the optimizer's master values into the model as fresh leaves,
    /// lent rather than copied: the model's tensors are the master values
    /// until [`Self::reclaim_optimizer_values`] takes them back.
    /// `shapes`: every trained parameter's, in order.
    fn load_optimizer_values(&mut self, shapes: &[[usize; 2]]) {
        let device = self.model.device().clone();
        for (index, param) in self.model.trainable_mut().into_iter().enumerate() {
            let values = self.optimizer.lend_values(index);
            param.value = trainable(float_tensor(values, shapes[index], &device));
        }
    }

    /// Takes the lent master values back from the model before an update
    /// (nothing to take before the first one). The step's graph is gone by
    /// then, so each weight's buffer has one owner and comes back without
    /// a copy; the model holds an empty placeholder until the update puts
    /// the new values in. Gives every trained parameter's shape.
    fn reclaim_optimizer_values(&mut self) -> Vec<[usize; 2]> {
        let device = self.model.device().clone();
        let mut shapes = Vec::new();
        for (index, param) in self.model.trainable_mut().into_iter().enumerate() {
            shapes.push(param.value.dims());
            if self.optimizer.is_lent(index) {
                let placeholder = float_tensor(Vec::new(), [0, 0], &device);
                let values = std::mem::replace(&mut param.value, placeholder).into_vec();
                self.optimizer.return_values(index, values);
            }
        }
        shapes
    }
}

/// The seed of the LoRA dropout of the step after `steps_taken`: a
/// function of the run's seed and the step alone. The masks key each token
/// by its example and its position there (`DropoutDraw`), so a resumed
/// run, padded and padding-free batches, and any micro-batch split over
/// any number of ranks draw the same mask for the same token.
fn dropout_seed(seed: u64, steps_taken: usize) -> u64 {
    let mut hash = Fnv1a::new();
    hash.eat(seed);
    hash.eat(steps_taken as u64);
    hash.finish()
}

/// How one micro-batch's passes run.
#[derive(Clone, Copy)]
struct PassSettings {
    attention: AttentionMode,
    /// Per-layer recomputation in the backward pass.
    gradient_checkpointing: bool,
    /// The window's last micro-batch: under `--bf16` the model lets go of
    /// its weights' bf16 copies between the forward and the backward pass
    /// (`LlamaModel::release_bf16_copies`), so that each is freed as the
    /// backward pass leaves its layer and the update makes them again in
    /// the gradients' room. Not with recomputation, whose backward pass
    /// runs the layers' forward passes again and reads the copies.
    releases_copies: bool,
}

/// Forward and backward of one micro-batch; its gradients, already divided
/// by the window's label-token count, are added to `grads`.
fn forward_backward(
    model: &mut LlamaModel,
    settings: PassSettings,
    batch: &[Example],
    window_label_tokens: usize,
    grads: &mut GradSums,
) -> Result<Pass, TrainError> {
    let PassSettings {
        attention,
        gradient_checkpointing,
        releases_copies,
    } = settings;
    let collated = Collated::new(batch, attention)?;
    mark("collated");
    let input = collated.input();
    let fed_tokens = input.input_ids().len();
    let divisor = window_label_tokens as f64;
    let loss_sum = if gradient_checkpointing {
        let trainable = model.trainable();
        // Every trained tensor's part of the gradient, taken out of the
        // segment's container (its buffer's only owner, as on the plain
        // path) and added to its sum.
        let take = |gradients: &mut Gradients, _complete: usize| {
            let parts = trainable.iter().enumerate();
            grads.add_all(
                parts
                    .filter_map(|(index, param)| Some((index, take_grad(&param.value, gradients)?)))
                    .collect(),
            );
        };
        model.loss_backward_checkpointed(&input, divisor, model.head_chunk_rows(), take)?
    } else {
        let loss = model.loss_sum(&input)?;
        let value = loss.value();
        mark("forward");
        if releases_copies {
            model.release_bf16_copies();
        }
        let trainable = model.trainable();
        let mut gradients = backward(&loss.sum.div_scalar(divisor));
        mark("backward");
        // Taken out of the container, each gradient is its buffer's only
        // owner and reaches the sums without a copy.
        let taken = trainable
            .iter()
            .enumerate()
            .filter_map(|(index, param)| Some((index, take_grad(&param.value, &mut gradients)?)));
        grads.add_all(taken.collect());
        value
    };
    Ok(Pass {
        loss_sum: f64::from(loss_sum),
        fed_tokens,
    })
}

struct Pass {
    loss_sum: f64,
    fed_tokens: usize,
}

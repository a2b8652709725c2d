//! The packing check behind `padfree check` and `padfree train
//! --verify-packing`: on the user's own model and batches, padding-free
//! against padded against one example at a time (logits, summed loss, every
//! parameter gradient), and a perturbation of one example that must move no
//! other example's logits.
//!
//! The one-at-a-time pass is the oracle: an example alone in its batch cannot
//! see another. Padded batches are the second reference, since they are what
//! most trainers run. A mismatch is traced to the first depth (embedding,
//! decoder layer, final norm) where the example's hidden states part.
//!
//! # Shapes
//! `T` tokens of the flattened batch, `B` examples, `L` padded length, `V`
//! vocabulary, `C` hidden size.

use std::fmt;

use padfree_pack::{Example, PackError, PackedBatch, flatten, pad};

use crate::error::ModelError;
use crate::input::ModelInput;
use crate::model::LlamaModel;
use crate::tensor::{Gradients, IntoHostVec, backward, grad};

/// How far two f32 computations of the same sums may drift apart.
///
/// Every path runs the same maths over differently shaped batches, so the
/// kernels block and sum in different orders: results differ by rounding
/// only. A real packing fault (an example seeing another, a wrong position)
/// moves logits by O(1) of their scale, orders of magnitude above these.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerances {
    /// Logits of an example: this fraction of its largest logit.
    pub logits_rtol: f32,
    /// The summed loss of a batch, relative.
    pub loss_rtol: f32,
    /// A parameter's gradient: this fraction of its largest element ...
    pub grad_rtol: f32,
    /// ... plus this, for tensors whose gradient is nearly zero.
    pub grad_atol: f32,
}

impl Default for Tolerances {
    /// The bounds of padfree's own equivalence tests, logits relative to
    /// their scale (real models' logits reach tens, not O(1)). Measured on
    /// SmolLM2-135M with the shipped data (2 batches of 8): logits and loss
    /// of padded and padding-free identical, one-at-a-time losses within
    /// 3e-8 relative, gradients within 1.4e-6 of each tensor's largest
    /// (docs/model.md): two orders of magnitude inside these bounds.
    fn default() -> Self {
        Self {
            logits_rtol: 1e-4,
            loss_rtol: 1e-5,
            grad_rtol: 1e-4,
            grad_atol: 1e-7,
        }
    }
}

/// A packing fault to inject into the padding-free path, to show that the
/// check catches it (tests, and users who want to see it fail).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    /// None: the check of the real thing.
    #[default]
    None,
    /// Naive packing: the examples concatenated into one sequence, positions
    /// running on and attention crossing example boundaries.
    NaivePacking,
}

/// One row of the report: the largest difference of a quantity between a
/// path and padding-free, against its bound.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// What was compared.
    pub quantity: String,
    /// Largest absolute difference.
    pub max_abs: f32,
    /// Scale of the reference (largest magnitude), for the relative figure.
    pub scale: f32,
    /// The largest difference allowed where `max_abs` was found, or with
    /// `at_least` the smallest required.
    pub bound: f32,
    /// The difference must exceed `bound` (a change that has to show).
    pub at_least: bool,
    /// Where the worst difference relative to its bound is: an example or
    /// a parameter.
    pub worst: String,
    /// Why the comparison could not be made on this batch (a batch of one
    /// example has no other example to keep apart); it then neither passes
    /// nor fails, and the report says what was not tested.
    pub not_run: Option<&'static str>,
}

impl Comparison {
    /// `max_abs` relative to the reference's scale.
    pub fn max_rel(&self) -> f32 {
        if self.scale > 0.0 {
            self.max_abs / self.scale
        } else {
            self.max_abs
        }
    }

    /// Whether the difference is on the right side of its bound (true for a
    /// comparison that was not run: it found nothing wrong).
    pub fn passed(&self) -> bool {
        if self.not_run.is_some() {
            return true;
        }
        if self.at_least {
            self.max_abs > self.bound
        } else {
            self.max_abs <= self.bound
        }
    }
}

/// Where a mismatch first shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// The quantity that failed.
    pub quantity: String,
    /// The example (its place in the batch) or parameter at fault.
    pub culprit: String,
    /// The example's place in the batch, when an example is at fault.
    pub example: Option<usize>,
    /// The first depth where the example's hidden states part (for logits),
    /// or the parameter's layer (for gradients).
    pub layer: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}, first at {}",
            self.quantity, self.culprit, self.layer
        )
    }
}

/// The check of one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchCheck {
    /// Examples, `B`.
    pub examples: usize,
    /// Real tokens, `T`.
    pub tokens: usize,
    /// Padded tokens of the padded path, `B * L`.
    pub padded_tokens: usize,
    /// Label tokens.
    pub label_tokens: usize,
    /// Every comparison, in the order of the report.
    pub rows: Vec<Comparison>,
    /// The first failing comparison, traced; `None` when all passed.
    pub mismatch: Option<Mismatch>,
}

impl BatchCheck {
    /// Whether the batch tested that examples are kept apart (it holds at
    /// least two).
    pub fn tested_isolation(&self) -> bool {
        self.rows.iter().all(|row| row.not_run.is_none())
    }
}

/// Why the isolation rows do not run on a batch of one example.
pub const ONE_EXAMPLE: &str = "a batch of one example has no other example to keep apart";

/// Checks one batch of `examples` on `model`, which must live on an autodiff
/// device (gradients are compared).
pub fn check_batch(
    model: &LlamaModel,
    examples: &[Example],
    tolerances: &Tolerances,
    fault: Fault,
) -> Result<BatchCheck, ModelError> {
    let pack_error = |what| move |cause| ModelError::Pack { what, cause };
    let flat = flatten_with(examples, fault).map_err(pack_error("the flattened batch"))?;
    let padded = pad(examples, 0, None).map_err(pack_error("the padded batch"))?;
    let vocab = model.config().vocab_size;
    let lengths: Vec<usize> = examples.iter().map(Example::len).collect();
    let starts: Vec<usize> = lengths
        .iter()
        .scan(0, |start, &len| {
            let here = *start;
            *start += len;
            Some(here)
        })
        .collect();
    let seq_len = padded.seq_len();
    // The logits need no backward pass: off the graph, so their forward
    // passes keep no activations.
    let plain = model.without_autodiff();

    // Logits, `[T, V]` and `[B * L, V]`, then each example alone.
    let flat_logits = plain.forward(&ModelInput::Varlen(&flat))?.into_vec();
    let padded_logits = plain.forward(&ModelInput::Padded(&padded))?.into_vec();
    let flat_rows = |logits: &[f32], e: usize| -> Vec<f32> {
        logits[starts[e] * vocab..(starts[e] + lengths[e]) * vocab].to_vec()
    };
    let mut padded_vs_flat = Worst::new("logits: padded vs padding-free");
    let mut single_vs_flat = Worst::new("logits: one-at-a-time vs padding-free");
    for (e, example) in examples.iter().enumerate() {
        let alone = alone(example)?;
        let single = plain.forward(&ModelInput::Varlen(&alone))?.into_vec();
        let ours = flat_rows(&flat_logits, e);
        let theirs = &padded_logits[e * seq_len * vocab..(e * seq_len + lengths[e]) * vocab];
        let scale = max_abs(&single);
        let bound = tolerances.logits_rtol * scale;
        single_vs_flat.add(&ours, &single, scale, bound, || format!("example {e}"));
        padded_vs_flat.add(&ours, theirs, scale, bound, || format!("example {e}"));
    }

    // One example perturbed: the first, which every other follows in the
    // flattened row, so any attention across a boundary would carry it.
    let mut perturbed = examples.to_vec();
    let first = &examples[0];
    let mut ids = first.input_ids().to_vec();
    ids[0] = (ids[0] + 1) % vocab as u32;
    perturbed[0] = Example::new(ids, first.labels().to_vec()).map_err(|source| {
        pack_error("the perturbed example")(PackError::InvalidExample {
            index: 0,
            cause: source,
        })
    })?;
    let moved_flat = flatten_with(&perturbed, fault).map_err(pack_error("the perturbed batch"))?;
    let moved_logits = plain.forward(&ModelInput::Varlen(&moved_flat))?.into_vec();
    let mut others = Worst::new("perturbing example 0: other examples' logits");
    for e in 1..examples.len() {
        let before = flat_rows(&flat_logits, e);
        let scale = max_abs(&before);
        others.add(
            &flat_rows(&moved_logits, e),
            &before,
            scale,
            tolerances.logits_rtol * scale,
            || format!("example {e}"),
        );
    }
    let before = flat_rows(&flat_logits, 0);
    let scale0 = max_abs(&before);
    let moved0 = max_diff(&flat_rows(&moved_logits, 0), &before);
    drop((flat_logits, padded_logits, moved_logits));

    // The summed loss and every gradient, through the training path.
    let (flat_loss, flat_count, flat_grads) =
        loss_and_grads(model, &ModelInput::Varlen(&flat), None)?;
    let (padded_loss, _, padded_grads) = loss_and_grads(model, &ModelInput::Padded(&padded), None)?;
    let mut single_loss = 0.0;
    let mut single_grads: Vec<Vec<f32>> = Vec::new();
    for example in examples {
        let alone = alone(example)?;
        // Each example runs its batch's kernels (the head's choice by the
        // batch's labelled rows): the check compares layouts, not kernels.
        let (loss, _, grads) =
            loss_and_grads(model, &ModelInput::Varlen(&alone), Some(flat_count))?;
        single_loss += loss;
        if single_grads.is_empty() {
            single_grads = grads;
        } else {
            for (acc, g) in single_grads.iter_mut().zip(grads) {
                acc.iter_mut().zip(g).for_each(|(a, b)| *a += b);
            }
        }
    }
    let loss_row = |quantity: &str, theirs: f64| {
        let scale = flat_loss.abs() as f32;
        Comparison {
            quantity: quantity.to_owned(),
            max_abs: (theirs - flat_loss).abs() as f32,
            scale,
            bound: tolerances.loss_rtol * scale,
            at_least: false,
            worst: "the batch".to_owned(),
            not_run: None,
        }
    };
    let names: Vec<String> = model
        .trainable()
        .iter()
        .map(|p| p.name().to_owned())
        .collect();
    let grad_rows = |quantity: &str, theirs: &[Vec<f32>]| {
        let mut worst = Worst::new(quantity);
        for ((name, ours), theirs) in names.iter().zip(&flat_grads).zip(theirs) {
            let scale = max_abs(ours);
            let bound = tolerances.grad_atol + tolerances.grad_rtol * scale;
            worst.add(theirs, ours, scale, bound, || name.clone());
        }
        worst.row
    };

    let isolation = (examples.len() < 2).then_some(ONE_EXAMPLE);
    let rows = vec![
        padded_vs_flat.row,
        single_vs_flat.row,
        Comparison {
            not_run: isolation,
            ..others.row
        },
        Comparison {
            quantity: "perturbing example 0: its own logits move".to_owned(),
            max_abs: moved0,
            scale: scale0,
            // The change must stand above rounding: the perturbation reached
            // the example, so the row before it means something.
            bound: tolerances.logits_rtol * scale0,
            at_least: true,
            worst: "example 0".to_owned(),
            not_run: isolation,
        },
        loss_row("loss (sum): padded vs padding-free", padded_loss),
        loss_row("loss (sum): one-at-a-time vs padding-free", single_loss),
        grad_rows("gradients: padded vs padding-free", &padded_grads),
        grad_rows("gradients: one-at-a-time vs padding-free", &single_grads),
    ];
    let mismatch = match rows.iter().find(|row| !row.passed()) {
        Some(row) if row.at_least => Some(Mismatch {
            quantity: row.quantity.clone(),
            culprit: row.worst.clone(),
            example: Some(0),
            layer: format!(
                "the output: changing its first token moved its own logits by only {moved0:e}, so the perturbation test says nothing"
            ),
        }),
        Some(row) => Some(trace(&plain, examples, &flat, row, tolerances, &starts)?),
        None => None,
    };
    Ok(BatchCheck {
        examples: examples.len(),
        tokens: lengths.iter().sum(),
        padded_tokens: padded.num_fed_tokens(),
        label_tokens: flat_count,
        rows,
        mismatch,
    })
}

/// `example` as a batch of its own: the oracle, which cannot see another.
fn alone(example: &Example) -> Result<PackedBatch, ModelError> {
    flatten(std::slice::from_ref(example)).map_err(|source| ModelError::Pack {
        what: "one example",
        cause: source,
    })
}

/// The padding-free batch, or what `fault` makes of it.
fn flatten_with(examples: &[Example], fault: Fault) -> Result<PackedBatch, PackError> {
    match fault {
        Fault::None => flatten(examples),
        Fault::NaivePacking => {
            let joined = Example::new(
                examples
                    .iter()
                    .flat_map(|e| e.input_ids())
                    .copied()
                    .collect(),
                examples.iter().flat_map(|e| e.labels()).copied().collect(),
            )
            .map_err(|source| PackError::InvalidExample {
                index: 0,
                cause: source,
            })?;
            flatten(&[joined])
        }
    }
}

/// Where a failing row first shows: for logits, the first depth at which the
/// example's hidden states differ from the same example run alone; for
/// gradients, the parameter's layer.
fn trace(
    model: &LlamaModel,
    examples: &[Example],
    flat: &PackedBatch,
    row: &Comparison,
    tolerances: &Tolerances,
    starts: &[usize],
) -> Result<Mismatch, ModelError> {
    let example = row
        .worst
        .strip_prefix("example ")
        .and_then(|e| e.parse::<usize>().ok());
    let layer = match example {
        Some(e) if row.quantity.starts_with("logits") || row.quantity.starts_with("perturbing") => {
            let alone = alone(&examples[e])?;
            let ours = model.layer_states(&ModelInput::Varlen(flat))?;
            let reference = model.layer_states(&ModelInput::Varlen(&alone))?;
            let width = model.config().hidden_size;
            let len = examples[e].len();
            let rows = (starts[e] * width)..((starts[e] + len) * width);
            let mut first = "the LM head".to_owned();
            for (depth, (ours, reference)) in ours.into_iter().zip(reference).enumerate() {
                let ours = ours.into_vec();
                let reference = reference.into_vec();
                let ours = ours.get(rows.clone()).unwrap_or(&[]);
                let scale = max_abs(&reference);
                let diff = if ours.len() == reference.len() {
                    max_diff(ours, &reference)
                } else {
                    f32::INFINITY
                };
                if diff > tolerances.logits_rtol * scale {
                    first = format!(
                        "{} (hidden state differs from the example run alone by {diff:e}, scale {scale:e})",
                        depth_name(depth, model.config().num_hidden_layers)
                    );
                    break;
                }
            }
            first
        }
        _ => layer_of(&row.worst),
    };
    Ok(Mismatch {
        quantity: row.quantity.clone(),
        culprit: row.worst.clone(),
        example,
        layer,
    })
}

/// The name of depth `depth` of [`LlamaModel::layer_states`].
fn depth_name(depth: usize, layers: usize) -> String {
    match depth {
        0 => "the embedding".to_owned(),
        d if d <= layers => format!("decoder layer {}", d - 1),
        _ => "the final norm".to_owned(),
    }
}

/// `model.layers.3.mlp.up_proj.weight` -> `decoder layer 3`.
fn layer_of(param: &str) -> String {
    param
        .strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .map_or_else(
            || param.to_owned(),
            |layer| format!("decoder layer {layer}"),
        )
}

/// The summed loss, its label count and the gradient of everything that
/// trains (every parameter, or the LoRA adapters), in the model's order.
fn loss_and_grads(
    model: &LlamaModel,
    input: &ModelInput<'_>,
    batch_rows: Option<usize>,
) -> Result<(f64, usize, Vec<Vec<f32>>), ModelError> {
    let loss = model.loss_sum_in_batch(input, batch_rows)?;
    let value = f64::from(loss.sum.clone().into_vec()[0]);
    let grads: Gradients = backward(&loss.sum);
    let per_param = model
        .trainable()
        .into_iter()
        .map(|p| {
            grad(&p.value, &grads)
                .map(IntoHostVec::into_vec)
                .unwrap_or_else(|| vec![0.0; p.numel()])
        })
        .collect();
    Ok((value, loss.num_tokens, per_param))
}

/// The worst difference of a family of comparisons, relative to each one's
/// bound.
struct Worst {
    row: Comparison,
    ratio: f32,
}

impl Worst {
    fn new(quantity: &str) -> Self {
        Self {
            row: Comparison {
                quantity: quantity.to_owned(),
                max_abs: 0.0,
                scale: 0.0,
                bound: f32::INFINITY,
                at_least: false,
                worst: "-".to_owned(),
                not_run: None,
            },
            ratio: -1.0,
        }
    }

    fn add(&mut self, a: &[f32], b: &[f32], scale: f32, bound: f32, name: impl FnOnce() -> String) {
        let diff = if a.len() == b.len() {
            max_diff(a, b)
        } else {
            f32::INFINITY
        };
        let ratio = if bound > 0.0 {
            diff / bound
        } else {
            f32::INFINITY
        };
        // NaN compares false: a NaN difference is worst of all.
        if ratio > self.ratio || diff.is_nan() {
            self.ratio = if diff.is_nan() { f32::INFINITY } else { ratio };
            self.row.max_abs = if diff.is_nan() { f32::INFINITY } else { diff };
            self.row.scale = scale;
            self.row.bound = bound;
            self.row.worst = name();
        }
    }
}

fn max_abs(values: &[f32]) -> f32 {
    values.iter().fold(0.0, |m, v| m.max(v.abs()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |m, (x, y)| {
        let d = (x - y).abs();
        if d.is_nan() { f32::INFINITY } else { m.max(d) }
    })
}

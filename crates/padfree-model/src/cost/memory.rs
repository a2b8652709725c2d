//! What a training step holds, estimated before anything is loaded: the
//! weights as held (f32, or GGUF blocks for QLoRA's base), the training
//! state of what trains (the gradient sums and AdamW's two moments: 12
//! bytes a value; on a GPU a host master copy too, 16, the weights being
//! the device's; on the CPU the master copy is the weights), and
//! the activations the autodiff graph keeps for the largest micro-batch.
//!
//! The activations are counted from what padfree's layers keep for their
//! backward passes, per token and decoder layer, in f32: the inputs of both
//! RMSNorms and their outputs, which the projections they feed keep
//! (`4C`); a Qwen3's per-head norms' inputs (`HD + HkvD`; RoPE keeps
//! nothing, its backward pass is a rotation back); the attention kernel's
//! q, k, v and output (`2HD + 2HkvD`, the output also `o_proj`'s input);
//! gate and up (`2I`: SwiGLU runs in one op with `down_proj` and keeps no
//! output, `kernels/swiglu/down.rs`; `3I` where LoRA adapts `down_proj`);
//! and per LoRA adapter its two `r`-wide products. The LM head and its
//! loss are one op (`kernels/cross_entropy/head.rs`) that holds one chunk
//! of logits (`HEAD_CHUNK_BYTES`) while it runs and keeps the gradients it
//! made with them: the hidden state's (`C` per label) and, when the head
//! trains, the head's (`V x C`), never `[K, V]` logits. With per-layer
//! gradient checkpointing (`model/checkpointing.rs`) the step keeps each
//! layer's input (`C` per token and layer, `L + 1` of them), one layer's
//! activations and the upstream gradient at a time, and the head's op on
//! one chunk of labelled rows. Under `--bf16` the MLP's values are bf16
//! and the attention kernel keeps its inputs and output as bf16, so they
//! count half; on the CPU `o_proj` reads the kernel's kept output
//! (`kernels::SharedInput16`) where it has no adapter (an adapted one
//! keeps the output as f32 for its dropout, a GPU's its own 16-bit copy);
//! the weights' bf16 copies are counted with the weights, and where the
//! trainer lets go of them before the backward pass (full fine-tuning on
//! the CPU without recomputation: `LlamaModel::release_bf16_copies`) they
//! are counted once, not beside the gradients made in their room
//! ([`MemoryEstimate::released`]). Figures measured against it
//! are in docs/benchmarks/2026-12-06-memory-phases.md (and, for the
//! count before then, docs/benchmarks/2026-12-01-lora.md).
//!
//! # Shapes
//! `C` hidden size, `H`/`Hkv` query/key-value heads of `D`, `I` MLP width,
//! `V` vocabulary, `r` LoRA rank.

use crate::config::LlamaConfig;
use crate::lora::{LoraConfig, LoraTarget};
use crate::precision::Precision;

/// Bytes a training step needs, by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The model's weights as held.
    pub weights: u64,
    /// Master copy, gradient sums and AdamW moments of what trains.
    pub training_state: u64,
    /// Activations kept for the backward pass of the largest micro-batch.
    pub activations: u64,
    /// The weights' bf16 copies (part of `weights`) that the backward pass
    /// frees before the gradients (part of `training_state`, twice their
    /// size) take their room, and that the update makes again as it frees
    /// the gradients: the two are never all alive together.
    pub released: u64,
}

impl MemoryEstimate {
    /// All of it, the copies let go of counted once.
    pub fn total(&self) -> u64 {
        self.weights + self.training_state + self.activations - self.released
    }
}

/// f32 values (or their bytes' worth) kept per token and decoder layer
/// (see the module docs): both RMSNorms' inputs and outputs (`4C`), a
/// Qwen3's per-head norms' inputs, the attention kernel's q, k, v and
/// output (`o_proj`'s input, the same tensor in f32), and the MLP's gate
/// and up (and SwiGLU's output where LoRA adapts `down_proj`, which then
/// keeps it), plus each adapter's two `r`-wide products. Under `--bf16`
/// the attention kernel keeps q, k, v and its output as bf16, which a
/// CPU's `o_proj` without an adapter reads too (an adapted one keeps the
/// output in f32, a GPU's its own 16-bit copy), and the MLP's values are
/// bf16.
/// Under `--bf16` on the CPU with a packing body (`settings.shares_inputs`)
/// each norm's output is kept once as bf16 by the projections that read it
/// (`kernels::SharedInput16`), where none of them has an adapter and the
/// base is dense. Under LoRA on the CPU a norm's output that only frozen
/// layers read (no adapter in the group) is not kept at all, in either
/// precision.
pub fn activation_floats_per_token_layer(
    config: &LlamaConfig,
    lora: Option<&LoraConfig>,
    settings: StepSettings,
) -> u64 {
    let StepSettings {
        precision,
        on_cpu,
        shares_inputs,
        quantized_base,
        ..
    } = settings;
    let c = config.hidden_size as u64;
    let q = (config.num_attention_heads * config.head_dim) as u64;
    let kv = (config.num_key_value_heads * config.head_dim) as u64;
    let i = config.intermediate_size as u64;
    let adapters = lora.map_or(0, |lora| 2 * lora.r as u64 * lora.targets.len() as u64);
    let qk_norms = if config.qk_norm { q + kv } else { 0 };
    // SwiGLU and a dense `down_proj` are one op on the CPU that keeps gate
    // and up only (`kernels/swiglu/down.rs`), and a GGUF base's frozen
    // `down_proj` keeps no input; an adapted `down_proj` and a GPU's keep
    // SwiGLU's output.
    let adapted_down = lora.is_some_and(|lora| lora.targets.contains(&LoraTarget::DownProj));
    let mlp = if adapted_down || !on_cpu {
        3 * i
    } else {
        2 * i
    };
    let adapted = |targets: &[LoraTarget]| {
        lora.is_some_and(|lora| targets.iter().any(|t| lora.targets.contains(t)))
    };
    // What `o_proj` keeps of the attention's output besides the kernel.
    let o_proj = if adapted(&[LoraTarget::OProj]) {
        2 * q
    } else if on_cpu {
        0
    } else {
        q
    };
    let (mlp, attention) = match precision {
        Precision::F32 => (mlp, (q + 2 * kv) + q),
        Precision::Bf16 => (mlp.div_ceil(2), ((q + 2 * kv) + q + o_proj).div_ceil(2)),
    };
    // Each norm's input (f32) and output (f32, or bf16 kept once).
    let output = |readers: &[LoraTarget]| {
        let shared = on_cpu && shares_inputs && !quantized_base;
        let frozen = lora.is_some() || quantized_base;
        if on_cpu && frozen && !adapted(readers) {
            // Read only by frozen layers (a LoRA base's, dense or GGUF),
            // which make no `dW` and keep nothing for it.
            0
        } else if shared && precision == Precision::Bf16 && !adapted(readers) {
            c.div_ceil(2)
        } else {
            c
        }
    };
    let norms = 2 * c
        + output(&[LoraTarget::QProj, LoraTarget::KProj, LoraTarget::VProj])
        + output(&[LoraTarget::GateProj, LoraTarget::UpProj]);
    norms + qk_norms + attention + mlp + adapters
}

/// How a step runs, as far as what it holds goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSettings {
    /// Per-layer gradient checkpointing.
    pub checkpointing: bool,
    /// What the matmuls compute in (the weights' bf16 copies are part of
    /// the weights' bytes).
    pub precision: Precision,
    /// On the CPU the optimizer's master copy is the model's weights (lent
    /// to it, `padfree-train`'s `Engine`); on a GPU it is a host copy
    /// beside the device's.
    pub on_cpu: bool,
    /// Under `--bf16` on the CPU, whether the products pack their operands
    /// (`kernels::SharedInput16::for_packed_bodies`): the norms' outputs
    /// are then kept as bf16.
    pub shares_inputs: bool,
    /// The frozen base is in GGUF blocks (QLoRA): its layers are read by
    /// their own kernel and keep no input.
    pub quantized_base: bool,
    /// Bytes of the weights' bf16 copies the trainer lets go of before
    /// each backward pass (`LlamaModel::releasable_bf16_bytes`; 0 with
    /// recomputation, which reads them in the backward pass).
    pub released_copies: u64,
}

impl StepSettings {
    /// f32 on the CPU, no checkpointing.
    pub fn cpu(precision: Precision) -> Self {
        Self {
            checkpointing: false,
            precision,
            on_cpu: true,
            shares_inputs: false,
            quantized_base: false,
            released_copies: 0,
        }
    }
}

/// Floats' worth of the packs of the head's `[V, C]` weight (`weight`
/// values) that its op holds for `label_rows` labelled rows in chunks of
/// `chunk` rows (`kernels/cross_entropy/head.rs`). Under `--bf16` on a
/// packing body (`shares_inputs`) the weight is packed as `W^T` for the
/// logits and as `W` for `dx`, 2 bytes a value each: both held while
/// several chunks run, one at a time in a single chunk, none for a few
/// labelled rows (`gemm_bf16::skinny`, whose products make no head-sized
/// pack). The widened body and f32 pack nothing of the head's size; on a
/// GPU both packs are counted, as before there was a CPU body to ask.
fn head_pack_floats(
    precision: Precision,
    settings: StepSettings,
    weight: u64,
    label_rows: usize,
    chunk: u64,
) -> u64 {
    match precision {
        Precision::F32 => 0,
        Precision::Bf16 if !settings.on_cpu => weight,
        Precision::Bf16 if !settings.shares_inputs => 0,
        Precision::Bf16 => {
            let one_chunk = label_rows as u64 <= chunk;
            if one_chunk && label_rows <= crate::kernels::gemm_bf16::skinny::rows_taken() {
                0
            } else if one_chunk {
                weight / 2
            } else {
                weight
            }
        }
    }
}

/// The estimate for training `config` on micro-batches of at most `tokens`
/// tokens (pads included) of which at most `label_tokens` carry a label.
/// `weight_bytes`: the weights as they will be held (4 bytes a value, or
/// the GGUF blocks of a quantized base, and the bf16 copies).
pub fn training_memory(
    config: &LlamaConfig,
    weight_bytes: u64,
    lora: Option<&LoraConfig>,
    tokens: usize,
    label_tokens: usize,
    settings: StepSettings,
) -> MemoryEstimate {
    let StepSettings {
        checkpointing,
        precision,
        on_cpu,
        released_copies,
        ..
    } = settings;
    let trained = match lora {
        Some(lora) => lora.num_parameters(config),
        None => config.num_parameters(),
    } as u64;
    let per_token = activation_floats_per_token_layer(config, lora, settings);
    let layers = config.num_hidden_layers as u64;
    let (vocab, hidden, tokens) = (
        config.vocab_size as u64,
        config.hidden_size as u64,
        tokens as u64,
    );
    let chunk = (crate::loss::HEAD_CHUNK_BYTES as u64 / (4 * vocab.max(1))).max(1);
    // LoRA trains nothing outside the layers: a frozen head makes no `dW`.
    let head_gradient = if lora.is_none() { vocab * hidden } else { 0 };
    let head_packs = head_pack_floats(precision, settings, vocab * hidden, label_tokens, chunk);
    let head = |rows: u64| rows * hidden + chunk.min(rows) * vocab + head_gradient + head_packs;
    let lora_values = if lora.is_some() { 4 * trained } else { 0 };
    let floats = if checkpointing {
        // Inputs of every layer and the final norm, one layer's activations,
        // the upstream gradient, one chunk of the head.
        tokens * (layers + 1) * hidden
            + tokens * per_token
            + tokens * hidden
            + head(chunk.min(label_tokens as u64))
    } else {
        tokens * layers * per_token + head(label_tokens as u64)
    };
    MemoryEstimate {
        weights: weight_bytes + lora_values,
        // Gradient sums and two moments, and on a GPU the host master copy.
        training_state: if on_cpu { 12 } else { 16 } * trained,
        activations: 4 * floats,
        released: if checkpointing {
            0
        } else {
            released_copies.min(weight_bytes)
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::LoraTarget;

    #[test]
    fn lora_keeps_the_activations_and_drops_most_of_the_state() {
        let config = LlamaConfig::medium();
        let full = training_memory(
            &config,
            4 * config.num_parameters() as u64,
            None,
            2048,
            1024,
            StepSettings::cpu(Precision::F32),
        );
        let lora = LoraConfig {
            targets: LoraTarget::ALL.to_vec(),
            ..LoraConfig::trl_defaults()
        };
        let adapted = training_memory(
            &config,
            config.num_parameters() as u64,
            Some(&lora),
            2048,
            1024,
            StepSettings::cpu(Precision::F32),
        );
        assert_eq!(full.training_state, 12 * config.num_parameters() as u64);
        let on_a_gpu = StepSettings {
            on_cpu: false,
            ..StepSettings::cpu(Precision::F32)
        };
        let gpu = training_memory(&config, 0, None, 2048, 1024, on_a_gpu);
        assert_eq!(gpu.training_state, 16 * config.num_parameters() as u64);
        assert!(adapted.training_state * 20 < full.training_state);
        // Each adapter keeps its two `r`-wide products, an adapted
        // `down_proj` SwiGLU's output too; the frozen head makes no `V x C`
        // gradient.
        let head_gradient = 4 * (config.vocab_size * config.hidden_size) as u64;
        let per_token_layer =
            2 * lora.r as u64 * lora.targets.len() as u64 + config.intermediate_size as u64;
        assert_eq!(
            adapted.activations + head_gradient - full.activations,
            4 * 2048 * config.num_hidden_layers as u64 * per_token_layer
        );
        assert!(adapted.activations + head_gradient < full.activations + full.activations / 4);
    }

    /// What a layer keeps per token: norms `4C`, the attention kernel's
    /// q, k, v and output (shared with `o_proj`: the same f32 tensor, or
    /// under bf16 the kernel's bf16 store; an adapted `o_proj` keeps it in
    /// f32 beside the kernel's bf16, a GPU's its own 16-bit copy), gate
    /// and up; a Qwen3's per-head norms their inputs; an adapted
    /// `down_proj` SwiGLU's output too.
    #[test]
    fn a_layer_keeps_norms_attention_and_gate_and_up() {
        let config = LlamaConfig::medium();
        let count = |config: &LlamaConfig, lora: Option<&LoraConfig>, p| {
            activation_floats_per_token_layer(config, lora, StepSettings::cpu(p))
        };
        let c = config.hidden_size as u64;
        let i = config.intermediate_size as u64;
        let q = (config.num_attention_heads * config.head_dim) as u64;
        let kv = (config.num_key_value_heads * config.head_dim) as u64;
        assert_eq!(
            count(&config, None, Precision::F32),
            4 * c + (2 * q + 2 * kv) + 2 * i
        );
        assert_eq!(
            count(&config, None, Precision::Bf16),
            4 * c + (2 * q + 2 * kv) / 2 + i
        );
        let on_o = LoraConfig {
            targets: vec![LoraTarget::OProj],
            ..LoraConfig::trl_defaults()
        };
        // An adapted `o_proj` keeps the attention's output in f32 beside
        // the kernel's bf16; both norms' outputs are read only by frozen
        // layers then.
        assert_eq!(
            count(&config, Some(&on_o), Precision::Bf16) + 2 * c,
            count(&config, None, Precision::Bf16) + q + 2 * on_o.r as u64
        );
        let gpu = |p| {
            let settings = StepSettings {
                on_cpu: false,
                ..StepSettings::cpu(p)
            };
            activation_floats_per_token_layer(&config, None, settings)
        };
        // A GPU's MLP keeps SwiGLU's output too (no one op there).
        assert_eq!(
            gpu(Precision::F32) - count(&config, None, Precision::F32),
            i
        );
        assert_eq!(
            gpu(Precision::Bf16) - count(&config, None, Precision::Bf16),
            q / 2 + i / 2
        );
        // Sharing each norm's output as bf16 (a packing body) keeps half
        // of it, but not for a group of projections with an adapter.
        let sharing = StepSettings {
            shares_inputs: true,
            ..StepSettings::cpu(Precision::Bf16)
        };
        let shared =
            |lora: Option<&LoraConfig>| activation_floats_per_token_layer(&config, lora, sharing);
        assert_eq!(count(&config, None, Precision::Bf16) - shared(None), c);
        let on_q = LoraConfig {
            targets: vec![LoraTarget::QProj],
            ..LoraConfig::trl_defaults()
        };
        assert_eq!(
            count(&config, Some(&on_q), Precision::Bf16),
            shared(Some(&on_q))
        );
        // Under LoRA a group without an adapter is frozen and keeps
        // nothing of its input, f32 or bf16: `gate_proj` and `up_proj`
        // here (the norm's output); q, k and v keep it in f32 for `q_proj`'s
        // adapter.
        let plain = |p| count(&config, None, p);
        assert_eq!(
            plain(Precision::F32) + 2 * on_q.r as u64 - count(&config, Some(&on_q), Precision::F32),
            c
        );
        assert_eq!(
            plain(Precision::Bf16) + 2 * on_q.r as u64
                - count(&config, Some(&on_q), Precision::Bf16),
            c
        );
        // A GGUF base's frozen layers keep no input: a norm's output that
        // only they read is not kept (bf16 or not), one an adapter reads is,
        // as f32.
        let gguf = StepSettings {
            quantized_base: true,
            ..sharing
        };
        assert_eq!(
            shared(None) - activation_floats_per_token_layer(&config, None, gguf),
            2 * c.div_ceil(2)
        );
        assert_eq!(
            activation_floats_per_token_layer(&config, Some(&on_q), gguf)
                - activation_floats_per_token_layer(&config, None, gguf),
            c + 2 * on_q.r as u64
        );
        let qwen3 = LlamaConfig {
            qk_norm: true,
            ..config.clone()
        };
        assert_eq!(
            count(&qwen3, None, Precision::F32) - count(&config, None, Precision::F32),
            q + kv
        );
        let down = |targets: Vec<LoraTarget>| LoraConfig {
            targets,
            ..LoraConfig::trl_defaults()
        };
        let (with, without) = (
            down(vec![LoraTarget::DownProj]),
            down(vec![LoraTarget::UpProj]),
        );
        // An adapted `down_proj` keeps SwiGLU's output; `up_proj`'s
        // adapter keeps the MLP norm's output, which frozen gate and up
        // would not.
        assert_eq!(
            count(&config, Some(&with), Precision::F32) + c,
            count(&config, Some(&without), Precision::F32) + i
        );
    }

    /// The head's op holds one chunk of logits and the gradients it made:
    /// more labelled rows add their `C`-wide gradient, not `V` logits, and
    /// a frozen head (LoRA) makes no `V x C` gradient.
    #[test]
    fn the_head_never_holds_the_logits_of_every_label() {
        let config = LlamaConfig::medium();
        let (c, v) = (config.hidden_size as u64, config.vocab_size as u64);
        let chunk = (crate::loss::HEAD_CHUNK_BYTES as u64 / (4 * v)) as usize;
        let at = |labels: usize| {
            training_memory(
                &config,
                0,
                None,
                4096,
                labels,
                StepSettings::cpu(Precision::F32),
            )
            .activations
        };
        assert_eq!(at(2 * chunk) - at(chunk), 4 * chunk as u64 * c);
        let lora = LoraConfig::trl_defaults();
        let adapted = |labels: usize| {
            training_memory(
                &config,
                0,
                Some(&lora),
                4096,
                labels,
                StepSettings::cpu(Precision::F32),
            )
            .activations
        };
        let lora_activations = 4
            * 4096
            * config.num_hidden_layers as u64
            * 2
            * lora.r as u64
            * lora.targets.len() as u64;
        // The default adapters (q and v) leave `gate_proj` and `up_proj`
        // frozen: the MLP norm's output is not kept.
        let frozen_mlp_input = 4 * 4096 * config.num_hidden_layers as u64 * c;
        assert_eq!(
            at(chunk) - (adapted(chunk) - lora_activations) - frozen_mlp_input,
            4 * v * c
        );
    }

    /// Under `--bf16` on a packing body the head's two packs are counted
    /// only where its op makes them: none for the few labelled rows the
    /// streamed or tiled products take, one at a time in a single chunk,
    /// both over several chunks; none on the widened body or in f32.
    #[test]
    fn the_heads_packs_are_counted_where_they_are_made() {
        let config = LlamaConfig::medium();
        let (c, v) = (config.hidden_size as u64, config.vocab_size as u64);
        let chunk = (crate::loss::HEAD_CHUNK_BYTES as u64 / (4 * v)) as usize;
        let few = crate::kernels::gemm_bf16::skinny::rows_taken();
        assert!(few < chunk, "{few} rows taken, chunks of {chunk}");
        let at = |labels: usize, precision: Precision, shares_inputs: bool| {
            training_memory(
                &config,
                0,
                None,
                4096,
                labels,
                StepSettings {
                    shares_inputs,
                    ..StepSettings::cpu(precision)
                },
            )
            .activations as i128
        };
        // (Signed: bf16's activations are fewer bytes than f32's.)
        // Sharing the norms' outputs also halves what the layers keep, the
        // same for any number of labels: measured from no labelled row.
        let packs = |labels: usize| {
            (at(labels, Precision::Bf16, true) - at(0, Precision::Bf16, true))
                - (at(labels, Precision::Bf16, false) - at(0, Precision::Bf16, false))
        };
        assert_eq!(packs(1), 0);
        assert_eq!(packs(few), 0);
        assert_eq!(packs(few + 1), (4 * v * c / 2) as i128);
        assert_eq!(packs(chunk), (4 * v * c / 2) as i128);
        assert_eq!(packs(chunk + 1), (4 * v * c) as i128);
        // The widened body and f32 hold the same head (no packs either).
        for labels in [few, chunk + 1] {
            assert_eq!(
                at(labels, Precision::Bf16, false) - at(labels, Precision::F32, false),
                at(0, Precision::Bf16, false) - at(0, Precision::F32, false)
            );
        }
    }

    #[test]
    fn checkpointing_keeps_activations_from_growing_with_depth() {
        let config = LlamaConfig::medium();
        let estimate = |layers: usize, checkpointing: bool| {
            let config = LlamaConfig {
                num_hidden_layers: layers,
                ..config.clone()
            };
            training_memory(
                &config,
                0,
                None,
                2048,
                1024,
                StepSettings {
                    checkpointing,
                    ..StepSettings::cpu(Precision::F32)
                },
            )
            .activations
        };
        let (kept, recomputed) = (estimate(24, false), estimate(24, true));
        assert!(recomputed * 4 < kept, "{recomputed} vs {kept}");
        // Deeper: the kept activations grow by a layer's worth per layer,
        // the recomputed ones by one `[T, C]` state.
        let per_layer_kept = estimate(25, false) - kept;
        let per_layer_recomputed = estimate(25, true) - recomputed;
        assert_eq!(per_layer_recomputed, 4 * 2048 * config.hidden_size as u64);
        assert!(per_layer_recomputed * 10 < per_layer_kept);
    }

    /// The bf16 copies the trainer lets go of before the backward pass are
    /// counted once: the total drops by their bytes, the parts stay as
    /// they are; with recomputation nothing is let go of.
    #[test]
    fn copies_let_go_of_are_counted_once() {
        let config = LlamaConfig::medium();
        let params = config.num_parameters() as u64;
        let copies = 2 * params;
        let settings = |released_copies: u64, checkpointing: bool| StepSettings {
            released_copies,
            checkpointing,
            ..StepSettings::cpu(Precision::Bf16)
        };
        let estimate = |released: u64, checkpointing: bool| {
            training_memory(
                &config,
                4 * params + copies,
                None,
                256,
                20,
                settings(released, checkpointing),
            )
        };
        let (held, let_go) = (estimate(0, false), estimate(copies, false));
        assert_eq!(held.total() - let_go.total(), copies);
        assert_eq!(let_go.released, copies);
        assert_eq!(
            (held.weights, held.training_state, held.activations),
            (let_go.weights, let_go.training_state, let_go.activations)
        );
        let recomputed = estimate(copies, true);
        assert_eq!(recomputed.released, 0);
        assert_eq!(recomputed.total(), estimate(0, true).total());
    }
}

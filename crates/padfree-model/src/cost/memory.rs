//! What a training step holds, estimated before anything is loaded: the
//! weights as held (f32, or GGUF blocks for QLoRA's base), the training
//! state of what trains (a host master copy, the gradient sums and AdamW's
//! two moments: 16 bytes a value, plus the value itself on the device), and
//! the activations the autodiff graph keeps for the largest micro-batch.
//!
//! The activations are counted from what padfree's layers keep for their
//! backward passes, per token and decoder layer, in f32: the inputs of both
//! RMSNorms and of the projections they feed (`3C`), queries and keys
//! before and after RoPE and the values (`5HD`-ish: `2(HD + HkvD)` for RoPE
//! plus `HD + 2HkvD` for the attention kernel, and its `HD` output, which is
//! also `o_proj`'s input), gate, up and their product (`3I`), and per LoRA
//! adapter its two `r`-wide products. The LM head and its loss are one op
//! (`kernels/cross_entropy/head.rs`) that holds one chunk of logits
//! (`HEAD_CHUNK_BYTES`) while it runs and keeps the gradients it made with
//! them: the hidden state's (`C` per label) and, when the head trains,
//! the head's (`V x C`), never `[K, V]` logits. With per-layer gradient
//! checkpointing (`model/checkpointing.rs`) the step keeps each layer's
//! input (`C` per token and layer, `L + 1` of them), one layer's
//! activations and the upstream gradient at a time, and the head's op on
//! one chunk of labelled rows. Under `--bf16` SwiGLU keeps gate and up as bf16 and
//! `down_proj` its input, so the MLP's `3I` count as `3I/2`, and the
//! attention kernel its inputs and output (`o_proj` the output), so their
//! `3HD + 2HkvD` count half; the weights' bf16 copies are counted with the
//! weights. Figures measured against it
//! are in docs/benchmarks/2026-12-01-lora.md.
//!
//! # Shapes
//! `C` hidden size, `H`/`Hkv` query/key-value heads of `D`, `I` MLP width,
//! `V` vocabulary, `r` LoRA rank.

use crate::config::LlamaConfig;
use crate::lora::LoraConfig;
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
}

impl MemoryEstimate {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.weights + self.training_state + self.activations
    }
}

/// f32 values (or their bytes' worth) kept per token and decoder layer
/// (see the module docs); under `--bf16` SwiGLU keeps gate and up, and
/// `down_proj` its input, as bf16: `3I/2` instead of `3I`; the attention
/// kernel keeps q, k, v and its output, and `o_proj` that output, as bf16.
pub fn activation_floats_per_token_layer(
    config: &LlamaConfig,
    lora: Option<&LoraConfig>,
    precision: Precision,
) -> u64 {
    let c = config.hidden_size as u64;
    let q = (config.num_attention_heads * config.head_dim) as u64;
    let kv = (config.num_key_value_heads * config.head_dim) as u64;
    let i = config.intermediate_size as u64;
    let adapters = lora.map_or(0, |lora| 2 * lora.r as u64 * lora.targets.len() as u64);
    // The attention kernel's inputs and output, and o_proj's input (the
    // same output): bf16 under `--bf16` (`kernels/attention/bf16.rs`).
    let attention = (q + 2 * kv) + 2 * q;
    let (mlp, attention) = match precision {
        Precision::F32 => (3 * i, attention),
        Precision::Bf16 => ((3 * i).div_ceil(2), attention.div_ceil(2)),
    };
    3 * c + 2 * (q + kv) + attention + mlp + adapters
}

/// The estimate for training `config` on micro-batches of at most `tokens`
/// tokens (pads included) of which at most `label_tokens` carry a label.
/// `weight_bytes`: the weights as they will be held (4 bytes a value, or
/// the GGUF blocks of a quantized base). `checkpointing`: per-layer
/// gradient checkpointing. `precision`: what the matmuls compute in (the
/// weights' bf16 copies are part of `weight_bytes`).
pub fn training_memory(
    config: &LlamaConfig,
    weight_bytes: u64,
    lora: Option<&LoraConfig>,
    tokens: usize,
    label_tokens: usize,
    checkpointing: bool,
    precision: Precision,
) -> MemoryEstimate {
    let trained = match lora {
        Some(lora) => lora.num_parameters(config),
        None => config.num_parameters(),
    } as u64;
    let per_token = activation_floats_per_token_layer(config, lora, precision);
    let layers = config.num_hidden_layers as u64;
    let (vocab, hidden, tokens) = (
        config.vocab_size as u64,
        config.hidden_size as u64,
        tokens as u64,
    );
    let chunk = (crate::loss::HEAD_CHUNK_BYTES as u64 / (4 * vocab.max(1))).max(1);
    // LoRA trains nothing outside the layers: a frozen head makes no `dW`.
    let head_gradient = if lora.is_none() { vocab * hidden } else { 0 };
    let head = |rows: u64| rows * hidden + chunk.min(rows) * vocab + head_gradient;
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
        training_state: 16 * trained,
        activations: 4 * floats,
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
            false,
            Precision::F32,
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
            false,
            Precision::F32,
        );
        assert_eq!(full.training_state, 16 * config.num_parameters() as u64);
        assert!(adapted.training_state * 20 < full.training_state);
        // The adapters' products are a few percent of a layer's activations;
        // the frozen head makes no `V x C` gradient.
        let head_gradient = 4 * (config.vocab_size * config.hidden_size) as u64;
        assert!(adapted.activations + head_gradient > full.activations);
        assert!(adapted.activations + head_gradient < full.activations + full.activations / 10);
    }

    /// bf16 keeps the MLP's three `[T, I]` activations, and the attention
    /// kernel's q, k, v and output (twice: o_proj's input), in half the bytes.
    #[test]
    fn bf16_halves_the_mlp_and_attention_activations() {
        let config = LlamaConfig::medium();
        let count = |p| activation_floats_per_token_layer(&config, None, p);
        let i = config.intermediate_size as u64;
        let q = (config.num_attention_heads * config.head_dim) as u64;
        let kv = (config.num_key_value_heads * config.head_dim) as u64;
        assert_eq!(
            count(Precision::F32) - count(Precision::Bf16),
            3 * i / 2 + (3 * q + 2 * kv) / 2
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
            training_memory(&config, 0, None, 4096, labels, false, Precision::F32).activations
        };
        assert_eq!(at(2 * chunk) - at(chunk), 4 * chunk as u64 * c);
        let lora = LoraConfig::trl_defaults();
        let adapted = |labels: usize| {
            training_memory(&config, 0, Some(&lora), 4096, labels, false, Precision::F32)
                .activations
        };
        let lora_activations = 4
            * 4096
            * config.num_hidden_layers as u64
            * 2
            * lora.r as u64
            * lora.targets.len() as u64;
        assert_eq!(at(chunk) - (adapted(chunk) - lora_activations), 4 * v * c);
    }

    #[test]
    fn checkpointing_keeps_activations_from_growing_with_depth() {
        let config = LlamaConfig::medium();
        let estimate = |layers: usize, checkpointing: bool| {
            let config = LlamaConfig {
                num_hidden_layers: layers,
                ..config.clone()
            };
            training_memory(&config, 0, None, 2048, 1024, checkpointing, Precision::F32).activations
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
}

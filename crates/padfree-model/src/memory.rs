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
//! adapter its two `r`-wide products. The LM head keeps the hidden state and
//! the logits of the labelled rows only (`2 x V` per label, with the
//! softmax's gradient). Figures measured against it are in
//! docs/benchmarks/2026-12-01-lora.md.
//!
//! # Shapes
//! `C` hidden size, `H`/`Hkv` query/key-value heads of `D`, `I` MLP width,
//! `V` vocabulary, `r` LoRA rank.

use crate::config::LlamaConfig;
use crate::lora::LoraConfig;

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

/// f32 values kept per token and decoder layer (see the module docs).
pub fn activation_floats_per_token_layer(config: &LlamaConfig, lora: Option<&LoraConfig>) -> u64 {
    let c = config.hidden_size as u64;
    let q = (config.num_attention_heads * config.head_dim) as u64;
    let kv = (config.num_key_value_heads * config.head_dim) as u64;
    let i = config.intermediate_size as u64;
    let adapters = lora.map_or(0, |lora| 2 * lora.r as u64 * lora.targets.len() as u64);
    3 * c + 2 * (q + kv) + (q + 2 * kv) + 2 * q + 3 * i + adapters
}

/// The estimate for training `config` on micro-batches of at most `tokens`
/// tokens (pads included) of which at most `label_tokens` carry a label.
/// `weight_bytes`: the weights as they will be held (4 bytes a value, or
/// the GGUF blocks of a quantized base).
pub fn training_memory(
    config: &LlamaConfig,
    weight_bytes: u64,
    lora: Option<&LoraConfig>,
    tokens: usize,
    label_tokens: usize,
) -> MemoryEstimate {
    let trained = match lora {
        Some(lora) => lora.num_parameters(config),
        None => config.num_parameters(),
    } as u64;
    let per_token = activation_floats_per_token_layer(config, lora);
    let layers = config.num_hidden_layers as u64;
    let head = label_tokens as u64 * (2 * config.vocab_size as u64 + config.hidden_size as u64);
    let lora_values = if lora.is_some() { 4 * trained } else { 0 };
    MemoryEstimate {
        weights: weight_bytes + lora_values,
        training_state: 16 * trained,
        activations: 4 * (tokens as u64 * layers * per_token + head),
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
        );
        assert_eq!(full.training_state, 16 * config.num_parameters() as u64);
        assert!(adapted.training_state * 20 < full.training_state);
        // The adapters' products are a few percent of a layer's activations.
        assert!(adapted.activations > full.activations);
        assert!(adapted.activations < full.activations + full.activations / 10);
    }
}

//! # padfree-model
//!
//! A Llama-family decoder (Llama, Mistral, SmolLM2, Qwen2, Qwen3) on burn, whose attention
//! keeps every example of a flattened batch to itself.
//!
//! The model takes a batch from `padfree-pack` as a [`ModelInput`]: the
//! variant picks the attention strategy (`varlen` with the collator's
//! [`padfree_pack::BatchMeta`], `varlen-per-layer`, or `padded`), and the
//! metadata is handed to every layer, never recomputed there.
//!
//! # Map
//! - `model.rs`: [`LlamaModel`] (parameters, forward, fused loss, load/save);
//!   `model/checkpointing.rs`: per-layer gradient checkpointing;
//!   `model/adapters.rs`: attaching, saving and merging LoRA adapters;
//!   `model/bf16.rs`: `--bf16` on the model (the weights' bf16 copies);
//!   `input.rs`: [`ModelInput`]; `loss.rs`: [`LossSum`], [`LabelRows`] and the
//!   oracle loss [`causal_lm_loss`]; `config.rs`: [`LlamaConfig`] and presets.
//! - [`layers`]: embedding, decoder layer, attention (strategy dispatch),
//!   RoPE, MLP, RMSNorm; views that borrow the model's parameters.
//! - [`kernels`]: the fused CPU kernels, each with its burn autodiff glue and
//!   its composed oracle in one file; `host_op.rs` is the shared glue.
//! - [`lora`]: LoRA adapters (PEFT's layout, initialisation and files),
//!   their dropout and merging; the model freezes its weights when it
//!   carries them and [`LlamaModel::trainable`] lists them instead.
//! - [`weights`]: the parameter table (HF name, shape, GGUF name), safetensors
//!   in and out, [`gguf`] in (with its tokenizer).
//! - [`tensor`]: the thin wrapper over burn's tensor API.
//! - [`check`]: the packing check of `padfree check` (padding-free vs padded
//!   vs one at a time on real batches, a perturbation, a per-layer trace).
//! - `precision.rs`: [`Precision`] (`--bf16`) and the weights' bf16 copies,
//!   made once per optimizer step.
//! - [`cost`]: what a training step costs: [`memory`] (weights, training
//!   state, activations), estimated before loading, and [`flops`] (model
//!   FLOPs of a step and the machine's peak, for MFU).
//!
//! Modules depend one way: `tensor` <- `kernels` <- `layers` <- `model`;
//! `config` <- `weights` <- `model`; nothing imports `model` back.
//!
//! # Shapes
//! `T` tokens of a flattened batch, `B` examples, `L` padded length, `N` rows
//! the model runs on (`T` or `B * L`), `C` hidden size, `H` query heads, `Hkv`
//! key/value heads, `D` head size, `V` vocabulary, `I` MLP width.

pub mod check;
mod config;
pub mod cost;
pub mod device;
mod error;
mod input;
pub mod kernels;
pub mod layers;
pub mod lora;
mod loss;
mod model;
mod precision;
pub mod tensor;
pub mod weights;

pub use config::LlamaConfig;
pub use cost::{flops, memory};
pub use error::ModelError;
pub use input::ModelInput;
pub use kernels::CausalMasks;
pub use layers::{AttentionKernel, AttentionLayout, PaddedAttention};
pub use lora::peft::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir};
pub use lora::{DropoutDraw, LoraConfig, LoraTarget};
pub use loss::{HEAD_CHUNK_BYTES, LabelRows, LossSum, causal_lm_loss};
pub use model::LlamaModel;
pub use precision::{CopyToWrite, HalfFloat, Precision};
pub use weights::gguf;
pub use weights::gguf::tokenizer_from_gguf;
pub use weights::safetensors::{write_atomically, write_f32_file};
pub use weights::table::Param;

//! What is refused before a run starts: a model or a layout the settings
//! do not describe, a damaged weight, and ranks that were not handed the
//! same data, settings and weights.

use padfree_model::LlamaModel;
use padfree_model::tensor::IntoHostVec;

use super::identity::Fnv1a;
use crate::comm::Communicator;
use crate::config::TrainConfig;
use crate::error::TrainError;

/// Checks `model`, the examples (their fingerprint) and `config` can start a run on `comm`'s
/// ranks (every rank calls it: the cross-rank check is collective).
pub(super) fn check_run(
    comm: &dyn Communicator,
    model: &LlamaModel,
    data_fingerprint: u64,
    config: &TrainConfig,
) -> Result<(), TrainError> {
    if config.world_size != comm.world_size() {
        return Err(TrainError::Config {
            flag: "world-size",
            message: format!(
                "the config says {} ranks, the launcher started {}",
                config.world_size,
                comm.world_size()
            ),
            hint: "set the world size from the communicator (mpirun -np N)",
        });
    }
    if !model.device().is_autodiff() {
        return Err(TrainError::Config {
            flag: "model",
            message: "the model is not on an autodiff device".into(),
            hint: "load it with padfree_model::tensor::cpu_device(true)",
        });
    }
    if model.lora_config() != config.lora.as_ref() {
        let message = match (model.lora_config(), config.lora.as_ref()) {
            (Some(saved), Some(given)) => format!(
                "other LoRA flags than the model's adapters were given: {}",
                saved.differing_flags(given).join(", ")
            ),
            (Some(_), None) => {
                "the model carries LoRA adapters, but --use-peft is not given".to_owned()
            }
            (None, _) => "--use-peft is given, but the model carries no LoRA adapters".to_owned(),
        };
        return Err(TrainError::Config {
            flag: "use-peft",
            message,
            hint: "a LoRA run resumes with its own --use-peft and --lora-* flags, a full fine-tuning run without them",
        });
    }
    if model.is_quantized() && model.lora_config().is_none() {
        return Err(TrainError::Config {
            flag: "use-peft",
            message: "the model's weights are kept in GGUF blocks, which cannot be trained".into(),
            hint: "train LoRA adapters on it (--use-peft), or load the model dequantised for full fine-tuning",
        });
    }
    // One pass over the weights: refuse a non-finite one and, with
    // several ranks, fingerprint them (a rank that read another file,
    // flags or weights would train its share of the plan on something
    // else, silently).
    let adapters = match model.lora_config() {
        Some(_) => model.trainable(),
        None => Vec::new(),
    };
    let mut weights_hash = Fnv1a::new();
    for param in model.params().into_iter().chain(adapters) {
        let values = param.value.clone().into_vec();
        if comm.world_size() > 1 {
            values
                .iter()
                .for_each(|v| weights_hash.eat(u64::from(v.to_bits())));
        }
        if let Some(at) = values.iter().position(|v| !v.is_finite()) {
            return Err(TrainError::Config {
                flag: "model",
                message: format!(
                    "weight `{}` holds {} at element {at}: the model cannot be trained",
                    param.name(),
                    values[at]
                ),
                hint: "the weights are damaged: load an earlier checkpoint or the original model",
            });
        }
    }
    if comm.world_size() > 1 {
        let mut settings = Fnv1a::new();
        serde_json::to_vec(config)
            .unwrap_or_default()
            .into_iter()
            .for_each(|b| settings.eat(u64::from(b)));
        crate::comm::check_same_on_every_rank(
            comm,
            &[
                ("training data", data_fingerprint),
                ("settings", settings.finish()),
                ("initial weights", weights_hash.finish()),
            ],
        )?;
    }
    Ok(())
}

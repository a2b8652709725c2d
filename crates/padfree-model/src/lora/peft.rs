//! PEFT's adapter files: `adapter_model.safetensors` (f32, PEFT's tensor
//! names) and `adapter_config.json` (its `LoraConfig`), which
//! `PeftModel.from_pretrained(base, dir)` loads onto the HF base model.

use std::path::Path;

use serde_json::{Value, json};

use super::{Lora, LoraConfig};
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::tensor::{Device, IntoHostVec};
use crate::weights::safetensors::{WeightFiles, serialize_f32, write_atomically};

/// The adapter weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The adapter settings.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// Writes both files into `dir` (each through a temporary file renamed into
/// place).
pub(crate) fn write(dir: &Path, lora: &Lora) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|err| ModelError::io(dir, err))?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let bytes = serialize_f32(
        &path,
        lora.params
            .iter()
            .map(|p| (p.name(), p.hf_shape(), p.value.clone().into_vec())),
    )?;
    write_atomically(&path, &bytes)?;
    let config = config_json(&lora.config, &lora.base);
    let mut text = serde_json::to_vec_pretty(&config).unwrap_or_default();
    text.push(b'\n');
    write_atomically(&dir.join(ADAPTER_CONFIG), &text)
}

/// PEFT's `LoraConfig` as `save_pretrained` writes it, the fields padfree
/// does not use at their defaults.
fn config_json(lora: &LoraConfig, base: &str) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": lora.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": false,
        "use_dora": false,
        "revision": null
    })
}

/// The settings of `dir/adapter_config.json` and the base model it names,
/// refusing what padfree's adapters cannot be (DoRA, rsLoRA, per-layer
/// ranks, biases, extra trained modules), by field.
pub fn read_config(dir: &Path) -> Result<(LoraConfig, Option<String>), ModelError> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|err| ModelError::io(&path, err))?;
    let value: Value = serde_json::from_str(&text).map_err(|err| ModelError::Format {
        path: path.clone(),
        message: format!("not JSON: {err}"),
        hint: "adapter_config.json must be the file PEFT's save_pretrained writes",
    })?;
    let refuse = |field: &str, message: String| ModelError::Format {
        path: path.clone(),
        message: format!("field `{field}`: {message}"),
        hint: "padfree trains and loads plain LoRA adapters (PEFT's LoraConfig with its defaults for the fields named here)",
    };
    let field = |name: &str| value.get(name).filter(|v| !v.is_null());
    match field("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => return Err(refuse("peft_type", format!("{other:?}, expected \"LORA\""))),
    }
    let r = field("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| refuse("r", "missing or not a positive integer".into()))?
        as usize;
    let alpha = field("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| refuse("lora_alpha", "missing or not a number".into()))?;
    let dropout = field("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let targets = match field("target_modules") {
        Some(Value::String(text)) => LoraConfig::parse_targets(text),
        Some(Value::Array(names)) => {
            let names: Vec<&str> = names.iter().filter_map(Value::as_str).collect();
            LoraConfig::parse_targets(&names.join(","))
        }
        _ => Err("missing".to_owned()),
    }
    .map_err(|message| refuse("target_modules", message))?;
    for (name, allowed) in [
        ("bias", json!("none")),
        ("fan_in_fan_out", json!(false)),
        ("use_rslora", json!(false)),
        ("use_dora", json!(false)),
        ("lora_bias", json!(false)),
        ("use_qalora", json!(false)),
    ] {
        if let Some(v) = field(name)
            && *v != allowed
        {
            return Err(refuse(name, format!("{v}, padfree takes only {allowed}")));
        }
    }
    for name in [
        "modules_to_save",
        "layers_to_transform",
        "rank_pattern",
        "alpha_pattern",
    ] {
        let empty = match field(name) {
            None => true,
            Some(Value::Object(map)) => map.is_empty(),
            Some(Value::Array(list)) => list.is_empty(),
            Some(_) => false,
        };
        if !empty {
            return Err(refuse(name, "set; padfree takes only its default".into()));
        }
    }
    let base = field("base_model_name_or_path")
        .and_then(Value::as_str)
        .map(str::to_owned);
    Ok((
        LoraConfig {
            r,
            alpha,
            dropout,
            targets,
        },
        base,
    ))
}

/// The adapters saved in `dir`, for a model of `model`.
pub(crate) fn read(
    dir: &Path,
    model: &LlamaConfig,
    device: &Device,
) -> Result<(Lora, Option<String>), ModelError> {
    let (config, base) = read_config(dir)?;
    let files = WeightFiles::read_file(&dir.join(ADAPTER_WEIGHTS))?;
    let checkpoint = files.parse()?;
    const WRONG: &str = "the adapter was trained for another model, or adapter_config.json is not its own: give the base model it was trained on";
    let mut lora = Lora::build(&config, model, device, |layer, target, b, shape| {
        checkpoint.read_named(&super::peft_name(layer, target, b), &shape, WRONG)
    })?;
    lora.base = base.clone().unwrap_or_default();
    Ok((lora, base))
}

/// True when `dir` holds an adapter (its config file).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

#[cfg(test)]
mod tests {
    use super::super::LoraTarget;
    use super::*;

    #[test]
    fn unsupported_settings_are_refused_by_field() {
        let dir = tempfile::tempdir().expect("test setup");
        let write = |extra: &str| {
            std::fs::write(
                dir.path().join(ADAPTER_CONFIG),
                format!(
                    r#"{{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]{extra}}}"#
                ),
            )
            .expect("test setup");
        };
        write("");
        let (config, base) = read_config(dir.path()).expect("test setup");
        assert_eq!(config.targets, vec![LoraTarget::QProj, LoraTarget::VProj]);
        assert_eq!(
            (config.r, config.alpha, config.dropout, base),
            (8, 16.0, 0.0, None)
        );
        write(r#", "use_dora": true"#);
        let err = read_config(dir.path()).expect_err("refused").to_string();
        assert!(err.contains("`use_dora`"), "{err}");
        write(r#", "rank_pattern": {"q_proj": 4}"#);
        let err = read_config(dir.path()).expect_err("refused").to_string();
        assert!(err.contains("`rank_pattern`"), "{err}");
        write(r#", "target_modules": "all-linear""#);
        // A duplicate key: serde_json keeps the last one.
        assert_eq!(
            read_config(dir.path()).expect("test setup").0.targets.len(),
            7
        );
    }
}

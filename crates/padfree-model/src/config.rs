use std::path::Path;

use serde::Deserialize;

use crate::error::ModelError;

/// The architecture of a Llama-family decoder (Llama, Mistral, SmolLM2, ...):
/// they differ in these numbers, not in code.
///
/// Built from a Hugging Face `config.json` ([`LlamaConfig::from_hf_file`]) or a
/// named preset ([`LlamaConfig::tiny`], [`LlamaConfig::small`]), and validated
/// once on construction: a value of this type is always runnable.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `"llama"` or `"mistral"`, written back to `config.json`.
    pub model_type: String,
    /// Vocabulary size, `V`.
    pub vocab_size: usize,
    /// Model width, `C`.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads, `H`.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention), dividing `H`.
    pub num_key_value_heads: usize,
    /// Width of one head, `D`.
    pub head_dim: usize,
    /// Epsilon of RMSNorm.
    pub rms_norm_eps: f64,
    /// Base of the rotary embedding frequencies.
    pub rope_theta: f64,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest position the model was trained for.
    pub max_position_embeddings: usize,
    /// Mistral's sliding window, if any; a batch with a longer example is refused.
    pub sliding_window: Option<usize>,
    /// Standard deviation of the normal initialisation (HF `initializer_range`).
    pub initializer_range: f64,
    /// Token ids written back to `config.json`.
    pub bos_token_id: Option<u64>,
    /// Token ids written back to `config.json`.
    pub eos_token_id: Option<serde_json::Value>,
}

/// `config.json` as Hugging Face writes it; only the fields we read.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Option<Vec<String>>,
    #[serde(default)]
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default = "default_rms_norm_eps")]
    rms_norm_eps: f64,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5 moved `rope_theta` and the scaling kind here.
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "default_max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    hidden_act: Option<String>,
    #[serde(default = "default_initializer_range")]
    initializer_range: f64,
    #[serde(default)]
    bos_token_id: Option<u64>,
    #[serde(default)]
    eos_token_id: Option<serde_json::Value>,
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_max_position_embeddings() -> usize {
    2048
}
fn default_initializer_range() -> f64 {
    0.02
}

const SUPPORTED_ARCHITECTURES: [&str; 2] = ["LlamaForCausalLM", "MistralForCausalLM"];

impl LlamaConfig {
    /// 2 layers, width 64, 4 query heads over 2 key/value heads, vocabulary
    /// 128: for tests, where every gradient is checked.
    pub fn tiny() -> Self {
        Self::preset(128, 64, 128, 2, 4, 2)
    }

    /// 4 layers, width 256, 8 query heads over 4 key/value heads, vocabulary
    /// 8192 (~10M parameters): for demos and CPU benchmarks.
    pub fn small() -> Self {
        Self::preset(8192, 256, 688, 4, 8, 4)
    }

    /// 8 layers, width 512, 8 query heads over 4 key/value heads, MLP width
    /// 1408, vocabulary 32,000 (Llama-2 / Mistral's tokenizer size), untied
    /// head: 56.4M parameters, the size at which matmuls dominate a step as
    /// they do in real fine-tuning.
    pub fn medium() -> Self {
        Self::preset(32_000, 512, 1408, 8, 8, 4)
    }

    /// The preset names [`Self::named`] knows, smallest first.
    pub const PRESETS: [&'static str; 3] = ["tiny", "small", "medium"];

    /// A preset by name (one of [`Self::PRESETS`]).
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Self::tiny()),
            "small" => Some(Self::small()),
            "medium" => Some(Self::medium()),
            _ => None,
        }
    }

    fn preset(
        vocab: usize,
        hidden: usize,
        intermediate: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
    ) -> Self {
        Self {
            model_type: "llama".to_owned(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: intermediate,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: hidden / heads,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            tie_word_embeddings: false,
            max_position_embeddings: 2048,
            sliding_window: None,
            initializer_range: 0.02,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    /// Reads and validates a Hugging Face `config.json`.
    pub fn from_hf_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|err| ModelError::io(path, err))?;
        Self::from_hf_json(&text).map_err(|err| match err {
            ModelError::ConfigParse { message, .. } => ModelError::ConfigParse {
                path: path.to_owned(),
                message,
            },
            other => other,
        })
    }

    /// Parses and validates the text of a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let hf: HfConfig = serde_json::from_str(text).map_err(|err| ModelError::ConfigParse {
            path: "config.json".into(),
            message: err.to_string(),
        })?;
        Self::from_hf(hf)
    }

    fn from_hf(hf: HfConfig) -> Result<Self, ModelError> {
        check_architecture(hf.architectures.as_deref())?;
        if hf.attention_bias || hf.mlp_bias {
            return Err(unsupported(
                if hf.attention_bias {
                    "attention_bias"
                } else {
                    "mlp_bias"
                },
                "is true; Llama-family models without biases are supported",
            ));
        }
        if let Some(act) = hf.hidden_act.as_deref().filter(|act| *act != "silu") {
            return Err(unsupported(
                "hidden_act",
                &format!("is `{act}`; only `silu` (SwiGLU) is supported"),
            ));
        }
        let rope_theta = rope_theta(&hf)?;
        let heads = hf.num_attention_heads;
        let config = Self {
            model_type: hf.model_type.unwrap_or_else(|| "llama".to_owned()),
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size.checked_div(heads).unwrap_or(0)),
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta,
            tie_word_embeddings: hf.tie_word_embeddings,
            max_position_embeddings: hf.max_position_embeddings,
            sliding_window: hf.sliding_window,
            initializer_range: hf.initializer_range,
            bos_token_id: hf.bos_token_id,
            eos_token_id: hf.eos_token_id,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the invariants every other module relies on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(invalid(field, "is 0".to_owned()));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(invalid(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!("{} is odd; rotary embeddings rotate pairs", self.head_dim),
            ));
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(invalid(
                "rms_norm_eps",
                format!("{} is not a positive number", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return Err(invalid(
                "rope_theta",
                format!("{} is not a positive number", self.rope_theta),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(invalid("sliding_window", "is 0".to_owned()));
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The Hugging Face `config.json` of this model.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let architecture = if self.model_type == "mistral" {
            "MistralForCausalLM"
        } else {
            "LlamaForCausalLM"
        };
        serde_json::json!({
            "architectures": [architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
            "attention_bias": false,
            "mlp_bias": false,
            "hidden_act": "silu",
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        })
    }
}

fn check_architecture(architectures: Option<&[String]>) -> Result<(), ModelError> {
    match architectures {
        None => Ok(()),
        Some(names)
            if names
                .iter()
                .any(|name| SUPPORTED_ARCHITECTURES.contains(&name.as_str())) =>
        {
            Ok(())
        }
        Some(names) => Err(unsupported(
            "architectures",
            &format!("is {names:?}; supported: {SUPPORTED_ARCHITECTURES:?}"),
        )),
    }
}

/// `rope_theta` from either layout, refusing any scaling kind: a scaled
/// rotary embedding silently computed as the default one would be wrong.
fn rope_theta(hf: &HfConfig) -> Result<f64, ModelError> {
    for (field, value) in [
        ("rope_scaling", &hf.rope_scaling),
        ("rope_parameters", &hf.rope_parameters),
    ] {
        let Some(value) = value.as_ref().filter(|v| !v.is_null()) else {
            continue;
        };
        let kind = value
            .get("rope_type")
            .or_else(|| value.get("type"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or("default");
        if kind != "default" {
            return Err(unsupported(
                field,
                &format!("has rope type `{kind}`; only unscaled rotary embeddings are supported"),
            ));
        }
    }
    let from_parameters = hf
        .rope_parameters
        .as_ref()
        .and_then(|p| p.get("rope_theta"))
        .and_then(serde_json::Value::as_f64);
    Ok(hf.rope_theta.or(from_parameters).unwrap_or(10_000.0))
}

fn unsupported(field: &'static str, message: &str) -> ModelError {
    ModelError::Config {
        field,
        message: message.to_owned(),
        hint: "this model uses a feature padfree does not implement; pick a plain Llama, Mistral or SmolLM2 checkpoint",
    }
}

fn invalid(field: &'static str, message: String) -> ModelError {
    ModelError::Config {
        field,
        message,
        hint: "fix the value in config.json (or the preset)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2_135M: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "rms_norm_eps": 1e-05, "rope_theta": 100000, "rope_scaling": null,
        "tie_word_embeddings": true, "max_position_embeddings": 8192,
        "hidden_act": "silu", "attention_bias": false, "initializer_range": 0.041666666666666664,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn reads_a_real_hf_config() {
        let config = LlamaConfig::from_hf_json(SMOLLM2_135M).expect("valid config");
        assert_eq!(config.head_dim, 64);
        assert_eq!(config.group_size(), 3);
        assert!(config.tie_word_embeddings);
        assert_eq!(config.rope_theta, 100_000.0);
        // SmolLM2-135M has 134.5M parameters.
        assert_eq!(config.num_parameters(), 134_515_008);
    }

    #[test]
    fn presets_have_their_stated_sizes() {
        assert_eq!(LlamaConfig::medium().num_parameters(), 56_369_664);
        for name in LlamaConfig::PRESETS {
            let config = LlamaConfig::named(name).expect("a listed preset");
            assert!(config.validate().is_ok(), "{name}");
        }
    }

    #[test]
    fn round_trips_through_hf_json() {
        let config = LlamaConfig::tiny();
        let back = LlamaConfig::from_hf_json(&config.to_hf_json().to_string()).expect("valid");
        assert_eq!(back, config);
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        let cases = [
            (
                r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0}"#,
                "rope_scaling",
            ),
            (r#""attention_bias": true"#, "attention_bias"),
            (r#""hidden_act": "gelu""#, "hidden_act"),
            (r#""num_key_value_heads": 2"#, "num_key_value_heads"),
            (r#""architectures": ["GPT2LMHeadModel"]"#, "architectures"),
            (
                r#""rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}"#,
                "rope_parameters",
            ),
        ];
        for (patch, field) in cases {
            let mut config: serde_json::Value =
                serde_json::from_str(SMOLLM2_135M).expect("valid json");
            let patch_value: serde_json::Value =
                serde_json::from_str(&format!("{{{patch}}}")).expect("valid patch");
            for (key, value) in patch_value.as_object().expect("an object") {
                config[key] = value.clone();
            }
            let text = config.to_string();
            match LlamaConfig::from_hf_json(&text) {
                Err(ModelError::Config { field: got, .. }) => assert_eq!(got, field, "{patch}"),
                other => panic!("{patch}: expected a config error, got {other:?}"),
            }
        }
    }

    #[test]
    fn malformed_json_names_line_and_column() {
        let err =
            LlamaConfig::from_hf_json("{\n  \"vocab_size\": \"many\"\n}").expect_err("bad json");
        assert!(err.to_string().contains("line 2"), "{err}");
    }
}

use std::path::Path;

use serde::Deserialize;

use crate::error::ModelError;

/// The architecture of a Llama-family decoder (Llama, Mistral, SmolLM2,
/// Qwen2, Qwen3, ...): they differ in these numbers and two switches
/// (`qkv_bias`, `qk_norm`), not in code.
///
/// Built from a Hugging Face `config.json` ([`LlamaConfig::from_hf_file`]) or a
/// named preset ([`LlamaConfig::tiny`], [`LlamaConfig::small`]), and validated
/// once on construction: a value of this type is always runnable.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `"llama"`, `"mistral"`, `"qwen2"` or `"qwen3"`, written back to
    /// `config.json` (it also names the architecture there).
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
    /// Biases on the query, key and value projections (Qwen2), none on the
    /// output projection.
    pub qkv_bias: bool,
    /// An RMSNorm over each query and key head before the rotation (Qwen3).
    pub qk_norm: bool,
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
    /// Qwen2/Qwen3: whether `sliding_window` is used at all ...
    #[serde(default)]
    use_sliding_window: bool,
    /// ... and from which layer on (older configs) ...
    #[serde(default)]
    max_window_layers: Option<usize>,
    /// ... or layer by layer (newer configs).
    #[serde(default)]
    layer_types: Option<Vec<String>>,
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

/// The HF classes padfree computes exactly, and their `model_type`s.
const FAMILIES: [(&str, &str); 4] = [
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
];

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
            qkv_bias: false,
            qk_norm: false,
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
        let model_type = family(&hf)?;
        if hf.attention_bias {
            return Err(unsupported(
                "attention_bias",
                "is true (a bias on the output projection too); only Qwen2's query/key/value biases are supported",
            ));
        }
        if hf.mlp_bias {
            return Err(unsupported(
                "mlp_bias",
                "is true; Llama-family MLPs without biases are supported",
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
        let qwen = model_type.starts_with("qwen");
        // Qwen3Config's default head size is 128 whatever the width.
        let head_dim = hf.head_dim.unwrap_or(if model_type == "qwen3" {
            128
        } else {
            hf.hidden_size.checked_div(heads).unwrap_or(0)
        });
        let sliding_window = if qwen {
            qwen_sliding_window(&hf)
        } else {
            hf.sliding_window
        };
        let config = Self {
            qkv_bias: model_type == "qwen2",
            qk_norm: model_type == "qwen3",
            model_type,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta,
            tie_word_embeddings: hf.tie_word_embeddings,
            max_position_embeddings: hf.max_position_embeddings,
            sliding_window,
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
        let architecture = FAMILIES
            .iter()
            .find(|(_, model_type)| *model_type == self.model_type)
            .map_or("LlamaForCausalLM", |(class, _)| class);
        let qwen = self.model_type.starts_with("qwen");
        let mut json = serde_json::json!({
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
        });
        if qwen {
            // Qwen's configs say whether the window is used; padfree refuses
            // any batch it would change, so it is used when there is one.
            json["use_sliding_window"] = self.sliding_window.is_some().into();
            json["max_window_layers"] = 0.into();
            json["layer_types"] = serde_json::Value::Null;
        }
        json
    }
}

/// The family's `model_type`, from `architectures` (or `model_type` when
/// there is none); anything else is refused by name.
fn family(hf: &HfConfig) -> Result<String, ModelError> {
    let classes: Vec<&str> = FAMILIES.iter().map(|(class, _)| *class).collect();
    match hf.architectures.as_deref() {
        Some(names) => names
            .iter()
            .find_map(|name| FAMILIES.iter().find(|(class, _)| class == name))
            .map(|(_, model_type)| (*model_type).to_owned())
            .ok_or_else(|| {
                unsupported(
                    "architectures",
                    &format!("is {names:?}; supported: {classes:?}"),
                )
            }),
        None => {
            let model_type = hf.model_type.as_deref().unwrap_or("llama");
            FAMILIES
                .iter()
                .find(|(_, known)| *known == model_type)
                .map(|(_, known)| (*known).to_owned())
                .ok_or_else(|| {
                    unsupported(
                        "model_type",
                        &format!("is `{model_type}`; supported: {classes:?}"),
                    )
                })
        }
    }
}

/// The window of a Qwen2/Qwen3 config when some layer uses it: transformers
/// ignores `sliding_window` unless `use_sliding_window`, and then applies it
/// to the layers `layer_types` marks `sliding_attention` (or, in older
/// configs, to layers from `max_window_layers` on). A window on any layer
/// becomes the model's; `LlamaModel` refuses a batch with a longer example,
/// the only case where sliding and full attention differ.
fn qwen_sliding_window(hf: &HfConfig) -> Option<usize> {
    let window = hf.sliding_window.filter(|_| hf.use_sliding_window)?;
    let any_layer_slides = match (&hf.layer_types, hf.max_window_layers) {
        (Some(types), _) => types.iter().any(|t| t == "sliding_attention"),
        (None, Some(from)) => from < hf.num_hidden_layers,
        (None, None) => true,
    };
    any_layer_slides.then_some(window)
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
        hint: "this model uses a feature padfree does not implement; pick a Llama, Mistral, SmolLM2, Qwen2 or Qwen3 checkpoint",
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

    const QWEN2_5_0_5B: &str = r#"{
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": true,
        "max_position_embeddings": 32768, "sliding_window": 32768,
        "use_sliding_window": false, "max_window_layers": 21, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16"
    }"#;

    const QWEN3_0_6B: &str = r#"{
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
        "rope_scaling": null, "tie_word_embeddings": true, "attention_bias": false,
        "max_position_embeddings": 40960, "sliding_window": null,
        "use_sliding_window": false, "max_window_layers": 28, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn reads_real_qwen_configs() {
        let qwen2 = LlamaConfig::from_hf_json(QWEN2_5_0_5B).expect("valid config");
        assert!(qwen2.qkv_bias && !qwen2.qk_norm);
        assert_eq!(qwen2.head_dim, 64);
        // The window is off: transformers ignores `sliding_window` then.
        assert_eq!(qwen2.sliding_window, None);
        // Qwen2.5-0.5B has 494M parameters (tied head).
        assert_eq!(qwen2.num_parameters(), 494_032_768);
        let qwen3 = LlamaConfig::from_hf_json(QWEN3_0_6B).expect("valid config");
        assert!(qwen3.qk_norm && !qwen3.qkv_bias);
        // Qwen3's heads are wider than hidden / heads.
        assert_eq!(qwen3.head_dim, 128);
        // Qwen3-0.6B has 596M parameters (tied head).
        assert_eq!(qwen3.num_parameters(), 596_049_920);
        for config in [qwen2, qwen3] {
            let back = LlamaConfig::from_hf_json(&config.to_hf_json().to_string()).expect("valid");
            assert_eq!(back, config);
        }
    }

    #[test]
    fn a_qwen_sliding_window_counts_only_when_a_layer_uses_it() {
        let with = |patch: &str| {
            let mut config: serde_json::Value =
                serde_json::from_str(QWEN2_5_0_5B).expect("valid json");
            let patch: serde_json::Value = serde_json::from_str(patch).expect("valid patch");
            for (key, value) in patch.as_object().expect("an object") {
                config[key] = value.clone();
            }
            LlamaConfig::from_hf_json(&config.to_string())
                .expect("valid")
                .sliding_window
        };
        assert_eq!(with(r#"{"use_sliding_window": true}"#), Some(32768));
        assert_eq!(
            with(r#"{"use_sliding_window": true, "max_window_layers": 24}"#),
            None
        );
        assert_eq!(
            with(r#"{"use_sliding_window": true, "layer_types": ["full_attention"]}"#),
            None
        );
        assert_eq!(
            with(r#"{"use_sliding_window": true, "layer_types": ["sliding_attention"]}"#),
            Some(32768)
        );
    }

    #[test]
    fn malformed_json_names_line_and_column() {
        let err =
            LlamaConfig::from_hf_json("{\n  \"vocab_size\": \"many\"\n}").expect_err("bad json");
        assert!(err.to_string().contains("line 2"), "{err}");
    }
}

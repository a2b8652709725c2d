//! The LoRA flags of `padfree train` and `padfree bench` (TRL's
//! `ModelConfig` names), validated into a [`LoraConfig`].

use anyhow::bail;
use padfree_model::{LoraConfig, LoraTarget};

#[derive(Debug, Clone, clap::Args)]
pub struct LoraArgs {
    /// Train LoRA adapters (TRL's flag): the model's weights are frozen, and
    /// checkpoints and the final output hold PEFT's adapter files.
    #[arg(long)]
    pub use_peft: bool,
    /// LoRA rank.
    #[arg(long, default_value_t = 16, requires = "use_peft")]
    pub lora_r: usize,
    /// LoRA alpha; the update is scaled by alpha / r.
    #[arg(long, default_value_t = 32.0, requires = "use_peft")]
    pub lora_alpha: f64,
    /// Dropout on the adapters' inputs while training.
    #[arg(long, default_value_t = 0.05, requires = "use_peft")]
    pub lora_dropout: f64,
    /// The layers that get adapters: module names separated by commas
    /// (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj), or
    /// all-linear [default: q_proj,v_proj, PEFT's for Llama].
    #[arg(long, requires = "use_peft")]
    pub lora_target_modules: Option<String>,
}

impl LoraArgs {
    /// The adapters' settings, `None` without `--use-peft`.
    pub fn validate(&self) -> anyhow::Result<Option<LoraConfig>> {
        if !self.use_peft {
            return Ok(None);
        }
        if self.lora_r == 0 {
            bail!("--lora-r must be at least 1\nHINT: 8 to 64 is usual; 16 is TRL's default");
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            bail!(
                "--lora-dropout {} is not in [0, 1)\nHINT: 0.05 is TRL's default, 0 turns it off",
                self.lora_dropout
            );
        }
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            bail!("--lora-alpha must be positive\nHINT: twice --lora-r is usual (32 for r 16)");
        }
        Ok(Some(LoraConfig {
            r: self.lora_r,
            alpha: self.lora_alpha,
            // `-0` is 0 (adding +0 clears the sign), not a "dropout -0".
            dropout: self.lora_dropout + 0.0,
            targets: match &self.lora_target_modules {
                Some(text) => LoraConfig::parse_targets(text)
                    .map_err(|err| anyhow::anyhow!("--lora-target-modules: {err}"))?,
                None => LoraTarget::DEFAULT.to_vec(),
            },
        }))
    }

    /// The flags that give `lora` again (for a child process).
    pub fn flags(lora: &LoraConfig) -> Vec<String> {
        let targets: Vec<&str> = lora.targets.iter().map(|t| t.module()).collect();
        vec![
            "--use-peft".into(),
            "--lora-r".into(),
            lora.r.to_string(),
            "--lora-alpha".into(),
            lora.alpha.to_string(),
            "--lora-dropout".into(),
            lora.dropout.to_string(),
            "--lora-target-modules".into(),
            targets.join(","),
        ]
    }
}

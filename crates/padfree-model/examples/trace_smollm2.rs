//! padfree's side of the per-layer comparison with HF transformers on
//! SmolLM2-135M (`scripts/trace_smollm2.py` is the other side).
//!
//! ```sh
//! cargo run --example trace_smollm2 -- SmolLM2-135M-Instruct.Q4_1.gguf out/
//! .venv-peer/bin/python scripts/trace_smollm2.py out/
//! ```
//!
//! Writes into the output directory: `model/` (the GGUF dequantised to f32,
//! as HF safetensors), `batch.json` (the token ids of 16 shipped maths
//! problems in SmolLM2's ChatML, one list per example), and
//! `padfree_states.bin` (f32 little-endian `[L + 2, T, C]`: the embedding,
//! each decoder layer's output and the final norm, `LlamaModel::layer_states`)
//! with `padfree_loss.txt` (the mean loss over every next token).

use std::path::PathBuf;

use padfree_model::gguf::GgufFile;
use padfree_model::tensor::{IntoHostVec, cpu_device};
use padfree_model::{LlamaModel, ModelInput, tokenizer_from_gguf};
use padfree_pack::{Example, flatten};

const EXAMPLES: usize = 16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(gguf), Some(out)) = (args.next(), args.next()) else {
        return Err("usage: trace_smollm2 MODEL.gguf OUT_DIR".into());
    };
    let out = PathBuf::from(out);
    std::fs::create_dir_all(&out)?;
    let file = GgufFile::open(gguf.as_ref())?;
    let model = LlamaModel::from_gguf_file(&file, &cpu_device(false))?;
    let tokenizer = tokenizer_from_gguf(&file)?;
    model.save_hf_dir(&out.join("model"))?;

    let data = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/gsm-symbolic/train.jsonl"),
    )?;
    let mut examples = Vec::new();
    for line in data.lines().take(EXAMPLES) {
        let record: serde_json::Value = serde_json::from_str(line)?;
        let text = format!(
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n",
            record["question"].as_str().unwrap_or_default(),
            record["answer"].as_str().unwrap_or_default()
        );
        let ids = tokenizer
            .encode(text, false)
            .map_err(|err| err.to_string())?
            .get_ids()
            .to_vec();
        examples.push(Example::causal(ids)?);
    }
    let ids: Vec<&[u32]> = examples.iter().map(Example::input_ids).collect();
    std::fs::write(out.join("batch.json"), serde_json::to_string(&ids)?)?;

    let batch = flatten(&examples)?;
    let input = ModelInput::Varlen(&batch);
    let mut bytes = Vec::new();
    for state in model.layer_states(&input)? {
        for value in state.into_vec() {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
    }
    std::fs::write(out.join("padfree_states.bin"), bytes)?;
    let loss = model.loss_sum(&input)?;
    let mean = f64::from(loss.sum.into_vec()[0]) / loss.num_tokens as f64;
    std::fs::write(out.join("padfree_loss.txt"), format!("{mean:.9}\n"))?;
    println!(
        "{} examples, {} tokens, loss {mean:.9}; wrote {}",
        examples.len(),
        batch.num_tokens(),
        out.display()
    );
    Ok(())
}

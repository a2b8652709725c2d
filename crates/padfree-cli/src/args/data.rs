//! The flags of how records are read and tokenized, and where the
//! tokenized data is cached: one list for `train` (and `check`) and
//! `pack --data`, so both make the same examples and share the cache.

use std::path::PathBuf;

use anyhow::bail;
use clap::ValueEnum;
use padfree_data::{DataCache, FieldNames, Overlong};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OverlongArg {
    Truncate,
    Drop,
}

#[derive(Debug, Clone, clap::Args)]
pub struct DataArgs {
    /// The prompt field of prompt/completion records with other names.
    #[arg(long, group = "prompt_source", requires = "completion_field")]
    pub prompt_field: Option<String>,
    /// The prompt built from several fields: `{field}` is a record's field,
    /// `\n` a newline, `{{` a brace (e.g. '{passage}\n{question}'), with
    /// --completion-field for the response.
    #[arg(long, group = "prompt_source", requires = "completion_field")]
    pub prompt_template: Option<String>,
    /// The completion field (with --prompt-field or --prompt-template).
    #[arg(long, requires = "prompt_source")]
    pub completion_field: Option<String>,
    /// The field holding chat messages (default: messages).
    #[arg(long)]
    pub messages_field: Option<String>,
    /// Every record is raw text in this field, the loss on every token
    /// (TRL's dataset_text_field; records of only `text` are read so anyway).
    #[arg(long, conflicts_with_all = ["prompt_source", "messages_field"])]
    pub dataset_text_field: Option<String>,
    /// Put the loss on the prompt too (default: on the response only).
    #[arg(long)]
    pub train_on_inputs: bool,
    /// Render prompt/completion, question/answer and Alpaca records as a chat
    /// with the tokenizer's chat template (for instruct models).
    #[arg(long)]
    pub use_chat_template: bool,
    /// What to do with longer examples: keep their first --max-seq-len tokens, or drop them.
    #[arg(long, value_enum, default_value_t = OverlongArg::Truncate)]
    pub overlong: OverlongArg,
    /// Where tokenized data sets are kept, so the next start with the same
    /// data, tokenizer and settings does not tokenize again (default:
    /// $PADFREE_DATA_CACHE, else $XDG_CACHE_HOME/padfree/data, else
    /// ~/.cache/padfree/data).
    #[arg(long, value_name = "DIR")]
    pub data_cache_dir: Option<PathBuf>,
    /// Tokenize the data on every start, and keep nothing of it on disk.
    #[arg(long, conflicts_with = "data_cache_dir")]
    pub no_data_cache: bool,
}

impl DataArgs {
    /// Refuses a `--prompt-template` that is not one, before anything loads.
    pub fn check_template(&self) -> anyhow::Result<()> {
        if let Some(template) = &self.prompt_template
            && let Err(message) = padfree_data::template_fields(template)
        {
            bail!(
                "--prompt-template {template:?}: {message}\nHINT: e.g. --prompt-template '{{passage}}\\n{{question}}' --completion-field answer"
            );
        }
        Ok(())
    }

    /// The field names the records are read with.
    pub fn fields(&self) -> FieldNames {
        FieldNames {
            prompt: self.prompt_field.clone(),
            completion: self.completion_field.clone(),
            messages: self.messages_field.clone(),
            text: self.dataset_text_field.clone(),
            prompt_template: self.prompt_template.clone(),
        }
    }

    /// `--overlong`.
    pub fn overlong(&self) -> Overlong {
        match self.overlong {
            OverlongArg::Truncate => Overlong::Truncate,
            OverlongArg::Drop => Overlong::Drop,
        }
    }

    /// Where tokenized data is kept (`None`: --no-data-cache, or no home
    /// directory to keep it in).
    pub fn cache(&self) -> Option<DataCache> {
        match (self.no_data_cache, &self.data_cache_dir) {
            (true, _) => None,
            (false, Some(dir)) => Some(DataCache::new(dir)),
            (false, None) => DataCache::default_dir().map(DataCache::new),
        }
    }
}

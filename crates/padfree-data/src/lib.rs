//! # padfree-data
//!
//! Turns a fine-tuning file into validated [`padfree_pack::Example`]s.
//!
//! 1. [`read_records`]: JSONL or a JSON array, a Parquet file or shards, an
//!    HF `datasets` directory (`columnar.rs`); each record is one of
//!    `{prompt, completion}`, `{question, answer}`, Alpaca
//!    `{instruction, input?, output}`, chat `{messages: [{role, content}]}`,
//!    or pre-tokenized `{input_ids, labels?}` (field names overridable).
//!    Errors name the file, the line (or array element) and the field.
//! 2. [`TextTokenizer`]: a `tokenizers` tokenizer with its EOS token and chat
//!    template (from `tokenizer_config.json`, a GGUF file, or built in).
//! 3. [`tokenize_records`]: prompt and response tokenized apart and joined,
//!    EOS appended, loss on the response only unless `train_on_inputs`, the
//!    `max_seq_len` policy applied and counted in a [`DataReport`].
//! 4. [`DataCache`]: the tokenized examples kept on disk, keyed by the
//!    data's bytes, the tokenizer and every setting that shapes them, so the
//!    next start reads them back instead of tokenizing (`cache/`); a cold
//!    start streams into it ([`DataCache::build`]: records a chunk at a time,
//!    `stream.rs`, tokenized on every core, [`tokenize_in_parallel`]), and a
//!    run reads its examples from it a step at a time ([`DataSet`],
//!    `dataset.rs`).

mod cache;
mod columnar;
mod dataset;
mod error;
mod prompt_template;
mod records;
mod stream;
mod template;
mod tokenize;

pub use cache::{
    CHUNK_RECORDS, CacheKeyParts, CacheUse, DataCache, FORMAT as CACHE_FORMAT, Fingerprint, Lookup,
    Ranks, ShareWriter, cache_key, content_fingerprint, data_fingerprint, file_fingerprint,
};
pub use dataset::DataSet;
pub use error::DataError;
pub use prompt_template::template_fields;
pub use records::{
    FieldNames, Message, Record, SourceRecord, UnusedField, holds_text_records, read_records,
    read_records_from_str, unused_text_fields,
};
pub use stream::{ReadProgress, count_records, for_each_record_chunk, for_each_record_chunk_in};
pub use template::{CHATML_TEMPLATE, ChatTemplate};
pub use tokenize::{
    DataReport, Overlong, PROGRESS_EVERY, TextTokenizer, TokenizeConfig, TokenizedDataset,
    TokenizedPart, TokenizerDifference, finish_parts, tokenize_in_parallel, tokenize_part_with,
    tokenize_records, tokenize_with_progress,
};

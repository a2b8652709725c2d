//! A data set as a run trains on it: the examples held in memory, or read
//! a step at a time from a tokenized-data cache entry.

use std::path::PathBuf;

use padfree_pack::ExampleSet;

use crate::records::UnusedField;
use crate::tokenize::{DataReport, TokenizedDataset};

/// Examples ready for the collator, with where each came from.
#[derive(Debug, Clone)]
pub struct DataSet {
    /// The file the records were read from.
    pub source: PathBuf,
    /// One per kept record, in file order.
    pub examples: ExampleSet,
    /// The record location (`line N`) of every example.
    pub locations: Vec<String>,
    /// Counts for the user.
    pub report: DataReport,
    /// Text fields no record's shape trains on.
    pub unused_fields: Vec<UnusedField>,
}

impl From<TokenizedDataset> for DataSet {
    fn from(dataset: TokenizedDataset) -> Self {
        Self {
            source: dataset.source,
            examples: dataset.examples.into(),
            locations: dataset.locations,
            report: dataset.report,
            unused_fields: dataset.unused_fields,
        }
    }
}

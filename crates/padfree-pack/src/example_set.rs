//! A data set's examples: held as [`Example`]s, or end to end in a
//! [`TokenSource`] (a tokenized-data cache entry's files) from which a step
//! reads only its own examples, so a run's memory does not grow with its
//! data.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use crate::error::PackError;
use crate::example::Example;

/// Tokens stored end to end: the ids and labels of a range of them.
pub trait TokenSource: Send + Sync + fmt::Debug {
    /// Ids and labels of tokens `range` (offsets into the whole set), or
    /// why they could not be read.
    fn tokens(&self, range: Range<u64>) -> Result<(Vec<u32>, Vec<i64>), String>;
}

/// The examples of a data set, in order.
#[derive(Debug, Clone)]
pub struct ExampleSet {
    store: Store,
    /// What the one who stored the examples counted while checking them,
    /// so a run does not read every example again for it.
    known: Option<Arc<Known>>,
}

/// Counts over a stored set, made by whoever read it whole.
#[derive(Debug)]
struct Known {
    fingerprint: u64,
    loss_tokens: Vec<u32>,
}

/// FNV-1a over examples (each one's length, ids and labels, as 8-byte
/// little-endian words): the data a resumed run checks it trains on. The
/// same examples give the same fingerprint, held or stored.
#[derive(Debug, Clone)]
pub struct Fingerprint(u64);

impl Default for Fingerprint {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fingerprint {
    fn eat(&mut self, value: u64) {
        for byte in value.to_le_bytes() {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Adds `example`, the next one.
    pub fn add(&mut self, example: &Example) {
        self.eat(example.len() as u64);
        example
            .input_ids()
            .iter()
            .for_each(|&id| self.eat(u64::from(id)));
        example
            .labels()
            .iter()
            .for_each(|&label| self.eat(label as u64));
    }

    /// The fingerprint of the examples added.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Debug, Clone)]
enum Store {
    Held(Vec<Example>),
    /// `offsets[i]..offsets[i + 1]` are example `i`'s tokens in `source`.
    Read {
        offsets: Arc<[u64]>,
        source: Arc<dyn TokenSource>,
    },
}

impl From<Vec<Example>> for ExampleSet {
    fn from(examples: Vec<Example>) -> Self {
        Self {
            store: Store::Held(examples),
            known: None,
        }
    }
}

impl ExampleSet {
    /// Examples read from `source` when asked for: example `i` is tokens
    /// `offsets[i]..offsets[i + 1]`. Refused unless the offsets start at 0
    /// and every example has a token.
    pub fn from_source(offsets: Vec<u64>, source: Arc<dyn TokenSource>) -> Result<Self, PackError> {
        if offsets.first() != Some(&0) {
            return Err(PackError::NoExamples);
        }
        if let Some(index) = offsets.windows(2).position(|w| w[1] <= w[0]) {
            return Err(PackError::ZeroLength { index });
        }
        Ok(Self {
            store: Store::Read {
                offsets: offsets.into(),
                source,
            },
            known: None,
        })
    }

    /// The set with its [`Fingerprint`] and every example's loss tokens
    /// ([`Example::num_loss_tokens`]), as counted by whoever read it whole
    /// (a cache entry is checked example by example when opened); ignored
    /// unless there is a count per example.
    pub fn with_counts(mut self, fingerprint: u64, loss_tokens: Vec<u32>) -> Self {
        if loss_tokens.len() == self.len() {
            self.known = Some(Arc::new(Known {
                fingerprint,
                loss_tokens,
            }));
        }
        self
    }

    /// The [`Fingerprint`] of every example, in order.
    pub fn fingerprint(&self) -> Result<u64, PackError> {
        if let Some(known) = &self.known {
            return Ok(known.fingerprint);
        }
        let mut hash = Fingerprint::default();
        for example in self.iter() {
            hash.add(&*example?);
        }
        Ok(hash.finish())
    }

    /// Every example's loss tokens ([`Example::num_loss_tokens`]), in order.
    pub fn loss_tokens(&self) -> Result<Vec<usize>, PackError> {
        (0..self.len()).map(|i| self.loss_tokens_of(i)).collect()
    }

    /// The loss tokens of example `index` (below [`Self::len`]): as counted
    /// when the set was checked, else from the example.
    pub fn loss_tokens_of(&self, index: usize) -> Result<usize, PackError> {
        match &self.known {
            Some(known) => Ok(known.loss_tokens[index] as usize),
            None => Ok(self.get(index)?.num_loss_tokens()),
        }
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        match &self.store {
            Store::Held(examples) => examples.len(),
            Store::Read { offsets, .. } => offsets.len().saturating_sub(1),
        }
    }

    /// Whether there is no example.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens of example `index` (which must be below [`Self::len`]).
    pub fn example_len(&self, index: usize) -> usize {
        match &self.store {
            Store::Held(examples) => examples[index].len(),
            Store::Read { offsets, .. } => (offsets[index + 1] - offsets[index]) as usize,
        }
    }

    /// Every example's length, in order: what planning needs.
    pub fn lengths(&self) -> Vec<usize> {
        (0..self.len()).map(|i| self.example_len(i)).collect()
    }

    /// Example `index` (below [`Self::len`]): borrowed when held, read
    /// and validated when stored.
    pub fn get(&self, index: usize) -> Result<Cow<'_, Example>, PackError> {
        match &self.store {
            Store::Held(examples) => Ok(Cow::Borrowed(&examples[index])),
            Store::Read { offsets, source } => {
                let range = offsets[index]..offsets[index + 1];
                let (ids, labels) = source
                    .tokens(range)
                    .map_err(|message| PackError::Unreadable { index, message })?;
                Example::new(ids, labels)
                    .map(Cow::Owned)
                    .map_err(|cause| PackError::InvalidExample { index, cause })
            }
        }
    }

    /// Every example in order.
    pub fn iter(&self) -> impl Iterator<Item = Result<Cow<'_, Example>, PackError>> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }

    /// Every example, held.
    pub fn into_examples(self) -> Result<Vec<Example>, PackError> {
        match self.store {
            Store::Held(examples) => Ok(examples),
            Store::Read { .. } => self.iter().map(|e| e.map(Cow::into_owned)).collect(),
        }
    }

    /// Whether the examples are read from a source (not held).
    pub fn is_stored(&self) -> bool {
        matches!(self.store, Store::Read { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source over vectors, counting reads.
    #[derive(Debug)]
    struct Vectors(Vec<u32>, Vec<i64>);

    impl TokenSource for Vectors {
        fn tokens(&self, range: Range<u64>) -> Result<(Vec<u32>, Vec<i64>), String> {
            let r = range.start as usize..range.end as usize;
            let ids = self.0.get(r.clone()).ok_or("past the end")?.to_vec();
            Ok((ids, self.1[r].to_vec()))
        }
    }

    fn held() -> Vec<Example> {
        vec![
            Example::new(vec![1, 2, 3], vec![-100, 2, 3]).expect("valid"),
            Example::causal(vec![7]).expect("valid"),
            Example::new(vec![4, 5], vec![4, -100]).expect("valid"),
        ]
    }

    fn stored(examples: &[Example]) -> ExampleSet {
        let mut offsets = vec![0];
        let (mut ids, mut labels) = (Vec::new(), Vec::new());
        for e in examples {
            ids.extend_from_slice(e.input_ids());
            labels.extend_from_slice(e.labels());
            offsets.push(ids.len() as u64);
        }
        ExampleSet::from_source(offsets, Arc::new(Vectors(ids, labels))).expect("offsets")
    }

    #[test]
    fn a_stored_set_reads_back_the_held_examples() {
        let examples = held();
        let (held_set, stored_set) = (ExampleSet::from(examples.clone()), stored(&examples));
        assert!(stored_set.is_stored() && !held_set.is_stored());
        assert_eq!(stored_set.len(), 3);
        assert_eq!(stored_set.lengths(), vec![3, 1, 2]);
        assert_eq!(held_set.lengths(), stored_set.lengths());
        for (i, example) in examples.iter().enumerate() {
            assert_eq!(*stored_set.get(i).expect("reads"), *example);
            assert_eq!(*held_set.get(i).expect("held"), *example);
        }
        assert_eq!(held_set.fingerprint().ok(), stored_set.fingerprint().ok());
        let counts = vec![2, 0, 0];
        assert_eq!(held_set.loss_tokens().expect("held"), counts);
        assert_eq!(stored_set.loss_tokens().expect("reads"), counts);
        let told = stored_set.clone().with_counts(7, vec![9, 9, 9]);
        assert_eq!(told.fingerprint().ok(), Some(7), "told counts are used");
        assert_eq!(told.loss_tokens().expect("told"), vec![9, 9, 9]);
        let short = stored_set.clone().with_counts(7, vec![9]);
        assert_eq!(short.fingerprint().ok(), held_set.fingerprint().ok());
        assert_eq!(stored_set.into_examples().expect("reads"), examples);
    }

    #[test]
    fn bad_offsets_and_bad_tokens_are_refused() {
        let source = Arc::new(Vectors(vec![1, 2], vec![1, -5]));
        assert!(ExampleSet::from_source(vec![1, 2], source.clone()).is_err());
        assert!(ExampleSet::from_source(vec![0, 1, 1], source.clone()).is_err());
        let set = ExampleSet::from_source(vec![0, 1, 2, 9], source).expect("offsets");
        assert!(set.get(0).is_ok());
        let invalid = set.get(1).expect_err("label -5");
        assert!(invalid.to_string().contains("example 1"), "{invalid}");
        let unreadable = set.get(2).expect_err("past the end");
        assert!(
            unreadable.to_string().contains("past the end"),
            "{unreadable}"
        );
    }
}

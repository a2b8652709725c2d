//! Names a run and its data: the fingerprints a resumed run and every rank
//! must agree on, and the run id that tells this run's files from
//! another's.

use std::path::Path;

use padfree_pack::{Example, ExampleSet, Fingerprint, PackError};

/// The fingerprint of the training examples ([`padfree_pack::Fingerprint`]):
/// a resumed run must train on the same data. Held or read from a cache
/// entry, the same examples give the same fingerprint.
pub(super) fn fingerprint(examples: &ExampleSet) -> Result<u64, PackError> {
    examples.fingerprint()
}

/// FNV-1a over the sorted fingerprints of the examples one by one: the same
/// for the same examples in any order (the eval loss is a sum over the set,
/// so a reshuffled eval file is the same set).
pub(super) fn set_fingerprint(examples: &[Example]) -> u64 {
    let mut each: Vec<u64> = examples
        .iter()
        .map(|e| {
            let mut hash = Fingerprint::default();
            hash.add(e);
            hash.finish()
        })
        .collect();
    each.sort_unstable();
    let mut hash = Fnv1a::new();
    each.into_iter().for_each(|h| hash.eat(h));
    hash.finish()
}

/// A name for a fresh run, different from any other run's: the clock, the
/// process and an address mixed by SplitMix64 (no random-number crate).
pub(super) fn new_run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let address = std::ptr::addr_of!(local) as u64;
    let mut rng = padfree_pack::SplitMix64::new(
        nanos ^ u64::from(std::process::id()).rotate_left(32) ^ address,
    );
    format!("{:016x}", rng.next_u64())
}

/// Whether two paths name the same directory (links resolved where they exist).
pub(super) fn same_dir(a: &Path, b: &Path) -> bool {
    let resolve = |p: &Path| {
        let p = if p.as_os_str().is_empty() {
            Path::new(".")
        } else {
            p
        };
        p.canonicalize()
            .or_else(|_| std::path::absolute(p))
            .unwrap_or_else(|_| p.to_owned())
    };
    resolve(a) == resolve(b)
}

/// FNV-1a over the little-endian bytes of each value eaten.
pub(super) struct Fnv1a(u64);

impl Fnv1a {
    pub(super) fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    pub(super) fn eat(&mut self, value: u64) {
        for byte in value.to_le_bytes() {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub(super) fn finish(&self) -> u64 {
        self.0
    }
}

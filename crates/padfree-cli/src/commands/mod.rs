//! What each command does, given its validated job (`crate::args`).

pub mod bench;
pub mod check;
pub mod pack;
pub mod train;

//! A global allocator that starts every buffer of 4 KiB or more on a
//! 64-byte cache line, for the binary to install (`#[global_allocator]`).
//!
//! glibc's `malloc` aligns to 16 bytes. The AMX body's outputs are stored
//! from tiles in place only where their rows lie on lines (a tile store
//! across lines costs several times more, `gemm_bf16/packed.rs`'s `Pack`),
//! so a kernel output from `malloc` went through a tile-sized copy for
//! every micro-tile: on SmolLM2-135M's shapes (1,024 rows, `x W^T` and
//! `dy W` together) those products took 1.07-1.11x the time they take into
//! a buffer on a line (means of 38 interleaved rounds; `tiles` in
//! `gemm_bf16/amx.rs`). Every vector loop over a whole buffer reads whole
//! lines too.
//!
//! Smaller allocations keep `malloc`'s own alignment (64 bytes for a
//! short string would be waste). A big one takes 72 bytes more from
//! `malloc` (or `calloc`) with its own alignment and starts at the first
//! line 8 bytes in, its offset in those 8 bytes. Asking `malloc` for
//! 64-byte alignment instead (`posix_memalign`) raised the peak of a
//! SmolLM2-135M step by 616 MiB (3,650 -> 4,266): zeroed blocks were
//! zeroed by hand rather than left to `calloc`'s fresh pages, `realloc`
//! became a copy, and a freed aligned block no longer fitted the next
//! request of its size.
//!
//! The library's tests run on the default allocator: the kernels are
//! correct on any alignment (their tests place outputs off lines on
//! purpose); only their speed asks for lines.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes of the big blocks alive now, and their high-water mark since
/// [`reset_lined_peak`]: every buffer of [`LINED_FROM`] bytes or more
/// (weights, gradients, moments, activations, kernel outputs, burn's own
/// tensors, which ask for their own alignment and are not moved), so a
/// trace of a step's phases (`PADFREE_MEMORY_TRACE` in the trainer) says
/// what is alive where the resident memory only says how much was ever
/// touched. Relaxed atomics: two per big allocation (a few thousand a
/// step), and zero where this allocator is not installed (the library's
/// tests).
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes, Ordering::Relaxed);
}

/// Bytes of buffers of [`LINED_FROM`] bytes or more that [`LineAligned`]
/// holds: alive now, and the most alive at once since the last
/// [`reset_lined_peak`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinedBytes {
    /// Alive now.
    pub live: usize,
    /// The most alive at once since the last reset.
    pub peak: usize,
}

/// What [`LineAligned`] holds now (all zero where it is not the global
/// allocator).
pub fn lined_bytes() -> LinedBytes {
    LinedBytes {
        live: LIVE.load(Ordering::Relaxed),
        peak: PEAK.load(Ordering::Relaxed),
    }
}

/// Starts a new high-water mark from what is alive now.
pub fn reset_lined_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// `System`, with buffers of [`LINED_FROM`] bytes or more on cache lines.
#[derive(Debug, Default, Clone, Copy)]
pub struct LineAligned;

/// A cache line.
const LINE: usize = 64;
/// The smallest allocation put on a line.
pub const LINED_FROM: usize = 4096;
/// Bytes a lined block takes from `System` beyond its size: room to move
/// its start onto a line, and the 8 bytes before that start that say how
/// far it moved.
const EXTRA: usize = LINE + OFFSET_BYTES;
const OFFSET_BYTES: usize = std::mem::size_of::<usize>();

/// Whether `layout` is put on a line.
fn lined(layout: Layout) -> bool {
    layout.size() >= LINED_FROM && layout.align() < LINE
}

/// Whether `layout` is counted in [`lined_bytes`]: every buffer of
/// [`LINED_FROM`] bytes or more, those that ask for a line or more of
/// alignment themselves (burn's tensor bytes) too.
fn counted(layout: Layout) -> bool {
    layout.size() >= LINED_FROM
}

/// The block `System` holds for a lined `layout` (its size plus
/// [`EXTRA`]), or `None` where that size would overflow.
fn raw_layout(layout: Layout) -> Option<Layout> {
    Layout::from_size_align(layout.size().checked_add(EXTRA)?, layout.align()).ok()
}

/// How far into a block starting at `raw` its values start: the first
/// line at least [`OFFSET_BYTES`] in (below [`EXTRA`]).
fn line_offset(raw: *mut u8) -> usize {
    (raw as usize + OFFSET_BYTES).next_multiple_of(LINE) - raw as usize
}

/// The start [`line_offset`] gives in `raw`, the offset written just
/// before it.
///
/// # Safety
/// `raw` is a block of at least `EXTRA` bytes (so the offset, at most
/// `EXTRA - 1`, and the 8 bytes before it lie within it).
unsafe fn place(raw: *mut u8) -> *mut u8 {
    let offset = line_offset(raw);
    // SAFETY: `OFFSET_BYTES <= offset < OFFSET_BYTES + LINE = EXTRA`, within
    // the block (the caller's contract).
    unsafe {
        let start = raw.add(offset);
        start
            .sub(OFFSET_BYTES)
            .cast::<usize>()
            .write_unaligned(offset);
        start
    }
}

/// `len` values that lie `old_offset` bytes into `raw` (a block that
/// `realloc` moved), moved to where [`place`] puts them for `raw` and
/// placed there.
///
/// # Safety
/// `raw` is a block of at least `len + EXTRA` bytes, `old_offset` is below
/// `EXTRA`, and the `len` bytes from it are the values.
unsafe fn replace(raw: *mut u8, old_offset: usize, len: usize) -> *mut u8 {
    let new_offset = line_offset(raw);
    // SAFETY: both ranges lie within the block (offsets below `EXTRA`);
    // `copy` allows them to overlap; `place` as the caller's contract says.
    unsafe {
        if new_offset != old_offset {
            std::ptr::copy(raw.add(old_offset), raw.add(new_offset), len);
        }
        place(raw)
    }
}

/// The block a lined pointer was placed in.
///
/// # Safety
/// `ptr` came from [`place`].
unsafe fn raw_of(ptr: *mut u8) -> *mut u8 {
    // SAFETY: `place` wrote the offset in the 8 bytes before `ptr`, within
    // its block.
    unsafe {
        let offset = ptr.sub(OFFSET_BYTES).cast::<usize>().read_unaligned();
        ptr.sub(offset)
    }
}

/// A block for `layout` from `System`'s `get` (`alloc` or
/// `alloc_zeroed`): as it is, or [`EXTRA`] bytes longer and placed on a
/// line where `layout` is lined.
///
/// # Safety
/// `layout` has a non-zero size.
unsafe fn allocate(layout: Layout, get: unsafe fn(&System, Layout) -> *mut u8) -> *mut u8 {
    if !lined(layout) {
        // SAFETY: the caller's non-zero layout.
        let block = unsafe { get(&System, layout) };
        if counted(layout) && !block.is_null() {
            grew(layout.size());
        }
        return block;
    }
    let Some(raw_layout) = raw_layout(layout) else {
        return std::ptr::null_mut();
    };
    // SAFETY: a non-zero size; `place` gets a block of `EXTRA` bytes or
    // more.
    unsafe {
        let raw = get(&System, raw_layout);
        if raw.is_null() {
            return raw;
        }
        grew(layout.size());
        place(raw)
    }
}

// SAFETY: a layout that is not lined goes to `System` as it is. A lined
// one takes a `System` block of its size plus `EXTRA` bytes, of its
// alignment (so zeroed blocks are still `calloc`'s, whose fresh pages are
// not touched, and freed blocks fit the next request of the same size),
// and hands out the first line at least 8 bytes in: the block holds the
// whole size from there. Whether a layout is lined depends on its size
// and alignment only, so `dealloc` and `realloc` find the block the same
// way `alloc` made it.
unsafe impl GlobalAlloc for LineAligned {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, non-zero in size.
        unsafe { allocate(layout, <System as GlobalAlloc>::alloc) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`; the offset `place` writes lies before the
        // values, which stay zero.
        unsafe { allocate(layout, <System as GlobalAlloc>::alloc_zeroed) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match raw_layout(layout).filter(|_| lined(layout)) {
            Some(raw_layout) => {
                shrank(layout.size());
                // SAFETY: `ptr` came from `alloc` with this layout: placed
                // in a `System` block of `raw_layout`.
                unsafe { System.dealloc(raw_of(ptr), raw_layout) }
            }
            None => {
                if counted(layout) {
                    shrank(layout.size());
                }
                // SAFETY: `System`'s block of this layout.
                unsafe { System.dealloc(ptr, layout) }
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees that `new_size` with the old
        // alignment is a valid layout.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (lined(layout), lined(new_layout)) {
            (false, false) => {
                // SAFETY: `System`'s block of `layout`, and a valid new size.
                let block = unsafe { System.realloc(ptr, layout, new_size) };
                if !block.is_null() {
                    if counted(layout) {
                        shrank(layout.size());
                    }
                    if counted(new_layout) {
                        grew(new_size);
                    }
                }
                block
            }
            (true, true) => {
                let (Some(old_raw), Some(new_raw)) = (raw_layout(layout), raw_layout(new_layout))
                else {
                    return std::ptr::null_mut();
                };
                // SAFETY: `ptr` was placed in a `System` block of
                // `old_raw`; `System.realloc` keeps its first
                // `min(old, new) + EXTRA` bytes, which hold the values at
                // their old offset (below `EXTRA`); they are moved to the
                // new block's offset (`copy`: the ranges may overlap), and
                // `place` writes that offset before them.
                unsafe {
                    let old_offset = ptr as usize - raw_of(ptr) as usize;
                    let raw = System.realloc(raw_of(ptr), old_raw, new_raw.size());
                    if raw.is_null() {
                        return raw;
                    }
                    shrank(layout.size());
                    grew(new_size);
                    replace(raw, old_offset, layout.size().min(new_size))
                }
            }
            // Across `LINED_FROM`: a new block, the values copied, the old
            // one freed.
            // SAFETY: `new_layout` is valid and non-zero; both blocks hold
            // `min(old, new)` bytes and are distinct; `ptr` is this
            // allocator's block of `layout`.
            _ => unsafe {
                let fresh = self.alloc(new_layout);
                if !fresh.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, fresh, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                fresh
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The tests that allocate through `LineAligned`, one at a time: the
    /// counts are the process's.
    static ALLOCATING: Mutex<()> = Mutex::new(());

    /// Blocks of `LINED_FROM` bytes or more start on a line, smaller ones
    /// keep their asked alignment, and growing or shrinking a block across
    /// the threshold (either way) keeps its values and gives the new
    /// size's alignment.
    #[test]
    fn big_blocks_start_on_lines_and_keep_their_values_when_resized() {
        let _alone = ALLOCATING.lock().unwrap_or_else(|e| e.into_inner());
        let alloc = LineAligned;
        let layout = |size: usize| Layout::from_size_align(size, 4).expect("layout");
        for size in [LINED_FROM, LINED_FROM + 4, 1 << 20, 3 << 22] {
            // SAFETY: a non-zero size; freed with the same layout.
            unsafe {
                for zeroed in [false, true] {
                    let ptr = if zeroed {
                        alloc.alloc_zeroed(layout(size))
                    } else {
                        alloc.alloc(layout(size))
                    };
                    assert!(!ptr.is_null());
                    assert_eq!(ptr as usize % LINE, 0, "{size} bytes");
                    if zeroed {
                        let bytes = std::slice::from_raw_parts(ptr, size);
                        assert!(bytes.iter().all(|&b| b == 0), "{size} bytes zeroed");
                    }
                    alloc.dealloc(ptr, layout(size));
                }
            }
        }
        // Resized across the threshold and back, and within it both ways
        // (where `realloc` may move the block and its offset): every value
        // kept.
        let sizes = [
            100,
            LINED_FROM * 3,
            200,
            LINED_FROM - 4,
            LINED_FROM,
            1 << 21,
            LINED_FROM * 2 + 12,
            3 << 20,
            60,
        ];
        let pattern = |i: usize| (i % 251) as u8;
        // SAFETY: each realloc passes the block's current layout and a
        // non-zero size; the bytes read and written lie within the block's
        // current size; the last block is freed with its layout.
        unsafe {
            let mut ptr = alloc.alloc(layout(sizes[0]));
            for pair in sizes.windows(2) {
                let (from, to) = (pair[0], pair[1]);
                for (i, byte) in std::slice::from_raw_parts_mut(ptr, from)
                    .iter_mut()
                    .enumerate()
                {
                    *byte = pattern(i);
                }
                ptr = alloc.realloc(ptr, layout(from), to);
                assert!(!ptr.is_null());
                if to >= LINED_FROM {
                    assert_eq!(ptr as usize % LINE, 0, "{from} -> {to} bytes");
                }
                let bytes = std::slice::from_raw_parts(ptr, from.min(to));
                assert!(
                    bytes.iter().enumerate().all(|(i, &b)| b == pattern(i)),
                    "{from} -> {to} bytes: values kept"
                );
            }
            alloc.dealloc(ptr, layout(*sizes.last().expect("sizes")));
        }
        // Small blocks are `System`'s, with the asked alignment.
        // SAFETY: as above.
        unsafe {
            let small = Layout::from_size_align(48, 32).expect("layout");
            let ptr = alloc.alloc(small);
            assert_eq!(ptr as usize % 32, 0);
            alloc.dealloc(ptr, small);
        }
    }

    /// Every block of `LINED_FROM` bytes or more is counted while it lives,
    /// whatever alignment it asks for (burn's tensors ask for their own),
    /// through `realloc` too; smaller ones are not.
    #[test]
    fn big_blocks_are_counted_whatever_their_alignment() {
        let _alone = ALLOCATING.lock().unwrap_or_else(|e| e.into_inner());
        let alloc = LineAligned;
        let live = || lined_bytes().live;
        for align in [4, LINE, 2 * LINE] {
            let (size, grown) = (1 << 20, 3 << 20);
            let layout = Layout::from_size_align(size, align).expect("layout");
            let before = live();
            // SAFETY: non-zero sizes; each block freed with its layout.
            unsafe {
                let ptr = alloc.alloc(layout);
                assert!(!ptr.is_null());
                assert_eq!(live() - before, size, "align {align}");
                let ptr = alloc.realloc(ptr, layout, grown);
                assert!(!ptr.is_null());
                assert_eq!(live() - before, grown, "align {align}, grown");
                let grown_layout = Layout::from_size_align(grown, align).expect("layout");
                alloc.dealloc(ptr, grown_layout);
                assert_eq!(live(), before, "align {align}, freed");
                let small = Layout::from_size_align(LINED_FROM - 1, align).expect("layout");
                let ptr = alloc.alloc(small);
                assert_eq!(live(), before, "align {align}, small");
                alloc.dealloc(ptr, small);
            }
        }
    }

    /// Values that `realloc` moved with their block, at the offset the
    /// old block had, are moved to the new block's line, whatever both
    /// offsets are (every start of the block against a line, every old
    /// offset there can be): `realloc` itself moves blocks where it likes,
    /// so the move is tested on a buffer standing for the moved block.
    #[test]
    fn moved_values_go_to_the_new_blocks_line() {
        let len = 300;
        let mut buffer = vec![0u8; len + EXTRA + 2 * LINE];
        let base = buffer.as_ptr() as usize;
        let to_line = base.next_multiple_of(LINE) - base;
        for start in 0..LINE {
            for old_offset in OFFSET_BYTES..EXTRA {
                let block = &mut buffer[to_line + start..to_line + start + len + EXTRA];
                block.fill(0xAA);
                for (i, byte) in block[old_offset..old_offset + len].iter_mut().enumerate() {
                    *byte = (i % 253) as u8;
                }
                let raw = block.as_mut_ptr();
                // SAFETY: `block` holds `len + EXTRA` bytes and the values
                // lie `old_offset < EXTRA` bytes in.
                let (placed, found_raw, values) = unsafe {
                    let placed = replace(raw, old_offset, len);
                    let values = std::slice::from_raw_parts(placed, len).to_vec();
                    (placed, raw_of(placed), values)
                };
                assert_eq!(
                    placed as usize % LINE,
                    0,
                    "start {start}, offset {old_offset}"
                );
                assert_eq!(found_raw, raw, "start {start}, offset {old_offset}");
                assert!(
                    values
                        .iter()
                        .enumerate()
                        .all(|(i, &b)| b == (i % 253) as u8),
                    "start {start}, offset {old_offset}: values moved whole"
                );
            }
        }
    }
}

//! The tiled CubeCL attention (FlashAttention-2's scheme, varlen): what
//! runs on a GPU. The per-row kernels (`rows.rs`) are its oracle.
//!
//! - **Blocks.** The batch's rows are cut into blocks of at most
//!   [`BLOCK_ROWS`] rows of one example each (`AttentionRows` makes the
//!   `[NB, 3]` table once per batch from `cu_seqlens`: the block's first
//!   row, its example's start and end). A forward or `dQ` workgroup takes
//!   one block and a set of query heads of one key/value head's group
//!   (`heads_per_workgroup`: the whole group where 256 threads allow);
//!   each of its threads owns one (row of the block, head).
//! - **Forward** (workgroup per query block and set of heads): the
//!   example's keys and values up to the block's last row are staged
//!   through shared memory a tile of `key_rows` rows at a time, once for
//!   the set's heads, every thread of the workgroup cooperating in the
//!   (coalesced) copy; each thread scores its query
//!   against the tile, rescales its accumulator once per tile (online
//!   softmax), and adds the tile's values. Tiles past the block's last row
//!   are never loaded (causal blocks skipped); rows of the last tile past a
//!   thread's own row are masked. It writes the output and the row's
//!   log-sum-exp.
//! - **Backward**: `delta = rowsum(dO * O)` (`rows::delta`); `dQ` as the
//!   forward pass (workgroup per query block and set of heads, keys and values
//!   tiled, probabilities recomputed from the saved log-sum-exp); `dK` and
//!   `dV` with a workgroup per key block and key/value head, each thread
//!   owning one key row, the queries, `dO`, log-sum-exps and `delta` of the
//!   block's example from the block's first row on staged a tile at a
//!   time, over every query head of the group in turn (GQA without
//!   atomics: a key row's gradient is summed by one thread, in a fixed
//!   order).
//! - **Tile size**, comptime per kernel: `key_rows` (at most 64) as large
//!   as the device's shared memory allows for the head size, within 32 KiB
//!   (two `[key_rows, D]` f32 tiles plus two `[key_rows]` vectors): 62 rows
//!   at `D` = 64 and 31 at `D` = 128 with 32 KiB.
//!
//! Global-memory traffic per layer, forward, for an example of `L` rows
//! (f32, `H` heads, `G = H / Hkv`): the per-row kernel reads every
//! earlier key and value once per query row and head, `~ 8 D L^2 / 2 * H`
//! bytes; the tiled one once per block of [`BLOCK_ROWS`] query rows and
//! set of `n` heads, `~ 8 D L^2 / 2 * H / (n BLOCK_ROWS)` bytes, plus `q`
//! and `out` once (`docs/gpu.md` has the figures for SmolLM2's and a 1B
//! shape, `scripts/attention_traffic.py` counts them).
//!
//! # Shapes
//! `q`, `out`, `dq`: `[T, H, D]`; `k`, `v`, `dk`, `dv`: `[T, Hkv, D]`;
//! `lse`, `delta`: `[T, H]`; `blocks`: `[NB, 3]`; all contiguous, f32
//! but for `q`, `k` and `v`, which may be 16-bit (`--bf16` on a GPU:
//! read as such, widened to f32 as they are staged, every sum in f32).

use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

use super::{Saved, rows};
use crate::kernels::attention::BLOCK_ROWS;
use crate::kernels::attention::host::AttentionDims;
use crate::kernels::cube_op::{empty_like, workgroup_index};

/// Shared memory the tiles may take, whatever more the device has: the
/// budget a CUDA kernel gets without opting in to more is 48 KiB, and a
/// smaller tile leaves room for more resident workgroups.
const SHARED_BUDGET: usize = 32 * 1024;

/// This workgroup's block: `(first, start, end)`, its rows `[first, first
/// + BLOCK_ROWS)` of the example `[start, end)`.
#[cube]
fn block_bounds(blocks: &Tensor<f32>) -> (usize, usize, usize) {
    let block = workgroup_index();
    let mut first = 0usize;
    let mut start = 0usize;
    let mut end = 0usize;
    if block * 3 < blocks.len() {
        first = u32::cast_from(blocks[block * 3]) as usize;
        start = u32::cast_from(blocks[block * 3 + 1]) as usize;
        end = u32::cast_from(blocks[block * 3 + 2]) as usize;
    }
    (first, start, end)
}

/// This thread's query row `t`, whether it is one of the example's
/// (`active`), and the keys `[start, stop)` its block sees (up to the
/// block's last row): `(t, active, start, stop)`.
#[cube]
fn query_rows(blocks: &Tensor<f32>) -> (usize, bool, usize, usize) {
    let (first, start, end) = block_bounds(blocks);
    let t = first + UNIT_POS_X as usize;
    let mut stop = first + CUBE_DIM_X as usize;
    if stop > end {
        stop = end;
    }
    (t, t < end, start, stop)
}

/// This thread's query head: the workgroup takes `CUBE_DIM_Y` query heads
/// of one key/value head's group (the `CUBE_POS_Z`-th such set), each
/// thread one of them (`UNIT_POS_Y`) for one query row (`UNIT_POS_X`).
#[cube]
fn query_head() -> usize {
    CUBE_POS_Z as usize * CUBE_DIM_Y as usize + UNIT_POS_Y as usize
}

/// Copies rows `[tile, tile + key_rows)` (those below `stop`) of head
/// `head` of `src` (`[T, heads, D]`, f32 or 16-bit) into `dst`
/// (`[key_rows, D]`, f32), every thread of the workgroup (all its query
/// heads) taking every `CUBE_DIM`-th element.
#[cube]
fn stage<F: Float>(
    src: &Tensor<F>,
    dst: &mut Shared<[f32]>,
    tile: usize,
    stop: usize,
    head: usize,
    #[comptime] heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] key_rows: usize,
) {
    let mut e = UNIT_POS as usize;
    while e < key_rows * head_dim {
        let r = tile + e / head_dim;
        if r < stop {
            dst[e] = f32::cast_from(src[(r * heads + head) * head_dim + e % head_dim]);
        }
        e += CUBE_DIM as usize;
    }
}

#[cube(launch)]
fn forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    blocks: &Tensor<f32>,
    out: &mut Tensor<f32>,
    lse: &mut Tensor<f32>,
    scale: f32,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] key_rows: usize,
    #[define(F)] _dtype: ElemType,
) {
    let (t, active, start, stop) = query_rows(blocks);
    let h = query_head();
    let hk = h / (heads / kv_heads);
    let mut k_tile = Shared::<[f32]>::new_slice(key_rows * head_dim);
    let mut v_tile = Shared::<[f32]>::new_slice(key_rows * head_dim);
    let mut q_row = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let mut scores = Array::<f32>::new(key_rows);
    let q_base = (t * heads + h) * head_dim;
    #[unroll]
    for d in 0..head_dim {
        acc[d] = 0.0;
        q_row[d] = 0.0;
        if active {
            q_row[d] = f32::cast_from(q[q_base + d]);
        }
    }
    // Stands for minus infinity: WGSL refuses an infinite constant.
    let mut m = f32::new(-1.0e30);
    let mut l = 0.0f32;
    let mut tile = start;
    while tile < stop {
        stage(k, &mut k_tile, tile, stop, hk, kv_heads, head_dim, key_rows);
        stage(v, &mut v_tile, tile, stop, hk, kv_heads, head_dim, key_rows);
        sync_cube();
        if active && tile <= t {
            let mut n = t + 1 - tile;
            if n > key_rows {
                n = key_rows;
            }
            let mut tile_max = m;
            for j in 0..n {
                let mut s = 0.0f32;
                #[unroll]
                for d in 0..head_dim {
                    s += q_row[d] * k_tile[j * head_dim + d];
                }
                s *= scale;
                scores[j] = s;
                if s > tile_max {
                    tile_max = s;
                }
            }
            // One rescale per tile, not per key.
            let c = (m - tile_max).exp();
            l *= c;
            #[unroll]
            for d in 0..head_dim {
                acc[d] *= c;
            }
            m = tile_max;
            for j in 0..n {
                let p = (scores[j] - m).exp();
                l += p;
                #[unroll]
                for d in 0..head_dim {
                    acc[d] += p * v_tile[j * head_dim + d];
                }
            }
        }
        sync_cube();
        tile += key_rows;
    }
    if active {
        let inv = 1.0f32 / l;
        #[unroll]
        for d in 0..head_dim {
            out[q_base + d] = acc[d] * inv;
        }
        lse[t * heads + h] = m + l.ln();
    }
}

#[cube(launch)]
fn dq_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    blocks: &Tensor<f32>,
    d_out: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<f32>,
    scale: f32,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] key_rows: usize,
    #[define(F)] _dtype: ElemType,
) {
    let (t, active, start, stop) = query_rows(blocks);
    let h = query_head();
    let hk = h / (heads / kv_heads);
    let mut k_tile = Shared::<[f32]>::new_slice(key_rows * head_dim);
    let mut v_tile = Shared::<[f32]>::new_slice(key_rows * head_dim);
    let mut q_row = Array::<f32>::new(head_dim);
    let mut do_row = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let row = t * heads + h;
    let q_base = row * head_dim;
    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    if active {
        row_lse = lse[row];
        row_delta = delta[row];
    }
    #[unroll]
    for d in 0..head_dim {
        acc[d] = 0.0;
        q_row[d] = 0.0;
        do_row[d] = 0.0;
        if active {
            q_row[d] = f32::cast_from(q[q_base + d]);
            do_row[d] = d_out[q_base + d];
        }
    }
    let mut tile = start;
    while tile < stop {
        stage(k, &mut k_tile, tile, stop, hk, kv_heads, head_dim, key_rows);
        stage(v, &mut v_tile, tile, stop, hk, kv_heads, head_dim, key_rows);
        sync_cube();
        if active && tile <= t {
            let mut n = t + 1 - tile;
            if n > key_rows {
                n = key_rows;
            }
            for j in 0..n {
                let mut s = 0.0f32;
                let mut dp = 0.0f32;
                #[unroll]
                for d in 0..head_dim {
                    s += q_row[d] * k_tile[j * head_dim + d];
                    dp += do_row[d] * v_tile[j * head_dim + d];
                }
                let p = (s * scale - row_lse).exp();
                let ds = p * (dp - row_delta);
                #[unroll]
                for d in 0..head_dim {
                    acc[d] += ds * k_tile[j * head_dim + d];
                }
            }
        }
        sync_cube();
        tile += key_rows;
    }
    if active {
        #[unroll]
        for d in 0..head_dim {
            dq[q_base + d] = acc[d] * scale;
        }
    }
}

#[cube(launch)]
fn dkv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    blocks: &Tensor<f32>,
    d_out: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<f32>,
    dv: &mut Tensor<f32>,
    scale: f32,
    #[comptime] heads: usize,
    #[comptime] kv_heads: usize,
    #[comptime] head_dim: usize,
    #[comptime] key_rows: usize,
    #[define(F)] _dtype: ElemType,
) {
    let (first, _start, end) = block_bounds(blocks);
    let hk = CUBE_POS_Z as usize;
    let group = heads / kv_heads;
    let lane = UNIT_POS_X as usize;
    let j = first + lane;
    let active = j < end;
    let mut q_tile = Shared::<[f32]>::new_slice(key_rows * head_dim);
    let mut do_tile = Shared::<[f32]>::new_slice(key_rows * head_dim);
    let mut lse_tile = Shared::<[f32]>::new_slice(key_rows);
    let mut delta_tile = Shared::<[f32]>::new_slice(key_rows);
    let mut k_row = Array::<f32>::new(head_dim);
    let mut v_row = Array::<f32>::new(head_dim);
    let mut acc_k = Array::<f32>::new(head_dim);
    let mut acc_v = Array::<f32>::new(head_dim);
    let k_base = (j * kv_heads + hk) * head_dim;
    #[unroll]
    for d in 0..head_dim {
        acc_k[d] = 0.0;
        acc_v[d] = 0.0;
        k_row[d] = 0.0;
        v_row[d] = 0.0;
        if active {
            k_row[d] = f32::cast_from(k[k_base + d]);
            v_row[d] = f32::cast_from(v[k_base + d]);
        }
    }
    for g in 0..group {
        let h = hk * group + g;
        // Queries before the block's first row see none of its keys.
        let mut tile = first;
        while tile < end {
            stage(q, &mut q_tile, tile, end, h, heads, head_dim, key_rows);
            stage(d_out, &mut do_tile, tile, end, h, heads, head_dim, key_rows);
            if lane < key_rows && tile + lane < end {
                lse_tile[lane] = lse[(tile + lane) * heads + h];
                delta_tile[lane] = delta[(tile + lane) * heads + h];
            }
            sync_cube();
            if active && tile + key_rows > j {
                let mut n = end - tile;
                if n > key_rows {
                    n = key_rows;
                }
                // Queries of this tile before row `j` do not see it.
                let mut from = 0usize;
                if j > tile {
                    from = j - tile;
                }
                for i in from..n {
                    let mut s = 0.0f32;
                    let mut dp = 0.0f32;
                    #[unroll]
                    for d in 0..head_dim {
                        s += q_tile[i * head_dim + d] * k_row[d];
                        dp += do_tile[i * head_dim + d] * v_row[d];
                    }
                    let p = (s * scale - lse_tile[i]).exp();
                    let ds = p * (dp - delta_tile[i]);
                    #[unroll]
                    for d in 0..head_dim {
                        acc_v[d] += p * do_tile[i * head_dim + d];
                        acc_k[d] += ds * q_tile[i * head_dim + d];
                    }
                }
            }
            sync_cube();
            tile += key_rows;
        }
    }
    if active {
        #[unroll]
        for d in 0..head_dim {
            dk[k_base + d] = acc_k[d] * scale;
            dv[k_base + d] = acc_v[d];
        }
    }
}

/// Rows of a key (or query) tile for `head_dim` on `reference`'s device:
/// two `[rows, D]` tiles and two `[rows]` vectors of f32 within the
/// device's shared memory and [`SHARED_BUDGET`], at most 64, at least 1.
pub(super) fn key_rows(reference: &CubeTensor, head_dim: usize) -> usize {
    let shared = reference
        .client
        .properties()
        .hardware
        .max_shared_memory_size
        .min(SHARED_BUDGET);
    (shared / 4 / (2 * head_dim + 2)).clamp(1, 64)
}

/// At most this many threads in a forward or `dQ` workgroup when it takes
/// several query heads of a group: each thread keeps its query, its
/// accumulator and a tile's scores in registers (~2 `D` + `key_rows`
/// floats), and a register file holds a few such 256-thread workgroups
/// where it would hold no 1,024-thread one.
const GROUP_THREADS: usize = 256;

/// Query heads a forward or `dQ` workgroup takes together (`CUBE_DIM_Y`):
/// with `grouped`, the most of one key/value head's group (a divisor of
/// `H / Hkv`) that [`GROUP_THREADS`] and the device allow, so that a tile
/// of keys and values is staged once for all of them; else 1 (the layout
/// before, each query head staging its group's keys again: the grouped
/// layout's bit-for-bit oracle).
fn heads_per_workgroup(reference: &CubeTensor, dims: AttentionDims, grouped: bool) -> usize {
    let group = (dims.num_heads / dims.num_kv_heads.max(1)).max(1);
    if !grouped {
        return 1;
    }
    let hardware = &reference.client.properties().hardware;
    let threads = (hardware.max_units_per_cube as usize).min(GROUP_THREADS);
    let most = (threads / BLOCK_ROWS).min(hardware.max_cube_dim.1 as usize);
    (1..=group.min(most).max(1))
        .rev()
        .find(|&n| group.is_multiple_of(n))
        .unwrap_or(1)
}

/// The launch grid: a workgroup of [`BLOCK_ROWS`] x `per_workgroup` threads
/// per block and set of `per_workgroup` heads (`heads / per_workgroup`
/// sets on the grid's third dimension; blocks past 65,535 on its second).
fn block_grid(blocks: &CubeTensor, heads: usize, per_workgroup: usize) -> (CubeCount, CubeDim) {
    let count = blocks.meta.shape()[0].max(1);
    let wide = count.min(65_535);
    (
        CubeCount::Static(
            wide as u32,
            count.div_ceil(wide) as u32,
            (heads / per_workgroup).max(1) as u32,
        ),
        CubeDim::new_2d(BLOCK_ROWS as u32, per_workgroup as u32),
    )
}

/// The forward kernel on contiguous inputs: `(out, lse)`; `grouped`: see
/// [`heads_per_workgroup`].
pub(super) fn forward(
    [q, k, v]: [&CubeTensor; 3],
    blocks: &CubeTensor,
    dims: AttentionDims,
    scale: f32,
    grouped: bool,
) -> (CubeTensor, CubeTensor) {
    let tokens = q.meta.shape()[0];
    let out = empty_like(q, vec![tokens, dims.num_heads, dims.head_dim]);
    let lse = empty_like(q, vec![tokens, dims.num_heads]);
    let per_workgroup = heads_per_workgroup(q, dims, grouped);
    let (count, dim) = block_grid(blocks, dims.num_heads, per_workgroup);
    forward_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        blocks.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        scale,
        dims.num_heads,
        dims.num_kv_heads,
        dims.head_dim,
        key_rows(q, dims.head_dim),
        dtype_to_storage_type(q.dtype),
    );
    (out, lse)
}

/// The backward kernels on a contiguous `d_out`: `[dq, dk, dv]` (`dQ` with
/// the forward pass's heads a workgroup).
pub(super) fn backward(saved: &Saved, d_out: CubeTensor, grouped: bool) -> [CubeTensor; 3] {
    let Saved {
        q,
        k,
        v,
        table: blocks,
        out,
        lse,
        dims,
        scale,
        ..
    } = saved;
    let tokens = q.meta.shape()[0];
    let (h, hkv, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    let rows = key_rows(q, d);
    let delta = rows::delta(&d_out, out, *dims);
    let dq = empty_like(q, vec![tokens, h, d]);
    let (count, dim) = block_grid(blocks, h, heads_per_workgroup(q, *dims, grouped));
    dq_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        blocks.clone().into_tensor_arg(),
        d_out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        *scale,
        h,
        hkv,
        d,
        rows,
        dtype_to_storage_type(q.dtype),
    );
    let dk = empty_like(q, vec![tokens, hkv, d]);
    let dv = empty_like(q, vec![tokens, hkv, d]);
    let (count, dim) = block_grid(blocks, hkv, 1);
    dkv_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        blocks.clone().into_tensor_arg(),
        d_out.into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dv.clone().into_tensor_arg(),
        *scale,
        h,
        hkv,
        d,
        rows,
        dtype_to_storage_type(q.dtype),
    );
    [dq, dk, dv]
}

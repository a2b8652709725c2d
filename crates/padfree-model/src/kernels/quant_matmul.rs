//! The frozen linear layer of QLoRA: `y = x W^T` with `W` kept in its GGUF
//! block format (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; F16 and BF16 too), and the
//! input gradient `dx = dy W` of the backward pass, both without an f32 copy
//! of the weights: each weight is dequantised one tile of rows at a time
//! (at most 8 MiB of f32, on rayon's threads), and each tile's product
//! (gemm's SIMD kernels, chosen at run time: AVX-512, AVX2+FMA, or SSE;
//! `kernels/gemm.rs`) is written straight into its columns of `y` (or
//! added into `dx`). No gradient of `W`
//! exists: it is frozen.
//!
//! The oracle beside it is dequantize-then-multiply with burn's matmul
//! (`composed_quant_linear`), tested against the kernel for every block type.
//!
//! # Shapes
//! `N` rows, `C` input width, `O` output width (`W` is `[O, C]`, HF layout).

use super::gemm::{View, Write, product, product_into};
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use crate::tensor::{Tensor, float_tensor, linear};
use crate::weights::quantized::QuantMatrix;

/// f32 values of one dequantised tile: 8 MiB. Small tiles make many small
/// matmuls (measured on SmolLM2-135M QLoRA: 1 MiB tiles, two to four per
/// projection, cost 5% of the step's tokens/s against whole projections);
/// a 7B layer's largest projection (14336 x 4096) is 28 tiles.
const TILE_VALUES: usize = 1 << 21;

/// Rows of one tile: about [`TILE_VALUES`], whole rows, at least 16.
fn tile_rows(w: &QuantMatrix) -> usize {
    let [rows, cols] = w.dims();
    (TILE_VALUES / cols.max(1)).clamp(16, rows.max(16))
}

/// `x W^T` with `W` in blocks: `[N, C] -> [N, O]`, differentiable in `x`
/// (on the CPU; elsewhere the caller holds `W` dequantised).
pub fn quant_linear(x: Tensor<2>, weight: &QuantMatrix) -> Result<Tensor<2>, UnsupportedTensor> {
    apply::<_, 1, 2, 2>(
        QuantLinear {
            weight: weight.clone(),
        },
        [x],
    )
}

/// The oracle: `W` dequantised to f32, then burn's matmul.
pub fn composed_quant_linear(x: Tensor<2>, weight: &QuantMatrix) -> Tensor<2> {
    let w = float_tensor(weight.dequantized(), weight.dims(), &x.device());
    linear(x, &w)
}

#[derive(Debug, Clone)]
struct QuantLinear {
    weight: QuantMatrix,
}

impl HostOp<1> for QuantLinear {
    /// The output is never read by the backward pass (`dx = dy W`): keeping
    /// it would hold `N x O` values per layer for nothing.
    const KEEPS_OUTPUT: bool = false;

    fn forward(&self, [x]: [HostTensor<'_>; 1]) -> HostOutput {
        let n = x.shape[0];
        HostOutput {
            values: forward(&self.weight, x.values, n),
            shape: vec![n, self.weight.dims()[0]],
            saved: Vec::new(),
        }
    }

    fn backward(
        &self,
        [x]: [HostTensor<'_>; 1],
        _output: &[f32],
        _saved: &[f32],
        d_out: &[f32],
        _needed: [bool; 1],
    ) -> [Vec<f32>; 1] {
        [backward(&self.weight, d_out, x.shape[0])]
    }
}

/// `y[N, O] = x[N, C] W^T`, a tile of `W`'s rows at a time, each tile's
/// product written straight into its columns of `y` (`kernels/gemm.rs`).
pub(super) fn forward(w: &QuantMatrix, x: &[f32], n: usize) -> Vec<f32> {
    let [o, c] = w.dims();
    let x = View::row_major(x, n, c);
    let mut tiles = Tiles::new(w);
    if tiles.rows >= o {
        return product(x, tiles.dequantized(0, o).t());
    }
    let mut y = vec![0.0f32; n * o];
    for start in (0..o).step_by(tiles.rows) {
        let rows = tiles.rows.min(o - start);
        product_into(
            &mut y[start..],
            o,
            x,
            tiles.dequantized(start, rows).t(),
            Write::Set,
        );
    }
    y
}

/// `dx[N, C] = dy[N, O] W`, summed over tiles of `W`'s rows in place.
pub(super) fn backward(w: &QuantMatrix, dy: &[f32], n: usize) -> Vec<f32> {
    let [o, c] = w.dims();
    let dy = View::row_major(dy, n, o);
    let mut tiles = Tiles::new(w);
    let mut dx: Option<Vec<f32>> = None;
    for start in (0..o).step_by(tiles.rows) {
        let rows = tiles.rows.min(o - start);
        let (part, w_tile) = (dy.columns(start, rows), tiles.dequantized(start, rows));
        match dx.as_mut() {
            Some(sum) => product_into(sum, c, part, w_tile, Write::Add(1.0)),
            None => dx = Some(product(part, w_tile)),
        }
    }
    dx.unwrap_or_else(|| vec![0.0; n * c])
}

/// One f32 buffer of a tile's size, reused for every tile of a product.
struct Tiles<'w> {
    w: &'w QuantMatrix,
    /// Rows of a tile ([`tile_rows`]).
    rows: usize,
    buffer: Vec<f32>,
}

impl<'w> Tiles<'w> {
    fn new(w: &'w QuantMatrix) -> Self {
        let [o, c] = w.dims();
        let rows = tile_rows(w);
        Self {
            w,
            rows,
            buffer: vec![0.0; rows.min(o) * c],
        }
    }

    /// Rows `start..start + rows` of `W` in f32, `[rows, C]`.
    fn dequantized(&mut self, start: usize, rows: usize) -> View<'_> {
        let c = self.w.dims()[1];
        let values = &mut self.buffer[..rows * c];
        self.w.dequantize_rows(start, rows, values);
        View::row_major(values, rows, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{IntoHostVec, backward as run_backward, cpu_device, grad, trainable};
    use crate::weights::gguf::GgmlType;
    use padfree_pack::SplitMix64;

    /// Random blocks of `ggml_type` with sane scales: f16 scales in
    /// [0.01, 0.03) where the format has them, random quant bytes.
    fn random_blocks(ggml_type: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let (values, bytes) = ggml_type.block();
        let mut rng = SplitMix64::new(seed);
        let mut data = Vec::new();
        for _ in 0..rows * cols / values {
            let mut block: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
            let scale = |rng: &mut SplitMix64| {
                half::f16::from_f32(0.01 + 0.02 * (rng.next_u64() % 1000) as f32 / 1000.0)
                    .to_le_bytes()
            };
            match ggml_type {
                GgmlType::Q4_0 | GgmlType::Q8_0 => block[0..2].copy_from_slice(&scale(&mut rng)),
                GgmlType::Q4_1 | GgmlType::Q4K => {
                    block[0..2].copy_from_slice(&scale(&mut rng));
                    block[2..4].copy_from_slice(&scale(&mut rng));
                }
                GgmlType::Q6K => block[208..210].copy_from_slice(&scale(&mut rng)),
                GgmlType::F16 => block.copy_from_slice(
                    &half::f16::from_f32((rng.standard_normal() * 0.05) as f32).to_le_bytes(),
                ),
                GgmlType::Bf16 => block.copy_from_slice(
                    &half::bf16::from_f32((rng.standard_normal() * 0.05) as f32).to_le_bytes(),
                ),
                GgmlType::F32 => {
                    block.copy_from_slice(&((rng.standard_normal() * 0.05) as f32).to_le_bytes())
                }
            }
            data.extend(block);
        }
        data
    }

    /// Forward and input gradient of the fused kernel against
    /// dequantize-then-multiply, for every block type, with more rows than
    /// one tile (the last one partial). Tolerance: the same f32 products
    /// summed in another order (gemm's blocking vs burn's), 1e-5 of the
    /// largest value.
    #[test]
    fn fused_matches_dequantize_then_multiply_for_every_block_type() {
        let device = cpu_device(true);
        for (ggml_type, cols) in [
            (GgmlType::Q4_0, 96),
            (GgmlType::Q4_1, 96),
            (GgmlType::Q8_0, 96),
            (GgmlType::Q4K, 512),
            (GgmlType::Q6K, 512),
            (GgmlType::F16, 96),
            (GgmlType::Bf16, 96),
        ] {
            // Tiles of 4,096 rows (C = 512): 9,000 rows make three, the last
            // one partial; C = 96 gets one tile (21,845 rows).
            let rows = 9000;
            let w = QuantMatrix::new(
                ggml_type,
                rows,
                cols,
                random_blocks(ggml_type, rows, cols, 3),
            )
            .expect("whole blocks");
            assert!(
                cols == 96 || tile_rows(&w) < rows,
                "{ggml_type:?}: one tile only"
            );
            let n = 7;
            let mut rng = SplitMix64::new(5);
            let x: Vec<f32> = (0..n * cols)
                .map(|_| rng.standard_normal() as f32)
                .collect();
            let dy: Vec<f32> = (0..n * rows)
                .map(|_| rng.standard_normal() as f32)
                .collect();
            let run = |fused: bool| {
                let x = trainable(float_tensor(x.clone(), [n, cols], &device));
                let y = if fused {
                    quant_linear(x.clone(), &w).expect("f32 on the CPU")
                } else {
                    composed_quant_linear(x.clone(), &w)
                };
                let dy = float_tensor(dy.clone(), [n, rows], &device);
                let grads = run_backward(&(y.clone() * dy).sum());
                let dx = grad(&x, &grads).expect("x gradient").into_vec();
                (y.into_vec(), dx)
            };
            let ((y, dx), (y_ref, dx_ref)) = (run(true), run(false));
            for (what, ours, theirs) in [("y", &y, &y_ref), ("dx", &dx, &dx_ref)] {
                let scale = theirs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let diff = ours
                    .iter()
                    .zip(theirs.iter())
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    diff <= 1e-5 * scale && scale > 0.0,
                    "{ggml_type:?} {what}: max diff {diff:e} of scale {scale:e}"
                );
            }
        }
    }

    #[test]
    fn rows_that_are_not_whole_blocks_are_refused() {
        assert!(QuantMatrix::new(GgmlType::Q4_0, 2, 48, vec![0; 2 * 27]).is_none());
        assert!(QuantMatrix::new(GgmlType::Q4_0, 2, 64, vec![0; 2 * 36]).is_some());
        assert!(QuantMatrix::new(GgmlType::Q4_0, 2, 64, vec![0; 2 * 35]).is_none());
    }
}

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
//! Under `--bf16` ([`bf16_quant_linear`]) each tile is dequantised and
//! rounded to bf16 (what bitsandbytes' 4-bit layers do with a bf16 compute
//! dtype), and multiplied by the bf16 gemm (`kernels/gemm_bf16/`) with
//! `x` and `dy` rounded as it reads them; the output is rounded to bf16.
//!
//! The oracle beside it is dequantize-then-multiply with burn's matmul
//! (`composed_quant_linear`; in bf16 `composed_bf16_quant_linear`, the
//! operands rounded first), tested against the kernel for every block type.
//!
//! # Shapes
//! `N` rows, `C` input width, `O` output width (`W` is `[O, C]`, HF layout).

use half::bf16;

use super::bf16::{round_in_place, round_into};
use super::gemm::{View, Write, product, product_into};
use super::gemm_bf16::{self, View16};
use super::host_op::{HostOp, HostOutput, HostTensor, UnsupportedTensor, apply};
use super::linear::round_tensor;
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

/// `x W^T` with `W` in blocks and bf16 operands (`--bf16`): `[N, C] ->
/// [N, O]`, the output rounded to bf16, differentiable in `x`; CPU only.
pub fn bf16_quant_linear(
    x: Tensor<2>,
    weight: &QuantMatrix,
) -> Result<Tensor<2>, UnsupportedTensor> {
    apply::<_, 1, 2, 2>(
        Bf16QuantLinear {
            weight: weight.clone(),
        },
        [x],
    )
}

/// The oracle of [`bf16_quant_linear`]: `W` dequantised to f32, both
/// operands rounded to bf16, burn's f32 matmul, the output rounded.
pub fn composed_bf16_quant_linear(x: Tensor<2>, weight: &QuantMatrix) -> Tensor<2> {
    let w = float_tensor(weight.dequantized(), weight.dims(), &x.device());
    round_tensor(linear(round_tensor(x), &round_tensor(w)))
}

#[derive(Debug, Clone)]
struct QuantLinear {
    weight: QuantMatrix,
}

#[derive(Debug, Clone)]
struct Bf16QuantLinear {
    weight: QuantMatrix,
}

impl HostOp<1> for Bf16QuantLinear {
    /// As [`QuantLinear`]: `dx = dy W` reads neither the output nor `x`.
    const KEEPS_OUTPUT: bool = false;
    const KEEPS_INPUTS: bool = false;

    fn forward(&self, [x]: [HostTensor<'_>; 1]) -> HostOutput {
        let n = x.shape[0];
        let mut values = forward_bf16(&self.weight, x.values, n);
        round_in_place(&mut values);
        HostOutput {
            values,
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
        [backward_bf16(&self.weight, d_out, x.shape[0])]
    }
}

impl HostOp<1> for QuantLinear {
    /// The output is never read by the backward pass (`dx = dy W`): keeping
    /// it would hold `N x O` values per layer for nothing.
    const KEEPS_OUTPUT: bool = false;
    /// Nor is `x` (`W` is frozen: no `dW`). Kept, it held `down_proj`'s
    /// input (SwiGLU's output, `[N, I]`) and the MLP norm's output for
    /// nothing: 300 MiB of a SmolLM2-135M QLoRA step of 8 maths examples
    /// (`PADFREE_MEMORY_TRACE`; docs/benchmarks/2026-12-06-memory-phases.md).
    const KEEPS_INPUTS: bool = false;

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

/// [`forward`] with bf16 operands: `x` rounded as the gemm reads it, each
/// tile of `W` dequantised and rounded to bf16. The output is not rounded.
pub(super) fn forward_bf16(w: &QuantMatrix, x: &[f32], n: usize) -> Vec<f32> {
    let [o, c] = w.dims();
    let x = View16::f32(x, n, c);
    let mut tiles = Tiles::new(w);
    let mut y = vec![0.0f32; n * o];
    for start in (0..o).step_by(tiles.rows) {
        let rows = tiles.rows.min(o - start);
        gemm_bf16::product_into(
            &mut y[start..],
            o,
            x,
            tiles.dequantized16(start, rows).t(),
            Write::Set,
        );
    }
    y
}

/// [`backward`] with bf16 operands: `dy` rounded as read, `W`'s tiles in bf16.
pub(super) fn backward_bf16(w: &QuantMatrix, dy: &[f32], n: usize) -> Vec<f32> {
    let [o, c] = w.dims();
    let dy = View16::f32(dy, n, o);
    let mut tiles = Tiles::new(w);
    let mut dx = vec![0.0f32; n * c];
    for start in (0..o).step_by(tiles.rows) {
        let rows = tiles.rows.min(o - start);
        let write = if start == 0 {
            Write::Set
        } else {
            Write::Add(1.0)
        };
        let part = dy.columns(start, rows);
        gemm_bf16::product_into(&mut dx, c, part, tiles.dequantized16(start, rows), write);
    }
    dx
}

/// One f32 buffer of a tile's size, reused for every tile of a product
/// (and its bf16 twin under `--bf16`).
struct Tiles<'w> {
    w: &'w QuantMatrix,
    /// Rows of a tile ([`tile_rows`]).
    rows: usize,
    buffer: Vec<f32>,
    buffer16: Vec<bf16>,
}

impl<'w> Tiles<'w> {
    fn new(w: &'w QuantMatrix) -> Self {
        let [o, c] = w.dims();
        let rows = tile_rows(w);
        Self {
            w,
            rows,
            buffer: vec![0.0; rows.min(o) * c],
            buffer16: Vec::new(),
        }
    }

    /// Rows `start..start + rows` of `W` dequantised and rounded to bf16.
    fn dequantized16(&mut self, start: usize, rows: usize) -> View16<'_> {
        let c = self.w.dims()[1];
        let len = self.buffer.len();
        self.buffer16.resize(len, bf16::ZERO);
        let values = &mut self.buffer[..rows * c];
        self.w.dequantize_rows(start, rows, values);
        let values16 = &mut self.buffer16[..rows * c];
        round_into(values, values16);
        View16::bf16(values16, rows, c)
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

    /// A frozen layer's backward pass reads neither its input nor its
    /// output, so neither op keeps them for it: kept, the f32 op held
    /// SwiGLU's output for `down_proj` and the MLP norm's output for
    /// nothing (a fifth of a QLoRA step's peak). The gradient tests below
    /// run on the inputs the graph hands back, empty where not kept.
    #[test]
    fn frozen_layers_keep_neither_input_nor_output() {
        const {
            assert!(!QuantLinear::KEEPS_INPUTS && !QuantLinear::KEEPS_OUTPUT);
            assert!(!Bf16QuantLinear::KEEPS_INPUTS && !Bf16QuantLinear::KEEPS_OUTPUT);
        };
    }

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

    /// One block type's case: a `[9000, C]` weight in its blocks (tiles of
    /// 4,096 rows at C = 512: three, the last one partial; C = 96 gets one
    /// tile of 21,845 rows), `x` `[7, C]` and `dy` `[7, 9000]` (each `dy`
    /// value through `dy_value`).
    struct Case {
        ggml_type: GgmlType,
        w: QuantMatrix,
        x: Vec<f32>,
        dy: Vec<f32>,
    }

    const ROWS: usize = 9000;
    const N: usize = 7;

    fn cases(dy_value: fn(f32) -> f32) -> Vec<Case> {
        [
            (GgmlType::Q4_0, 96),
            (GgmlType::Q4_1, 96),
            (GgmlType::Q8_0, 96),
            (GgmlType::Q4K, 512),
            (GgmlType::Q6K, 512),
            (GgmlType::F16, 96),
            (GgmlType::Bf16, 96),
        ]
        .into_iter()
        .map(|(ggml_type, cols)| {
            let blocks = random_blocks(ggml_type, ROWS, cols, 3);
            let w = QuantMatrix::new(ggml_type, ROWS, cols, blocks).expect("whole blocks");
            let mut rng = SplitMix64::new(5);
            let x = (0..N * cols)
                .map(|_| rng.standard_normal() as f32)
                .collect();
            let dy = (0..N * ROWS)
                .map(|_| dy_value(rng.standard_normal() as f32))
                .collect();
            Case {
                ggml_type,
                w,
                x,
                dy,
            }
        })
        .collect()
    }

    /// `y = op(x, W)` and `dx` of `sum(y * dy)`.
    fn run(case: &Case, op: impl Fn(Tensor<2>, &QuantMatrix) -> Tensor<2>) -> (Vec<f32>, Vec<f32>) {
        let device = cpu_device(true);
        let cols = case.w.dims()[1];
        let x = trainable(float_tensor(case.x.clone(), [N, cols], &device));
        let y = op(x.clone(), &case.w);
        let dy = float_tensor(case.dy.clone(), [N, ROWS], &device);
        let grads = run_backward(&(y.clone() * dy).sum());
        let dx = grad(&x, &grads).expect("x gradient").into_vec();
        (y.into_vec(), dx)
    }

    /// Forward and input gradient of the fused kernel against
    /// dequantize-then-multiply, for every block type, with more rows than
    /// one tile (the last one partial). Tolerance: the same f32 products
    /// summed in another order (gemm's blocking vs burn's), 1e-5 of the
    /// largest value.
    #[test]
    fn fused_matches_dequantize_then_multiply_for_every_block_type() {
        use crate::kernels::test_util::assert_within;
        for case in cases(|v| v) {
            let ggml_type = case.ggml_type;
            assert!(
                case.w.dims()[1] == 96 || tile_rows(&case.w) < ROWS,
                "{ggml_type:?}: one tile only"
            );
            let (y, dx) = run(&case, |x, w| quant_linear(x, w).expect("f32 on the CPU"));
            let (y_ref, dx_ref) = run(&case, composed_quant_linear);
            assert_within(&format!("{ggml_type:?} y"), &y, &y_ref, 1e-5);
            assert_within(&format!("{ggml_type:?} dx"), &dx, &dx_ref, 1e-5);
        }
    }

    /// The bf16 kernel against its oracle (dequantised, both operands
    /// rounded, burn's f32 matmul, output rounded), for every block type,
    /// with several tiles, `dy` rounded beforehand as the kernel rounds it.
    /// `dx` sums the same exact products in another order: 1e-5 of the
    /// largest value, as the f32 kernel's test. `y` is rounded in both:
    /// equal but where a sum straddles a rounding tie (one bf16 step, 1e-2,
    /// and at least 99% of the values equal). And rounding must show
    /// against the f32 kernel.
    #[test]
    fn bf16_kernel_matches_its_rounded_oracle_for_every_block_type() {
        use crate::kernels::bf16::rounded;
        use crate::kernels::test_util::assert_within;
        for case in cases(rounded) {
            let ggml_type = case.ggml_type;
            let (y, dx) = run(&case, |x, w| bf16_quant_linear(x, w).expect("CPU"));
            let (y_ref, dx_ref) = run(&case, composed_bf16_quant_linear);
            let (y32, _) = run(&case, |x, w| quant_linear(x, w).expect("CPU"));
            assert_within(&format!("{ggml_type:?} bf16 y"), &y, &y_ref, 1e-2);
            let exact = y.iter().zip(&y_ref).filter(|(a, b)| a == b).count();
            assert!(
                exact * 100 >= 99 * y.len(),
                "{ggml_type:?} bf16 y: {exact} of {} equal",
                y.len()
            );
            assert_within(&format!("{ggml_type:?} bf16 dx"), &dx, &dx_ref, 1e-5);
            assert_ne!(y, y32, "{ggml_type:?}: rounding must show");
        }
    }

    #[test]
    fn rows_that_are_not_whole_blocks_are_refused() {
        assert!(QuantMatrix::new(GgmlType::Q4_0, 2, 48, vec![0; 2 * 27]).is_none());
        assert!(QuantMatrix::new(GgmlType::Q4_0, 2, 64, vec![0; 2 * 36]).is_some());
        assert!(QuantMatrix::new(GgmlType::Q4_0, 2, 64, vec![0; 2 * 35]).is_none());
    }
}

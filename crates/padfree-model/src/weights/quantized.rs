//! A frozen weight kept in its GGUF blocks (QLoRA's base): the bytes of
//! whole rows, dequantised on demand (a tile of rows by the fused kernel,
//! `kernels/quant_matmul.rs`; the whole matrix for merging, saving and
//! devices without that kernel).

use std::sync::Arc;

use rayon::prelude::*;

use super::gguf::{GgmlType, dequantize, dequantize_into};

/// A frozen `[O, C]` weight in GGUF blocks, rows in HF order.
#[derive(Clone)]
pub struct QuantMatrix {
    ggml_type: GgmlType,
    rows: usize,
    cols: usize,
    /// `rows` rows of whole blocks, row-major.
    data: Arc<Vec<u8>>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QuantMatrix({:?}, [{}, {}])",
            self.ggml_type, self.rows, self.cols
        )
    }
}

impl QuantMatrix {
    /// `rows` rows of `cols` values of `ggml_type`; `None` when a row is not
    /// whole blocks or `data` is not `rows` rows.
    pub fn new(ggml_type: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Option<Self> {
        let (block_values, block_bytes) = ggml_type.block();
        (cols.is_multiple_of(block_values)
            && data.len() == rows * cols / block_values * block_bytes)
            .then(|| Self {
                ggml_type,
                rows,
                cols,
                data: Arc::new(data),
            })
    }

    /// `[O, C]`.
    pub fn dims(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// The storage type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn row_bytes(&self) -> usize {
        let (block_values, block_bytes) = self.ggml_type.block();
        self.cols / block_values * block_bytes
    }

    /// Rows `start..start + count` as f32, into `out` (`count * C` values).
    /// On rayon's threads, a few rows each.
    pub(crate) fn dequantize_rows(&self, start: usize, count: usize, out: &mut [f32]) {
        let row_bytes = self.row_bytes();
        let data = &self.data[start * row_bytes..(start + count) * row_bytes];
        let rows_per_task = 8;
        out[..count * self.cols]
            .par_chunks_mut(rows_per_task * self.cols)
            .zip(data.par_chunks(rows_per_task * row_bytes))
            .for_each(|(out, data)| dequantize_into(self.ggml_type, data, out));
    }

    /// Every value as f32, row-major: for the oracle, for merging an adapter
    /// into its layer, and for devices without the fused kernel.
    pub fn dequantized(&self) -> Vec<f32> {
        dequantize(self.ggml_type, &self.data)
    }
}

use crate::font::{GLYPH_HEIGHT, GLYPH_WIDTH, glyph};

/// An RGB colour.
pub(crate) type Rgb = [u8; 3];

/// An RGB image in memory.
pub(crate) struct Canvas {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    pub(crate) fn new(width: usize, height: usize, background: Rgb) -> Self {
        let pixels = background
            .iter()
            .copied()
            .cycle()
            .take(width * height * 3)
            .collect();
        Self {
            width,
            height,
            pixels,
        }
    }

    fn set(&mut self, x: i64, y: i64, color: Rgb) {
        if x < 0 || y < 0 || x as usize >= self.width || y as usize >= self.height {
            return;
        }
        let at = (y as usize * self.width + x as usize) * 3;
        self.pixels[at..at + 3].copy_from_slice(&color);
    }

    pub(crate) fn fill_rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, color: Rgb) {
        for y in y0.min(y1)..=y0.max(y1) {
            for x in x0.min(x1)..=x0.max(x1) {
                self.set(x, y, color);
            }
        }
    }

    /// A line `thickness` pixels wide (Bresenham with a square pen).
    pub(crate) fn line(&mut self, from: (i64, i64), to: (i64, i64), thickness: i64, color: Rgb) {
        let (mut x, mut y) = from;
        let dx = (to.0 - x).abs();
        let dy = -(to.1 - y).abs();
        let sx = if x < to.0 { 1 } else { -1 };
        let sy = if y < to.1 { 1 } else { -1 };
        let mut err = dx + dy;
        let half = thickness / 2;
        loop {
            self.fill_rect(
                x - half,
                y - half,
                x - half + thickness - 1,
                y - half + thickness - 1,
                color,
            );
            if (x, y) == to {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Width in pixels of `text` at `scale`.
    pub(crate) fn text_width(text: &str, scale: i64) -> i64 {
        text.chars().count() as i64 * (GLYPH_WIDTH as i64 + 1) * scale
    }

    /// Text with its top-left corner at `(x, y)`.
    pub(crate) fn text(&mut self, x: i64, y: i64, text: &str, scale: i64, color: Rgb) {
        for (i, c) in text.chars().enumerate() {
            let left = x + i as i64 * (GLYPH_WIDTH as i64 + 1) * scale;
            for (row, bits) in glyph(c).iter().enumerate() {
                for col in 0..GLYPH_WIDTH {
                    if bits & (1 << (GLYPH_WIDTH - 1 - col)) != 0 {
                        let px = left + col as i64 * scale;
                        let py = y + row as i64 * scale;
                        self.fill_rect(px, py, px + scale - 1, py + scale - 1, color);
                    }
                }
            }
        }
    }

    /// Text rotated a quarter turn anticlockwise, reading bottom to top,
    /// with its bottom-left corner at `(x, y)`.
    pub(crate) fn text_vertical(&mut self, x: i64, y: i64, text: &str, scale: i64, color: Rgb) {
        for (i, c) in text.chars().enumerate() {
            let bottom = y - i as i64 * (GLYPH_WIDTH as i64 + 1) * scale;
            for (row, bits) in glyph(c).iter().enumerate() {
                for col in 0..GLYPH_WIDTH {
                    if bits & (1 << (GLYPH_WIDTH - 1 - col)) != 0 {
                        let px = x + row as i64 * scale;
                        let py = bottom - col as i64 * scale;
                        self.fill_rect(px, py - scale + 1, px + scale - 1, py, color);
                    }
                }
            }
        }
    }

    /// PNG bytes of the image.
    pub(crate) fn encode_png(&self) -> Result<Vec<u8>, String> {
        let mut bytes = Vec::new();
        let mut encoder = png::Encoder::new(&mut bytes, self.width as u32, self.height as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
        writer
            .write_image_data(&self.pixels)
            .map_err(|e| e.to_string())?;
        writer.finish().map_err(|e| e.to_string())?;
        Ok(bytes)
    }
}

pub(crate) const GLYPH_PIXELS: i64 = GLYPH_HEIGHT as i64;

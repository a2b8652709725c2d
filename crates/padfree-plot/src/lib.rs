//! # padfree-plot
//!
//! Line and bar charts written as PNG, drawn on an RGB canvas with a built-in
//! 5x7 pixel font, so a plot needs no system font and no C library.

mod canvas;
mod chart;
mod font;

pub use chart::{Bar, Series, bar_chart_png, line_chart_png};

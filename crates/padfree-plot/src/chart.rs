use crate::canvas::{Canvas, GLYPH_PIXELS, Rgb};

const WIDTH: usize = 960;
const HEIGHT: usize = 600;
const MARGIN_LEFT: i64 = 110;
const MARGIN_RIGHT: i64 = 30;
const MARGIN_TOP: i64 = 60;
const MARGIN_BOTTOM: i64 = 80;
const WHITE: Rgb = [255, 255, 255];
const BLACK: Rgb = [20, 20, 20];
const GRID: Rgb = [225, 225, 225];
const PALETTE: [Rgb; 6] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
];

/// One line of a line chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Shown in the legend.
    pub label: String,
    /// `(x, y)` points in drawing order; non-finite points are skipped.
    pub points: Vec<(f64, f64)>,
}

/// One bar of a bar chart.
#[derive(Debug, Clone)]
pub struct Bar {
    /// Written under the bar.
    pub label: String,
    /// Its height; written above the bar.
    pub value: f64,
}

/// A line chart as PNG bytes.
pub fn line_chart_png(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<Vec<u8>, String> {
    let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let points: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().filter(finite).copied())
        .collect();
    if points.is_empty() {
        return Err("nothing to plot: no finite point".into());
    }
    let (x_min, x_max) = range(points.iter().map(|p| p.0));
    let (y_min, y_max) = range(points.iter().map(|p| p.1));
    let x_axis = Axis::nice(x_min, x_max);
    let y_axis = Axis::nice(y_min, y_max);
    let mut canvas = frame(title, x_label, y_label);
    let plot = PlotArea::new();
    for tick in x_axis.ticks() {
        let x = plot.x(x_axis.fraction(tick));
        canvas.line((x, plot.top), (x, plot.bottom), 1, GRID);
        let label = format_tick(tick, x_axis.step);
        canvas.text(
            x - Canvas::text_width(&label, 2) / 2,
            plot.bottom + 10,
            &label,
            2,
            BLACK,
        );
    }
    draw_y_ticks(&mut canvas, &plot, &y_axis);
    draw_axes(&mut canvas, &plot);
    for (index, s) in series.iter().enumerate() {
        let color = PALETTE[index % PALETTE.len()];
        let pixels: Vec<(i64, i64)> = s
            .points
            .iter()
            .filter(finite)
            .map(|&(x, y)| (plot.x(x_axis.fraction(x)), plot.y(y_axis.fraction(y))))
            .collect();
        for pair in pixels.windows(2) {
            canvas.line(pair[0], pair[1], 3, color);
        }
        if let [only] = pixels.as_slice() {
            canvas.fill_rect(only.0 - 5, only.1 - 5, only.0 + 5, only.1 + 5, color);
        }
        let legend_y = plot.top + 10 + index as i64 * 22;
        let legend_x = plot.right - 10 - Canvas::text_width(&s.label, 2) - 30;
        canvas.fill_rect(legend_x, legend_y + 5, legend_x + 20, legend_y + 8, color);
        canvas.text(legend_x + 28, legend_y, &s.label, 2, BLACK);
    }
    canvas.encode_png()
}

/// A bar chart as PNG bytes, bars from zero.
pub fn bar_chart_png(title: &str, y_label: &str, bars: &[Bar]) -> Result<Vec<u8>, String> {
    if bars.is_empty() || bars.iter().any(|b| !b.value.is_finite()) {
        return Err("nothing to plot: no bar, or a bar that is not a finite number".into());
    }
    let (_, top) = range(bars.iter().map(|b| b.value));
    let y_axis = Axis::nice(0.0, top.max(0.0));
    let mut canvas = frame(title, "", y_label);
    let plot = PlotArea::new();
    draw_y_ticks(&mut canvas, &plot, &y_axis);
    let slot = (plot.right - plot.left) / bars.len() as i64;
    for (index, bar) in bars.iter().enumerate() {
        let color = PALETTE[index % PALETTE.len()];
        let left = plot.left + index as i64 * slot + slot / 6;
        let right = plot.left + (index as i64 + 1) * slot - slot / 6;
        let y = plot.y(y_axis.fraction(bar.value.max(0.0)));
        canvas.fill_rect(left, y, right, plot.bottom, color);
        let value = format_value(bar.value);
        let centre = (left + right) / 2;
        canvas.text(
            centre - Canvas::text_width(&value, 2) / 2,
            y - 22,
            &value,
            2,
            BLACK,
        );
        canvas.text(
            centre - Canvas::text_width(&bar.label, 2) / 2,
            plot.bottom + 10,
            &bar.label,
            2,
            BLACK,
        );
    }
    draw_axes(&mut canvas, &plot);
    canvas.encode_png()
}

fn frame(title: &str, x_label: &str, y_label: &str) -> Canvas {
    let mut canvas = Canvas::new(WIDTH, HEIGHT, WHITE);
    let width = WIDTH as i64;
    let height = HEIGHT as i64;
    canvas.text(
        (width - Canvas::text_width(title, 3)) / 2,
        16,
        title,
        3,
        BLACK,
    );
    let plot_centre = MARGIN_LEFT + (width - MARGIN_LEFT - MARGIN_RIGHT) / 2;
    canvas.text(
        plot_centre - Canvas::text_width(x_label, 2) / 2,
        height - 34,
        x_label,
        2,
        BLACK,
    );
    let plot_middle = MARGIN_TOP + (height - MARGIN_TOP - MARGIN_BOTTOM) / 2;
    canvas.text_vertical(
        12,
        plot_middle + Canvas::text_width(y_label, 2) / 2,
        y_label,
        2,
        BLACK,
    );
    canvas
}

fn draw_y_ticks(canvas: &mut Canvas, plot: &PlotArea, axis: &Axis) {
    for tick in axis.ticks() {
        let y = plot.y(axis.fraction(tick));
        canvas.line((plot.left, y), (plot.right, y), 1, GRID);
        let label = format_tick(tick, axis.step);
        let x = plot.left - 8 - Canvas::text_width(&label, 2);
        canvas.text(x, y - GLYPH_PIXELS, &label, 2, BLACK);
    }
}

fn draw_axes(canvas: &mut Canvas, plot: &PlotArea) {
    canvas.line(
        (plot.left, plot.bottom),
        (plot.right, plot.bottom),
        2,
        BLACK,
    );
    canvas.line((plot.left, plot.top), (plot.left, plot.bottom), 2, BLACK);
}

struct PlotArea {
    left: i64,
    right: i64,
    top: i64,
    bottom: i64,
}

impl PlotArea {
    fn new() -> Self {
        Self {
            left: MARGIN_LEFT,
            right: WIDTH as i64 - MARGIN_RIGHT,
            top: MARGIN_TOP,
            bottom: HEIGHT as i64 - MARGIN_BOTTOM,
        }
    }

    fn x(&self, fraction: f64) -> i64 {
        self.left + (fraction * (self.right - self.left) as f64).round() as i64
    }

    fn y(&self, fraction: f64) -> i64 {
        self.bottom - (fraction * (self.bottom - self.top) as f64).round() as i64
    }
}

/// An axis from `min` to `max` with ticks every `step`, all round numbers.
struct Axis {
    min: f64,
    max: f64,
    step: f64,
}

impl Axis {
    /// About five ticks at 1, 2 or 5 times a power of ten, covering the data.
    fn nice(low: f64, high: f64) -> Self {
        let (low, high) = if high > low {
            (low, high)
        } else {
            (low - 0.5, high + 0.5)
        };
        let rough = (high - low) / 5.0;
        let magnitude = 10f64.powf(rough.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * magnitude)
            .find(|s| *s >= rough)
            .unwrap_or(10.0 * magnitude);
        Self {
            min: (low / step).floor() * step,
            max: (high / step).ceil() * step,
            step,
        }
    }

    fn ticks(&self) -> Vec<f64> {
        let count = ((self.max - self.min) / self.step).round() as usize;
        (0..=count)
            .map(|i| self.min + i as f64 * self.step)
            .collect()
    }

    fn fraction(&self, value: f64) -> f64 {
        (value - self.min) / (self.max - self.min)
    }
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

/// As many decimals as the tick step needs.
fn format_tick(value: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{value:.decimals$}")
}

fn format_value(value: f64) -> String {
    if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_axes_cover_the_data_with_round_steps() {
        let axis = Axis::nice(2.37, 9.81);
        assert_eq!(axis.step, 2.0);
        assert!(axis.min <= 2.37 && axis.max >= 9.81);
        assert_eq!(axis.ticks(), vec![2.0, 4.0, 6.0, 8.0, 10.0]);
        let flat = Axis::nice(3.0, 3.0);
        assert!(flat.min < 3.0 && flat.max > 3.0);
    }

    #[test]
    fn charts_encode_as_png_of_the_canvas_size() {
        let series = [Series {
            label: "loss".into(),
            points: vec![(1.0, 9.0), (2.0, 7.5), (3.0, f64::NAN), (4.0, 6.0)],
        }];
        let png_bytes = line_chart_png("training loss", "step", "loss", &series).expect("plots");
        let decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
        let reader = decoder.read_info().expect("a PNG");
        assert_eq!(
            (reader.info().width, reader.info().height),
            (WIDTH as u32, HEIGHT as u32)
        );
        let bars = [
            Bar {
                label: "padded".into(),
                value: 627.0,
            },
            Bar {
                label: "varlen".into(),
                value: 1062.0,
            },
        ];
        assert!(bar_chart_png("tokens/s", "tokens/s", &bars).is_ok());
        assert!(line_chart_png("empty", "", "", &[]).is_err());
    }
}

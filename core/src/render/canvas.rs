//! A minimal RGB raster with clipped drawing and PNG output.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use anyhow::{Context, Result};

use super::font::{glyph, GLYPH_H, GLYPH_W};

pub(crate) type Rgb = [u8; 3];

pub(crate) struct Canvas {
    pub(crate) width: usize,
    pub(crate) height: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    pub(crate) fn new(width: usize, height: usize, bg: Rgb) -> Self {
        let width = width.max(1);
        let height = height.max(1);
        let mut pixels = Vec::with_capacity(width * height * 3);
        for _ in 0..width * height {
            pixels.extend_from_slice(&bg);
        }
        Canvas {
            width,
            height,
            pixels,
        }
    }

    pub(crate) fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < self.width && (y as usize) < self.height {
            let i = (y as usize * self.width + x as usize) * 3;
            self.pixels[i..i + 3].copy_from_slice(&c);
        }
    }

    #[cfg(test)]
    pub(crate) fn get(&self, x: usize, y: usize) -> Rgb {
        let i = (y * self.width + x) * 3;
        [self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]]
    }

    /// Fills the rectangle [x0, x1) x [y0, y1), clipped to the canvas.
    pub(crate) fn fill(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        let cx0 = x0.clamp(0, self.width as i64) as usize;
        let cx1 = x1.clamp(0, self.width as i64) as usize;
        let cy0 = y0.clamp(0, self.height as i64) as usize;
        let cy1 = y1.clamp(0, self.height as i64) as usize;
        for y in cy0..cy1 {
            let row = y * self.width;
            for x in cx0..cx1 {
                let i = (row + x) * 3;
                self.pixels[i..i + 3].copy_from_slice(&c);
            }
        }
    }

    pub(crate) fn hline(&mut self, x0: i64, x1: i64, y: i64, c: Rgb) {
        self.fill(x0, y, x1, y + 1, c);
    }

    pub(crate) fn vline(&mut self, x: i64, y0: i64, y1: i64, c: Rgb) {
        self.fill(x, y0, x + 1, y1, c);
    }

    /// Outline of the rectangle [x0, x1) x [y0, y1).
    pub(crate) fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        self.hline(x0, x1, y0, c);
        self.hline(x0, x1, y1 - 1, c);
        self.vline(x0, y0, y1, c);
        self.vline(x1 - 1, y0, y1, c);
    }

    /// A line `thick` pixels wide (1 or 2 useful), clipped to
    /// `clip` = (x0, y0, x1, y1). Coordinates may be far outside the canvas.
    pub(crate) fn line(
        &mut self,
        (xa, ya): (f64, f64),
        (xb, yb): (f64, f64),
        thick: i64,
        clip: (i64, i64, i64, i64),
        c: Rgb,
    ) {
        if ![xa, ya, xb, yb].iter().all(|v| v.is_finite()) {
            return;
        }
        // Clip the segment to the box (Liang-Barsky) before stepping, so
        // that far-away end points cost nothing.
        let (cx0, cy0, cx1, cy1) = (
            clip.0 as f64,
            clip.1 as f64,
            (clip.2 - 1) as f64,
            (clip.3 - 1) as f64,
        );
        let (dx, dy) = (xb - xa, yb - ya);
        let mut t0 = 0.0f64;
        let mut t1 = 1.0f64;
        for (p, q) in [
            (-dx, xa - cx0),
            (dx, cx1 - xa),
            (-dy, ya - cy0),
            (dy, cy1 - ya),
        ] {
            if p == 0.0 {
                if q < 0.0 {
                    return;
                }
            } else {
                let r = q / p;
                if p < 0.0 {
                    t0 = t0.max(r);
                } else {
                    t1 = t1.min(r);
                }
            }
        }
        if t0 > t1 {
            return;
        }
        let (x0, y0) = (xa + t0 * dx, ya + t0 * dy);
        let (x1, y1) = (xa + t1 * dx, ya + t1 * dy);
        let steps = (x1 - x0).abs().max((y1 - y0).abs()).ceil().max(1.0) as i64;
        let steep = (y1 - y0).abs() > (x1 - x0).abs();
        for i in 0..=steps {
            let t = i as f64 / steps as f64;
            let x = (x0 + t * (x1 - x0)).round() as i64;
            let y = (y0 + t * (y1 - y0)).round() as i64;
            for k in 0..thick.max(1) {
                let (px, py) = if steep { (x + k, y) } else { (x, y + k) };
                if px >= clip.0 && px < clip.2 && py >= clip.1 && py < clip.3 {
                    self.set(px, py, c);
                }
            }
        }
    }

    /// Draws `text` with its top-left corner at (x, y).
    pub(crate) fn text(&mut self, x: i64, y: i64, text: &str, scale: usize, c: Rgb) {
        let s = scale.max(1) as i64;
        for (i, ch) in text.chars().enumerate() {
            let gx = x + i as i64 * (GLYPH_W as i64 + 1) * s;
            if gx >= self.width as i64 {
                break;
            }
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..GLYPH_W {
                    if bits & (0x10 >> col) != 0 {
                        let px = gx + col as i64 * s;
                        let py = y + row as i64 * s;
                        self.fill(px, py, px + s, py + s, c);
                    }
                }
            }
        }
    }

    /// Draws `text` turned 90 degrees anticlockwise (reading upwards), its
    /// glyphs' tops facing left; (x, y) is the bottom-left of the run.
    pub(crate) fn text_up(&mut self, x: i64, y: i64, text: &str, scale: usize, c: Rgb) {
        let s = scale.max(1) as i64;
        for (i, ch) in text.chars().enumerate() {
            let gy = y - i as i64 * (GLYPH_W as i64 + 1) * s;
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..GLYPH_W {
                    if bits & (0x10 >> col) != 0 {
                        let px = x + row as i64 * s;
                        let py = gy - (col as i64 + 1) * s;
                        self.fill(px, py, px + s, py + s, c);
                    }
                }
            }
        }
    }

    pub(crate) fn write_png(&self, out: &Path) -> Result<()> {
        let ctx = || format!("cannot write PNG {}", out.display());
        crate::util::write_via_temp(out, |tmp| {
            let file = File::create(tmp).with_context(ctx)?;
            let mut enc =
                png::Encoder::new(BufWriter::new(file), self.width as u32, self.height as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut w = enc.write_header().with_context(ctx)?;
            w.write_image_data(&self.pixels).with_context(ctx)?;
            w.finish().with_context(ctx)?;
            Ok(())
        })
    }
}

/// Height in pixels of one line of text at `scale`.
pub(crate) fn text_height(scale: usize) -> usize {
    GLYPH_H * scale.max(1)
}

/// `c` scaled towards black by `f` in 0..=1.
pub(crate) fn shade(c: Rgb, f: f64) -> Rgb {
    let f = if f.is_finite() {
        f.clamp(0.0, 1.0)
    } else {
        1.0
    };
    [
        (c[0] as f64 * f).round() as u8,
        (c[1] as f64 * f).round() as u8,
        (c[2] as f64 * f).round() as u8,
    ]
}

/// A colour from hue (0..1), saturation and value.
pub(crate) fn hsv(h: f64, s: f64, v: f64) -> Rgb {
    let h = (h.rem_euclid(1.0)) * 6.0;
    let i = h.floor() as i64;
    let f = h - i as f64;
    let (p, q, t) = (v * (1.0 - s), v * (1.0 - s * f), v * (1.0 - s * (1.0 - f)));
    let (r, g, b) = match i {
        0 => (v, t, p),
        1 => (q, v, p),
        2 => (p, v, t),
        3 => (p, q, v),
        4 => (t, p, v),
        _ => (v, p, q),
    };
    [
        (r * 255.0).round() as u8,
        (g * 255.0).round() as u8,
        (b * 255.0).round() as u8,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawing_clips_and_text_marks_pixels() {
        let mut c = Canvas::new(20, 10, [0, 0, 0]);
        c.fill(-5, -5, 100, 3, [255, 0, 0]);
        assert_eq!(c.get(19, 2), [255, 0, 0]);
        assert_eq!(c.get(0, 3), [0, 0, 0]);
        c.line((-1e6, 5.0), (1e6, 5.0), 1, (0, 0, 20, 10), [0, 255, 0]);
        assert_eq!(c.get(10, 5), [0, 255, 0]);
        c.line((f64::NAN, 0.0), (1.0, 1.0), 1, (0, 0, 20, 10), [1, 1, 1]);
        c.text(0, 3, "8", 1, [9, 9, 9]);
        assert_eq!(c.get(1, 3), [9, 9, 9]);
        c.text_up(0, 9, "I", 1, [7, 7, 7]);
        c.text(1000, 1000, "far away", 3, [1, 2, 3]);
        assert_eq!(hsv(0.0, 1.0, 1.0), [255, 0, 0]);
    }
}

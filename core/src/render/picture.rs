//! Drawing a picture with plotters into memory and saving it as PNG, and the
//! colour arithmetic the pictures share.
//!
//! Invariants: the pixel buffer is 8-bit RGB, row-major, exactly
//! `width * height * 3` bytes, and both sides are at least 1 pixel; the file
//! is written through a temporary next to it (`util::write_via_temp`), so a
//! failed picture never leaves half a PNG behind, and every error names the
//! file.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::font::ensure_font;

/// An 8-bit RGB colour.
pub(crate) type Rgb = [u8; 3];

/// The plotters colour of `c`.
pub(crate) fn colour(c: Rgb) -> RGBColor {
    RGBColor(c[0], c[1], c[2])
}

/// `c` scaled towards black by `f` in 0..=1 (1 when `f` is not finite).
pub(crate) fn shade(c: Rgb, f: f64) -> Rgb {
    let f = if f.is_finite() {
        f.clamp(0.0, 1.0)
    } else {
        1.0
    };
    c.map(|v| (v as f64 * f).round() as u8)
}

/// A colour from hue (0..1, wrapping), saturation and value.
pub(crate) fn hsv(h: f64, s: f64, v: f64) -> Rgb {
    let h = h.rem_euclid(1.0) * 6.0;
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
    [r, g, b].map(|x| (x * 255.0).round() as u8)
}

/// The drawing surface handed to [`draw_png`]'s closure.
pub(crate) type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// What a drawing closure returns: plotters' own error, turned into text
/// by [`draw_png`].
pub(crate) type DrawResult = std::result::Result<
    (),
    DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>,
>;

/// Draws a `width` x `height` picture (each side at least 1) with `paint`
/// and writes it to `out` as an 8-bit RGB PNG. `what` names the picture in
/// error messages ("plot", "piano roll").
pub(crate) fn draw_png(
    out: &Path,
    what: &str,
    width: u32,
    height: u32,
    paint: impl FnOnce(&Area) -> DrawResult,
) -> Result<()> {
    ensure_font()?;
    let (w, h) = (width.max(1), height.max(1));
    let mut pixels = vec![0u8; w as usize * h as usize * 3];
    {
        let area = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        paint(&area)
            .and_then(|()| area.present())
            .map_err(|e| anyhow!("{e}"))
            .with_context(|| format!("cannot draw {what} {}", out.display()))?;
    }
    write_png(out, w, h, &pixels).with_context(|| format!("cannot save {what} {}", out.display()))
}

fn write_png(out: &Path, w: u32, h: u32, pixels: &[u8]) -> Result<()> {
    let ctx = || format!("cannot write PNG {}", out.display());
    crate::util::write_via_temp(out, |tmp| {
        let file = File::create(tmp).with_context(ctx)?;
        let mut enc = png::Encoder::new(BufWriter::new(file), w, h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut wr = enc.write_header().with_context(ctx)?;
        wr.write_image_data(pixels).with_context(ctx)?;
        wr.finish().with_context(ctx)?;
        Ok(())
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Reads back a PNG written by [`draw_png`]: (width, height, RGB bytes).
    pub(crate) fn decode(p: &Path) -> (u32, u32, Vec<u8>) {
        let dec = png::Decoder::new(File::open(p).unwrap());
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    /// The distinct colours of an RGB buffer.
    pub(crate) fn colours(buf: &[u8]) -> HashSet<Rgb> {
        buf.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect()
    }

    #[test]
    fn text_is_antialiased_and_saved() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("t.png");
        draw_png(&out, "test picture", 120, 30, |a| {
            a.fill(&WHITE)?;
            super::super::font::Text {
                text: "abc xyz",
                size: 16.0,
                colour: BLACK,
                align: plotters::style::text_anchor::HPos::Left,
            }
            .draw(a, 4, 20)
        })
        .unwrap();
        let (w, h, buf) = decode(&out);
        assert_eq!((w, h), (120, 30));
        let cols = colours(&buf);
        assert!(cols.contains(&[0, 0, 0]) && cols.contains(&[255, 255, 255]));
        // Anti-aliasing leaves greys between black and white.
        let greys = cols.iter().filter(|c| c[0] > 20 && c[0] < 235).count();
        assert!(greys >= 5, "{greys} grey levels");
        // Ink stays between the cap line and the descenders: nothing above
        // row 4 or below row 26 for a 16 px run on baseline 20.
        for (i, px) in buf.chunks_exact(3).enumerate() {
            let y = i as u32 / w;
            if px[0] < 128 {
                assert!((4..=26).contains(&y), "ink at row {y}");
            }
        }
        assert_eq!(hsv(0.0, 1.0, 1.0), [255, 0, 0]);
        assert_eq!(shade([200, 100, 0], 0.5), [100, 50, 0]);
        assert_eq!(shade([200, 100, 0], f64::NAN), [200, 100, 0]);

        let err = draw_png(Path::new("/nonexistent/q.png"), "test picture", 4, 4, |a| {
            a.fill(&WHITE)
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("q.png"), "{err:#}");
    }
}

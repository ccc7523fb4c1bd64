//! The one typeface of every picture: DejaVu Sans 2.37
//! (`core/assets/DejaVuSans.ttf`, its licence in `DejaVuSans.LICENSE` beside
//! it), compiled into the crate, so no system font is ever looked up and
//! pictures look the same on every machine.
//!
//! Text is laid out and rasterised here with `ab_glyph` (advances, kerning,
//! each glyph's own bounds, coverage as alpha) and blended into a plotters
//! drawing area pixel by pixel. plotters 0.3.7's own `ab_glyph` text path
//! drops every glyph's left side bearing, which spaces letters unevenly
//! ("firs t"), so the pictures never ask plotters to draw text.

use std::sync::OnceLock;

use ab_glyph::{Font, FontRef, PxScale, ScaleFont};
use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::HPos;

static FONT_BYTES: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// The bundled font, parsed once per process.
fn font() -> Result<&'static FontRef<'static>> {
    static FONT: OnceLock<Option<FontRef<'static>>> = OnceLock::new();
    FONT.get_or_init(|| FontRef::try_from_slice(FONT_BYTES).ok())
        .as_ref()
        .ok_or_else(|| {
            anyhow!("the bundled font core/assets/DejaVuSans.ttf cannot be read as a TrueType font")
        })
}

/// Checks that the bundled font parses (it always does in a sound build).
pub(crate) fn ensure_font() -> Result<()> {
    font().map(|_| ())
}

/// Width in pixels of `text` at `size` pixels per em (0 when the font is
/// unusable, which [`ensure_font`] reports before any drawing).
pub(crate) fn text_width(text: &str, size: f64) -> i32 {
    let Ok(f) = font() else { return 0 };
    let sf = f.as_scaled(PxScale::from(size as f32));
    let mut w = 0.0f32;
    let mut prev = None;
    for c in text.chars() {
        let id = sf.glyph_id(c);
        if let Some(p) = prev {
            w += sf.kern(p, id);
        }
        w += sf.h_advance(id);
        prev = Some(id);
    }
    w.ceil() as i32
}

/// Which way a run of text reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Left to right, upright.
    Across,
    /// Bottom to top (turned 90 degrees anticlockwise), for vertical axes.
    Up,
}

/// One run of text placed by its baseline.
pub(crate) struct Text<'a> {
    pub(crate) text: &'a str,
    /// Pixels per em.
    pub(crate) size: f64,
    pub(crate) colour: RGBColor,
    /// Which end of the run the anchor is: left, centre or right (in
    /// reading direction).
    pub(crate) align: HPos,
}

impl Text<'_> {
    /// Draws the run reading across, its baseline at `baseline` and its
    /// `align` end at `x`. Pixels outside `area` are dropped.
    pub(crate) fn draw<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        x: i32,
        baseline: i32,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        self.draw_dir(area, x, baseline, Direction::Across)
    }

    /// Draws the run reading in direction `dir`; for [`Direction::Up`] the
    /// baseline is the column `x` and the anchor is the row `y`.
    pub(crate) fn draw_dir<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        x: i32,
        y: i32,
        dir: Direction,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        let Ok(f) = font() else { return Ok(()) };
        if self.text.is_empty() || !(self.size.is_finite() && self.size > 0.0) {
            return Ok(());
        }
        let sf = f.as_scaled(PxScale::from(self.size as f32));
        let width = text_width(self.text, self.size) as f32;
        let start = match self.align {
            HPos::Left => 0.0,
            HPos::Center => -width / 2.0,
            HPos::Right => -width,
        };
        // Pen position along the run, relative to the anchor; the baseline
        // is at 0 across it.
        let mut caret = start.round();
        let mut prev = None;
        let (w, h) = area.dim_in_pixel();
        for c in self.text.chars() {
            let id = sf.glyph_id(c);
            if let Some(p) = prev {
                caret += sf.kern(p, id);
            }
            prev = Some(id);
            let glyph = id.with_scale_and_position(sf.scale(), ab_glyph::point(caret, 0.0));
            caret += sf.h_advance(id);
            let Some(outline) = f.outline_glyph(glyph) else {
                continue;
            };
            let b = outline.px_bounds();
            let mut pixels = Vec::new();
            outline.draw(|gx, gy, cov| {
                if cov > 0.0 {
                    pixels.push((b.min.x as i32 + gx as i32, b.min.y as i32 + gy as i32, cov));
                }
            });
            for (along, across, cov) in pixels {
                let (px, py) = match dir {
                    Direction::Across => (x + along, y + across),
                    Direction::Up => (x + across, y - along),
                };
                if px >= 0 && py >= 0 && (px as u32) < w && (py as u32) < h {
                    area.draw_pixel((px, py), &self.colour.mix(cov.min(1.0) as f64))?;
                }
            }
        }
        Ok(())
    }
}

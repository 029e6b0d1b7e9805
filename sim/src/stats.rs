//! Percentiles of latencies and the power-law fit used for the projection.

use std::time::Duration;

/// p50, p99 and max of a sorted sample.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Spread {
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
}

impl Spread {
    pub fn of(sorted: &[Duration]) -> Spread {
        Spread {
            p50: percentile(sorted, 0.50),
            p99: percentile(sorted, 0.99),
            max: sorted.last().copied().unwrap_or_default(),
        }
    }
}

/// The nearest-rank percentile of a sorted sample (zero when empty).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// `y = a · x^b`, fitted by least squares on logarithms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerLaw {
    pub a: f64,
    pub b: f64,
}

impl PowerLaw {
    /// The fit of `points` (x, y); points with a non-positive coordinate are ignored.
    /// `None` with fewer than two usable points.
    pub fn fit(points: &[(f64, f64)]) -> Option<PowerLaw> {
        let logs: Vec<(f64, f64)> = points
            .iter()
            .filter(|(x, y)| *x > 0.0 && *y > 0.0)
            .map(|(x, y)| (x.ln(), y.ln()))
            .collect();
        let n = logs.len() as f64;
        if logs.len() < 2 {
            return None;
        }
        let (sx, sy) = logs.iter().fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
        let (mx, my) = (sx / n, sy / n);
        let sxx: f64 = logs.iter().map(|(x, _)| (x - mx).powi(2)).sum();
        let sxy: f64 = logs.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
        if sxx == 0.0 {
            return None;
        }
        let b = sxy / sxx;
        Some(PowerLaw {
            a: (my - b * mx).exp(),
            b,
        })
    }

    pub fn at(&self, x: f64) -> f64 {
        self.a * x.powf(self.b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let sample: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let spread = Spread::of(&sample);
        assert_eq!(spread.p50, Duration::from_millis(51));
        assert_eq!(spread.p99, Duration::from_millis(99));
        assert_eq!(spread.max, Duration::from_millis(100));
        assert_eq!(Spread::of(&[]), Spread::default());
    }

    #[test]
    fn a_power_law_is_recovered_from_its_points() {
        let points: Vec<(f64, f64)> = [1e3f64, 2e3, 5e3, 1e4]
            .iter()
            .map(|&x| (x, 3.0 * x.powf(1.5)))
            .collect();
        let fit = PowerLaw::fit(&points).unwrap();
        assert!((fit.b - 1.5).abs() < 1e-9, "{fit:?}");
        assert!((fit.at(2e4) / (3.0 * 2e4f64.powf(1.5)) - 1.0).abs() < 1e-9);
        assert_eq!(PowerLaw::fit(&points[..1]), None);
    }
}

//! Learning-rate schedule: linear warmup, then cosine decay to a floor.

/// The schedule of one run.
#[derive(Debug, Clone, Copy)]
pub struct LrSchedule {
    /// Peak rate reached at the end of warmup.
    pub peak: f64,
    /// Floor reached at the last step.
    pub floor: f64,
    /// Warmup steps.
    pub warmup: usize,
    /// Total steps.
    pub total: usize,
}

impl LrSchedule {
    /// Rate of 0-based step `step`: `peak·(step+1)/warmup` during warmup, then
    /// `floor + (peak − floor)·(1 + cos(π·progress))/2`.
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        self.floor
            + (self.peak - self.floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_floor() {
        let s = LrSchedule {
            peak: 1.0,
            floor: 0.1,
            warmup: 10,
            total: 110,
        };
        assert!((s.at(0) - 0.1).abs() < 1e-12);
        assert!((s.at(9) - 1.0).abs() < 1e-12);
        assert!((s.at(10) - 1.0).abs() < 1e-12);
        assert!((s.at(60) - 0.55).abs() < 1e-12);
        assert!((s.at(110) - 0.1).abs() < 1e-12);
    }
}

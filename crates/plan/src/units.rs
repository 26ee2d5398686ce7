//! Figures as people read them, whatever their size: a plan for a 0.9M-parameter model on a
//! laptop and one for 405B on thousands of GPUs print in the same words.

/// Seconds in s (from 0.1 s, and 0), ms (from 0.1 ms) or µs, with three significant places
/// or so.
pub fn seconds(s: f64) -> String {
    match s.abs() {
        a if a >= 0.1 || a == 0.0 => format!("{s:.3} s"),
        a if a >= 1e-4 => format!("{:.1} ms", s * 1e3),
        _ => format!("{:.1} µs", s * 1e6),
    }
}

/// A count: `8.03B`, `134.1M`, `869.5K`, or as is below a thousand.
pub fn count(n: u64) -> String {
    let x = n as f64;
    match x {
        x if x >= 1e9 => format!("{:.2}B", x / 1e9),
        x if x >= 1e6 => format!("{:.1}M", x / 1e6),
        x if x >= 1e3 => format!("{:.1}K", x / 1e3),
        x => format!("{x}"),
    }
}

/// `n` and `word`, plural but for one: `1 rank`, `2 ranks`.
pub fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// The unit a table of bytes is shown in, picked by its largest figure: GiB, or MiB (KiB)
/// where that is under 1 GiB (1 MiB), so that a small model's rows do not all read 0.00.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ByteUnit {
    /// Its name: `GiB`, `MiB` or `KiB`.
    pub name: &'static str,
    /// Bytes in one of it.
    pub bytes: f64,
}

impl ByteUnit {
    /// The unit for a table whose largest figure is `largest` bytes.
    pub fn for_largest(largest: u64) -> ByteUnit {
        let (b, mib) = (largest as f64, 1024.0 * 1024.0);
        let (name, bytes) = if b >= 1024.0 * mib {
            ("GiB", 1024.0 * mib)
        } else if b >= mib {
            ("MiB", mib)
        } else {
            ("KiB", 1024.0)
        };
        ByteUnit { name, bytes }
    }
    /// `bytes` in this unit, to `decimals` places (no unit name).
    pub fn value(self, bytes: u64, decimals: usize) -> String {
        format!("{:.*}", decimals, bytes as f64 / self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_keep_their_digits_at_any_size() {
        assert_eq!(seconds(2.5), "2.500 s");
        assert_eq!(seconds(0.11), "0.110 s");
        assert_eq!(seconds(0.0123), "12.3 ms");
        assert_eq!(seconds(0.000_045), "45.0 µs");
        assert_eq!(seconds(0.0), "0.000 s");
        assert_eq!(count(8_030_261_248), "8.03B");
        assert_eq!(count(869_504), "869.5K");
        assert_eq!(count(134_100_000), "134.1M");
        assert_eq!(count(999), "999");
        assert_eq!(
            (plural(1, "rank"), plural(2, "thread")),
            ("1 rank".into(), "2 threads".into())
        );
        let mib = ByteUnit::for_largest(48 << 20);
        assert_eq!((mib.name, mib.value(3 << 20, 2)), ("MiB", "3.00".into()));
        assert_eq!(ByteUnit::for_largest(2 << 30).name, "GiB");
        assert_eq!(ByteUnit::for_largest(4096).name, "KiB");
    }
}

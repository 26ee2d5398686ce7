//! TensorBoard event files: `<run.dir>/tensorboard/events.out.tfevents.<time>.<host>`,
//! scalars written by the leader as steps finish, readable by TensorBoard, and by W&B and
//! Aim, which import them.
//!
//! # Format
//!
//! A file is a sequence of records, each `length: u64 LE`, `masked_crc32c(length): u32 LE`,
//! `data`, `masked_crc32c(data): u32 LE`, where `masked(c) = ((c >> 15) | (c << 17)) +
//! 0xa282ead8`. Each record's data is a serialized `tensorflow.Event` protobuf: `wall_time`
//! (field 1, double), `step` (2, int64), and either `file_version` (3, string,
//! `brain.Event:2`, the first record), `summary` (5) or `session_log` (7, a resume) holding `Summary.Value`s (field 1)
//! of `tag` (1, string) and `simple_value` (2, float). Tags follow torchtitan's where it has
//! one (`loss_metrics/global_avg_loss`, `grad_norm`, `lr`, `throughput(tps)`, `mfu(%)`).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{io_err, StepStats, TrainError};

/// The TensorBoard tag of each per-step scalar, with its value.
pub fn step_scalars(s: &StepStats) -> Vec<(String, f64)> {
    let mut out = vec![
        ("loss_metrics/global_avg_loss".to_string(), s.loss),
        ("lr".to_string(), s.lr),
        ("grad_norm".to_string(), s.grad_norm),
        ("throughput(tps)".to_string(), s.tokens_per_s),
        ("time_metrics/step(s)".to_string(), s.step_time_s),
    ];
    if let Some(m) = s.mfu {
        out.push(("mfu(%)".to_string(), 100.0 * m));
    }
    for (category, bytes) in &s.memory_peak_bytes {
        out.push((
            format!("memory/peak_{category}(MiB)"),
            *bytes as f64 / 1048576.0,
        ));
    }
    if let Some(moe) = &s.moe {
        out.push(("moe/aux_loss".to_string(), moe.aux_loss));
        for (block, counts) in moe.expert_counts.iter().enumerate() {
            let total: u64 = counts.iter().sum();
            let max = counts.iter().copied().max().unwrap_or(0);
            if total > 0 {
                // The busiest expert's load over the mean load: 1 is perfect balance.
                let imbalance = max as f64 * counts.len() as f64 / total as f64;
                out.push((format!("moe/max_load_ratio/block_{block}"), imbalance));
            }
        }
    }
    out
}

/// Writes one event file.
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// Creates a new event file in `dir` (made if needed), starting with the version record.
    pub fn create(dir: &Path) -> Result<EventWriter, TrainError> {
        std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let now = wall_time();
        // Readers take a directory's files in name order: seconds and microseconds, fixed
        // width, put a resumed run's file after the one it continues.
        let name = format!(
            "events.out.tfevents.{}.{:06}.{host}.{}",
            now as u64,
            ((now.fract()) * 1e6) as u64 % 1_000_000,
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(io_err("create", &path))?;
        let mut w = EventWriter { file, path };
        let mut event = Vec::new();
        put_double(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        w.record(&event)?;
        Ok(w)
    }

    /// Marks a run resumed after step `step`: a `SessionLog` START at the next step, on
    /// which TensorBoard drops the earlier files' events of that step and later ones (the
    /// steps redone).
    pub fn resumed_after(&mut self, step: usize) -> Result<(), TrainError> {
        let step = step + 1;
        let mut log = Vec::new();
        put_varint_field(&mut log, 1, 1); // status: START
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step as u64);
        put_bytes(&mut event, 7, &log); // session_log
        self.record(&event)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `scalars` of step `step` as one event, and flushes it.
    pub fn scalars(&mut self, step: usize, scalars: &[(String, f64)]) -> Result<(), TrainError> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_float(&mut v, 2, *value as f32);
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step as u64);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)
    }

    /// One framed record, written whole and flushed.
    fn record(&mut self, data: &[u8]) -> Result<(), TrainError> {
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(data);
        rec.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file
            .write_all(&rec)
            .and_then(|()| self.file.flush())
            .map_err(io_err("write", &self.path))
    }
}

/// A step hook writing each step's scalars ([`step_scalars`]) as the steps finish; the
/// leader holds the writer, the other ranks none.
pub struct TensorBoardHook(pub Option<EventWriter>);

impl crate::StepHook for TensorBoardHook {
    fn after_step(&mut self, _trainer: &crate::Trainer, s: &StepStats) -> Result<(), TrainError> {
        match &mut self.0 {
            Some(w) => w.scalars(s.step, &step_scalars(s)),
            None => Ok(()),
        }
    }
}

/// Removes the event files of a run `--overwrite` replaces (in `dir`); returns how many.
pub fn clear_event_files(dir: &Path) -> Result<usize, TrainError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(0);
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("events.out.tfevents.")
        {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(io_err("remove", &path))?;
            removed += 1;
        }
    }
    Ok(removed)
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A varint field (wire type 0).
fn put_varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    put_varint(out, u64::from(field) << 3);
    put_varint(out, v);
}

/// A 64-bit field (wire type 1).
fn put_double(out: &mut Vec<u8>, field: u32, v: f64) {
    put_varint(out, (u64::from(field) << 3) | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

/// A length-delimited field (wire type 2).
fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, (u64::from(field) << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A 32-bit field (wire type 5).
fn put_float(out: &mut Vec<u8>, field: u32, v: f32) {
    put_varint(out, (u64::from(field) << 3) | 5);
    out.extend_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_its_mask_match_the_published_values() {
        // RFC 3720's check value for "123456789".
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        // TFRecord's mask, ((c >> 15) | (c << 17)) + 0xa282ead8, worked out by hand.
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn protobuf_fields_encode_as_the_wire_format_says() {
        let mut v = Vec::new();
        put_varint_field(&mut v, 2, 300);
        assert_eq!(v, [0x10, 0xac, 0x02]);
        let mut b = Vec::new();
        put_bytes(&mut b, 1, b"lr");
        assert_eq!(b, [0x0a, 2, b'l', b'r']);
        let mut f = Vec::new();
        put_float(&mut f, 2, 1.0);
        assert_eq!(f, [0x15, 0, 0, 0x80, 0x3f]);
    }
}

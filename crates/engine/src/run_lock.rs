//! A run owns its directory: an exclusive lock on `<run.dir>/.lock` for the whole run, so
//! that two runs never write the same metrics, summary or checkpoints. The lock is the
//! kernel's (`flock`): it goes away with the process, however the process ends.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Holds the run directory until dropped (or the process ends).
pub struct RunLock {
    _file: File,
}

impl RunLock {
    /// Takes `dir` (created if needed) for this run, or says which run holds it.
    pub fn acquire(dir: &Path) -> Result<RunLock, String> {
        let path = dir.join(".lock");
        let fail = |what: &str, e: std::io::Error| format!("{what} {}: {e}", path.display());
        std::fs::create_dir_all(dir).map_err(|e| fail("create the directory of", e))?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| fail("open", e))?;
        // SAFETY: `file` is an open descriptor for the duration of the call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(format!(
                "run.dir {} is in use by another run ({}); wait for it to finish, or choose \
                 another run.dir",
                dir.display(),
                holder.trim()
            ));
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let me = format!("pid {}, started at unix time {now}", std::process::id());
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(me.as_bytes()))
            .map_err(|e| fail("write", e))?;
        Ok(RunLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_held_directory_names_the_holder() {
        let dir = std::env::temp_dir().join(format!("ferrotron-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let held = RunLock::acquire(&dir).unwrap();
        let refused = RunLock::acquire(&dir).err().unwrap();
        assert!(
            refused.contains(&format!("pid {}", std::process::id())),
            "{refused}"
        );
        drop(held);
        RunLock::acquire(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

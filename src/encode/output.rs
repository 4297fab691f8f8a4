//! Atomic output files: written to a temporary file in the target's
//! directory, fsynced, then renamed over the target, so a killed or failed
//! encoding leaves nothing at the target path (at most a hidden
//! `.NAME.tmp.*` file, removed on error and on cancellation).

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result, err};

pub struct AtomicOutput {
    target: PathBuf,
    temp: PathBuf,
    writer: Option<BufWriter<File>>,
    written: u64,
}

impl AtomicOutput {
    /// Create the temporary file next to `target`. An existing target is an
    /// error unless `overwrite`.
    pub fn create(target: &Path, overwrite: bool) -> Result<AtomicOutput> {
        if target.exists() && !overwrite {
            return Err(err(
                ErrorKind::BadValue,
                "output exists (pass overwrite to replace it)",
            )
            .path(target));
        }
        let name = target
            .file_name()
            .ok_or_else(|| err(ErrorKind::BadValue, "output has no file name").path(target))?;
        let dir = target
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let temp = dir.join(format!(
            ".{}.tmp.{}.{nanos}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| Error::io(&temp, "cannot create temporary output", e))?;
        Ok(AtomicOutput {
            target: target.to_path_buf(),
            temp,
            writer: Some(BufWriter::with_capacity(1 << 20, file)),
            written: 0,
        })
    }

    pub fn temp_path(&self) -> &Path {
        &self.temp
    }

    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    /// fsync, rename over the target, fsync the directory.
    pub fn commit(mut self) -> Result<u64> {
        let w = self
            .writer
            .take()
            .ok_or_else(|| err(ErrorKind::Io, "output already finished"))?;
        let file = w
            .into_inner()
            .map_err(|e| Error::io(&self.temp, "flush", e.into_error()))?;
        file.sync_all()
            .map_err(|e| Error::io(&self.temp, "fsync", e))?;
        drop(file);
        std::fs::rename(&self.temp, &self.target)
            .map_err(|e| Error::io(&self.target, "rename into place", e))?;
        if let Some(dir) = self.target.parent().filter(|p| !p.as_os_str().is_empty())
            && let Ok(d) = File::open(dir)
        {
            let _ = d.sync_all();
        }
        Ok(self.written)
    }
}

impl Write for AtomicOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| std::io::Error::other("output already finished"))?;
        let n = w.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self.writer.as_mut() {
            Some(w) => w.flush(),
            None => Ok(()),
        }
    }
}

impl Drop for AtomicOutput {
    fn drop(&mut self) {
        if self.writer.take().is_some() {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_renames_and_drop_cleans_up() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("out.sk32");
        let mut o = AtomicOutput::create(&target, false).unwrap();
        o.write_all(b"hello").unwrap();
        let temp = o.temp_path().to_path_buf();
        assert!(temp.exists() && !target.exists());
        assert_eq!(o.commit().unwrap(), 5);
        assert_eq!(std::fs::read(&target).unwrap(), b"hello");
        assert!(!temp.exists());
        // Exists: refused without overwrite.
        assert!(AtomicOutput::create(&target, false).is_err());
        // A dropped (failed) output leaves nothing behind.
        let mut o = AtomicOutput::create(&target, true).unwrap();
        o.write_all(b"partial").unwrap();
        let temp = o.temp_path().to_path_buf();
        drop(o);
        assert!(!temp.exists());
        assert_eq!(std::fs::read(&target).unwrap(), b"hello");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}

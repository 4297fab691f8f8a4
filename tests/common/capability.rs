//! What a FUSE mount test needs, checked one way by the tests
//! (`mount::fuse_available`, at run time) and by build.rs (the
//! `rknot_no_fuse` cfg, at build time), which includes this file.

use std::path::Path;

/// The missing pieces for mounting: effective uid 0, /dev/fuse opened
/// read-write, fusermount3 installed. Empty when this process can mount.
pub fn mount_lacks() -> Vec<&'static str> {
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false);
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .is_ok();
    let helper =
        Path::new("/usr/bin/fusermount3").exists() || Path::new("/bin/fusermount3").exists();
    let mut lacks = Vec::new();
    if !root {
        lacks.push("root");
    }
    if !dev {
        lacks.push("/dev/fuse opened read-write");
    }
    if !helper {
        lacks.push("fusermount3 in /usr/bin or /bin");
    }
    lacks
}

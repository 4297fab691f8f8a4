//! Every WARN or ERROR line in the daemon's log means something an
//! operator should look at: a mount, a read and a normal unmount log none,
//! whether the unmount is `fusermount3 -u` (the kernel unmounts first and
//! the session ends), `umount` or SIGTERM (the daemon unmounts).

mod common;

use common::needs;

use std::process::Command;
use std::time::{Duration, Instant};

use common::mount::{MountGuard, background_pid, fuse_available, mount_demo_background, pid_alive};

/// The WARN and ERROR lines of a log.
fn loud_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect()
}

fn mount_read_unmount(how: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mp = dir.path().join("mnt");
    std::fs::create_dir(&mp).unwrap();
    let log = dir.path().join("daemon.log");
    let mut guard = MountGuard::new(&mp, None);
    let out = mount_demo_background(&mp, &log);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pid = background_pid(&stdout).expect("pid");
    guard.set_pid(Some(pid));
    // Reads of a tensor file, a view, index.json and ctl.
    for f in ["blk.0.attn_q.weight.f32", "model.gguf", "index.json", "ctl"] {
        std::fs::read(mp.join(f)).unwrap();
    }
    match how {
        "fusermount3" | "umount" => {
            let mut c = Command::new(how);
            if how == "fusermount3" {
                c.arg("-u");
            }
            assert!(c.arg(&mp).status().unwrap().success());
        }
        // SAFETY: signalling the daemon this test started.
        _ => unsafe {
            libc::kill(pid, libc::SIGTERM);
        },
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while pid_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!pid_alive(pid), "daemon still running after {how}");
    guard.exited();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("; exiting"), "{how}: {text}");
    assert_eq!(loud_lines(&text), Vec::<&str>::new(), "{how}: {text}");
}

needs! { [fuse]
fn normal_unmounts_log_no_warn_or_error() {
    if !fuse_available() {
        return;
    }
    for how in ["fusermount3", "umount", "SIGTERM"] {
        mount_read_unmount(how);
    }
}
}

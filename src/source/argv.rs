//! Keeping URL secrets out of the process title.
//!
//! `ps`, `/proc/PID/cmdline` and `top` show every user a process's
//! arguments, and a presigned URL's query string (or a URL's `user:pw@`)
//! is a credential. Rust's `std::env::args` copies the arguments when
//! called, so a program first collects its arguments, then calls
//! [`hide_url_secrets_in_argv`], which overwrites those secrets with `x`
//! in the process's own argument memory (the area `/proc/self/stat` names
//! `arg_start`..`arg_end`, which the kernel reads `cmdline` from), the way
//! `setproctitle` does. What remains visible is the redacted URL's shape.
//!
//! What this cannot hide: the arguments as they were between `exec` and
//! this call (a few milliseconds), and an `exec` that a supervisor logs.
//! docs/OPERATIONS.md says to pass such URLs through an environment file
//! where that matters.

use super::remote::is_remote;

/// The byte ranges of `arg` that are secrets: a URL's userinfo
/// (`user:pw@`) and query string (after `?`, fragment included).
fn secret_ranges(arg: &[u8]) -> Vec<std::ops::Range<usize>> {
    let Ok(s) = std::str::from_utf8(arg) else {
        return Vec::new();
    };
    if !is_remote(s) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let Some(scheme_end) = s.find("://").map(|i| i + 3) else {
        return out;
    };
    let rest = &s[scheme_end..];
    let auth_end = scheme_end + rest.find(['/', '?', '#']).unwrap_or(rest.len());
    if let Some(at) = s[scheme_end..auth_end].rfind('@') {
        out.push(scheme_end..scheme_end + at);
    }
    if let Some(q) = s.find(['?', '#']) {
        out.push(q + 1..s.len());
    }
    out
}

/// Overwrite the secrets of every URL argument in this process's argument
/// memory. Best effort: where the area cannot be found, nothing changes.
pub fn hide_url_secrets_in_argv() {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // Fields after the command name (which may hold spaces and ')'): the
    // first is field 3 (state); arg_start and arg_end are fields 48 and 49.
    let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return;
    };
    let fields: Vec<&str> = after.split_whitespace().collect();
    let (Some(start), Some(end)) = (
        fields.get(48 - 3).and_then(|v| v.parse::<usize>().ok()),
        fields.get(49 - 3).and_then(|v| v.parse::<usize>().ok()),
    ) else {
        return;
    };
    if start == 0 || end <= start || end - start > (1 << 24) {
        return;
    }
    // SAFETY: [arg_start, arg_end) is this process's argument area, mapped
    // writable on its stack for the process's life (the kernel reads
    // /proc/PID/cmdline from it; setproctitle writes it). The arguments
    // were copied into Rust strings before this call, and nothing else
    // reads this memory; only bytes inside the area are written.
    let area = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, end - start) };
    let mut pos = 0;
    while pos < area.len() {
        let len = area[pos..]
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(area.len() - pos);
        let arg = &mut area[pos..pos + len];
        for r in secret_ranges(arg) {
            for b in &mut arg[r] {
                *b = b'x';
            }
        }
        pos += len + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_userinfo_and_queries() {
        let hide = |s: &str| {
            let mut b = s.as_bytes().to_vec();
            for r in secret_ranges(&b) {
                b[r].fill(b'x');
            }
            String::from_utf8(b).unwrap()
        };
        assert_eq!(
            hide("https://h/m.gguf?X-Amz-Signature=abc"),
            "https://h/m.gguf?xxxxxxxxxxxxxxxxxxx"
        );
        assert_eq!(hide("https://u:pw@h/m?q"), "https://xxxx@h/m?x");
        assert_eq!(hide("s3://b/k.rknot"), "s3://b/k.rknot");
        assert_eq!(hide("/tmp/a?b"), "/tmp/a?b");
    }
}

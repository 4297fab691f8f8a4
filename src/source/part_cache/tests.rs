use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use super::*;

const OBJECT: &str = "s3://bucket/models/a.gguf";

fn key(version: &str, index: u64) -> PartKey<'_> {
    PartKey {
        object: OBJECT,
        version,
        part_size: 1 << 20,
        index,
    }
}

/// Distinct bytes for part `index`.
fn part(index: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(index * 7) as u8)
        .collect()
}

fn path_of(cache: &SourcePartCache, k: &PartKey) -> PathBuf {
    cache.dir().join(k.file_name())
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

fn open_cache(dir: &Path, limit: u64) -> Arc<SourcePartCache> {
    SourcePartCache::open(dir, limit).unwrap()
}

/// Only the part files (and no temporaries) left in `dir`.
fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn round_trip_private_files_and_versions_are_other_parts() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("sc");
    let c = open_cache(&dir, 1 << 20);
    assert_eq!(mode(&dir), 0o700);
    let data = part(3, 1000);
    assert_eq!(c.get(&key("etag1", 3), 1000), None);
    c.put(&key("etag1", 3), &data);
    assert_eq!(c.get(&key("etag1", 3), 1000).as_deref(), Some(&data[..]));
    let file = path_of(&c, &key("etag1", 3));
    assert_eq!(mode(&file), 0o600);
    assert_eq!(names_in(&dir), vec![key("etag1", 3).file_name()]);
    // Another version, index, part size or object: another part.
    assert_eq!(c.get(&key("etag2", 3), 1000), None);
    assert_eq!(c.get(&key("etag1", 4), 1000), None);
    let other_size = PartKey {
        part_size: 2 << 20,
        ..key("etag1", 3)
    };
    assert_eq!(c.get(&other_size, 1000), None);
    let other_object = PartKey {
        object: "s3://bucket/models/b.gguf",
        ..key("etag1", 3)
    };
    assert_eq!(c.get(&other_object, 1000), None);
    // Fields cannot run into each other.
    let a = PartKey {
        object: "s3://b/ab",
        version: "c",
        ..key("", 0)
    };
    let b = PartKey {
        object: "s3://b/a",
        version: "bc",
        ..key("", 0)
    };
    assert_ne!(a.file_name(), b.file_name());
    // An empty part (a zero-length object) round-trips too.
    c.put(&key("etag1", 9), b"");
    assert_eq!(c.get(&key("etag1", 9), 0).as_deref(), Some(&b""[..]));
    let s = c.stats();
    assert_eq!(
        (s.hits, s.misses, s.writes, s.corrupt, s.entries),
        (2, 5, 2, 0, 2)
    );
    assert_eq!(s.bytes, std::fs::metadata(&file).unwrap().len() + 52 + 30);
    assert_eq!(s.limit, 1 << 20);
}

#[test]
fn two_caches_on_one_directory_share_parts() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("sc");
    let (a, b) = (open_cache(&dir, 1 << 20), open_cache(&dir, 1 << 20));
    let data = part(0, 4096);
    a.put(&key("v", 0), &data);
    assert_eq!(b.get(&key("v", 0), 4096).as_deref(), Some(&data[..]));
    // A put of a part the other mount already stored leaves it as is.
    b.put(&key("v", 0), &data);
    assert_eq!((a.stats().writes, b.stats().writes), (1, 0));
    // A remount (a new cache) sees it as well.
    drop((a, b));
    let c = open_cache(&dir, 1 << 20);
    assert_eq!(c.get(&key("v", 0), 4096).as_deref(), Some(&data[..]));
}

#[test]
fn bad_files_are_removed_and_read_as_misses() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("sc");
    let c = open_cache(&dir, 1 << 20);
    let data = part(1, 300);
    let k = key("v", 1);
    let file = path_of(&c, &k);
    let store_good = || {
        c.put(&k, &data);
        assert!(file.exists());
    };
    let mut expect_corrupt = 0;
    let mut check_bad = |what: &str, len: usize| {
        assert_eq!(c.get(&k, len), None, "{what}");
        assert!(!file.exists(), "{what}: not removed");
        expect_corrupt += 1;
        assert_eq!(c.stats().corrupt, expect_corrupt, "{what}");
    };
    // A flipped byte in the data, in the header's key, in the CRC.
    for at in [52 + OBJECT.len() + 1 + 17, 60, 40, 0, 8] {
        store_good();
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[at] ^= 0x40;
        std::fs::write(&file, &bytes).unwrap();
        check_bad(&format!("byte {at} flipped"), 300);
    }
    // Truncated, short of even a header, empty, longer.
    for len in [351, 10, 0, 400] {
        store_good();
        let mut bytes = std::fs::read(&file).unwrap();
        bytes.resize(len, 0);
        std::fs::write(&file, &bytes).unwrap();
        check_bad(&format!("{len} B long"), 300);
    }
    // Another part's file under this name (a hash collision or a rename):
    // same length, same CRC-valid data, another key.
    let other = key("w", 1);
    c.put(&other, &data);
    std::fs::rename(path_of(&c, &other), &file).unwrap();
    check_bad("another key", 300);
    // A length other than the caller expects.
    store_good();
    check_bad("other length", 299);
    // And the part is stored and served again afterwards.
    store_good();
    assert_eq!(c.get(&k, 300).as_deref(), Some(&data[..]));
}

#[test]
fn what_is_not_ours_is_ignored() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("sc");
    let c = open_cache(&dir, 1 << 20);
    let k = key("v", 0);
    let data = part(0, 100);
    // A symlink under a part's name, to a good part file elsewhere: not
    // followed, not removed, not counted as corrupt.
    let elsewhere = t.path().join("elsewhere");
    c.put(&k, &data);
    std::fs::rename(path_of(&c, &k), &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, path_of(&c, &k)).unwrap();
    assert_eq!(c.get(&k, 100), None);
    assert!(std::fs::symlink_metadata(path_of(&c, &k)).is_ok());
    // A directory and a FIFO under part names: ignored (and no hang).
    let (d, f) = (key("v", 1), key("v", 2));
    std::fs::create_dir(path_of(&c, &d)).unwrap();
    let fifo =
        std::ffi::CString::new(path_of(&c, &f).into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    assert_eq!(c.get(&d, 100), None);
    assert_eq!(c.get(&f, 100), None);
    // Other files in the directory are neither counted nor evicted.
    std::fs::write(dir.join("notes.txt"), b"x".repeat(5000)).unwrap();
    let s = c.stats();
    assert_eq!((s.corrupt, s.entries, s.bytes), (0, 0, 0));
    // A put replaces the symlink with a real file; the target is untouched.
    c.put(&k, &data);
    assert_eq!(c.get(&k, 100).as_deref(), Some(&data[..]));
    assert!(
        std::fs::symlink_metadata(path_of(&c, &k))
            .unwrap()
            .is_file()
    );
    assert!(elsewhere.exists());
}

#[test]
fn the_limit_evicts_the_least_recently_used() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("sc");
    let len = 1000;
    let file_len = (key("v", 0).header_len() + len) as u64;
    let limit = 20 * file_len;
    let c = open_cache(&dir, limit);
    for i in 0..20 {
        c.put(&key("v", i), &part(i, len));
    }
    assert_eq!(c.stats().entries, 20);
    // Ages: part i last used i minutes ago, so 19 is the oldest...
    let now = SystemTime::now();
    for i in 0..20 {
        let f = File::options()
            .write(true)
            .open(path_of(&c, &key("v", i)))
            .unwrap();
        f.set_modified(now - Duration::from_secs(60 * (i + 1)))
            .unwrap();
    }
    // ... but a hit on 19 and 18 makes them the most recent.
    assert!(c.get(&key("v", 19), len).is_some());
    assert!(c.get(&key("v", 18), len).is_some());
    c.put(&key("v", 20), &part(20, len));
    let s = c.stats();
    assert!(s.bytes <= limit - evict_slack(limit), "{s:?}");
    assert_eq!(s.evictions, 20 - s.entries + 1);
    assert!(s.evictions >= 2, "{s:?}");
    for i in [20, 19, 18, 0] {
        assert!(c.get(&key("v", i), len).is_some(), "part {i} evicted");
    }
    // The evicted ones are the oldest: 17, 16, ...
    for i in (18 - s.evictions)..18 {
        assert!(c.get(&key("v", i), len).is_none(), "part {i} kept");
    }
    // Another process's parts count too: a second cache sees the
    // directory full and evicts before writing.
    let other = open_cache(&dir, limit);
    for i in 100..130 {
        other.put(&key("v", i), &part(i, len));
    }
    assert!(other.stats().bytes <= limit);
    // A part larger than the limit is not stored; a smaller limit at the
    // next open evicts down to it.
    let small = open_cache(&dir, 3 * file_len);
    assert!(small.stats().bytes <= 3 * file_len);
    small.put(&key("v", 999), &part(0, 4 * len));
    assert_eq!(small.stats().too_large, 1);
    assert!(small.get(&key("v", 999), 4 * len).is_none());
}

#[test]
fn hits_refresh_recency_at_most_every_few_seconds() {
    let t = tempfile::tempdir().unwrap();
    let c = open_cache(&t.path().join("sc"), 1 << 20);
    let k = key("v", 0);
    c.put(&k, b"abc");
    let f = path_of(&c, &k);
    let mtime = || std::fs::metadata(&f).unwrap().modified().unwrap();
    let just_now = SystemTime::now() - Duration::from_secs(1);
    File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_modified(just_now)
        .unwrap();
    assert!(c.get(&k, 3).is_some());
    assert_eq!(mtime(), just_now, "touched again within {TOUCH_EVERY:?}");
    let long_ago = SystemTime::now() - Duration::from_secs(3600);
    File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_modified(long_ago)
        .unwrap();
    assert!(c.get(&k, 3).is_some());
    assert!(mtime() > just_now);
}

#[test]
fn unsafe_directories_are_refused() {
    // The checks themselves are `CacheDir`'s (tested there): here, that
    // the source cache uses them and names itself and the directory.
    let t = tempfile::tempdir().unwrap();
    let open = t.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o750)).unwrap();
    let e = SourcePartCache::open(&open, 1).unwrap_err().to_string();
    assert!(e.contains("source cache directory has mode 750"), "{e}");
    assert!(e.contains(&*open.to_string_lossy()), "{e}");
}

#[test]
fn temporaries_of_dead_writers_are_removed_at_open() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("sc");
    let c = open_cache(&dir, 1 << 20);
    let name = key("v", 0).file_name();
    let dead = format!(".tmp.{name}.999999999.0");
    let alive = format!(".tmp.{name}.{}.7", std::process::id());
    std::fs::write(dir.join(&dead), b"half a part").unwrap();
    std::fs::write(dir.join(&alive), b"being written").unwrap();
    // A temporary is never read as a part, but counts in the total.
    assert_eq!(c.get(&key("v", 0), 11), None);
    assert_eq!(c.stats().bytes, 11 + 13);
    drop(c);
    let _c = open_cache(&dir, 1 << 20);
    assert_eq!(names_in(&dir), vec![alive]);
}

#[test]
fn concurrent_puts_and_gets_of_one_part_are_safe() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("sc");
    let caches = [open_cache(&dir, 1 << 20), open_cache(&dir, 1 << 20)];
    let data = part(5, 64 << 10);
    std::thread::scope(|s| {
        for i in 0..8 {
            let (c, data) = (&caches[i % 2], &data);
            s.spawn(move || {
                for _ in 0..20 {
                    c.put(&key("v", 5), data);
                    // Whenever a part is there, it is whole.
                    if let Some(got) = c.get(&key("v", 5), data.len()) {
                        assert_eq!(&got[..], &data[..]);
                    }
                }
            });
        }
    });
    assert_eq!(names_in(&dir), vec![key("v", 5).file_name()]);
    let s: Vec<_> = caches.iter().map(|c| c.stats()).collect();
    assert_eq!(s[0].corrupt + s[1].corrupt, 0);
    assert_eq!(s[0].write_failures + s[1].write_failures, 0);
    assert!(s[0].writes + s[1].writes >= 1);
}

#[test]
fn write_failures_are_counted_not_fatal() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("sc");
    let c = open_cache(&dir, 1 << 20);
    // A directory under a part's name: the rename onto it fails.
    std::fs::create_dir(path_of(&c, &key("v", 0))).unwrap();
    c.put(&key("v", 0), b"abc");
    c.put(&key("v", 0), b"abc");
    let s = c.stats();
    assert_eq!((s.write_failures, s.writes, s.bytes), (2, 0, 0));
    // No temporary left behind; other parts are still written.
    assert_eq!(names_in(&dir).len(), 1);
    c.put(&key("v", 1), b"abc");
    assert_eq!(c.get(&key("v", 1), 3).as_deref(), Some(&b"abc"[..]));
}

use std::os::unix::fs::{FileExt, PermissionsExt};

use super::*;
use crate::source::FileTime;

fn src(path: &str, size: u64, mtime: i64) -> SourceId {
    SourceId {
        path: path.to_string(),
        version: SourceVersion {
            dev: 1,
            ino: 7,
            size,
            mtime: FileTime {
                secs: mtime,
                nanos: 0,
            },
            ctime: FileTime {
                secs: mtime,
                nanos: 0,
            },
        },
    }
}

fn key(s: &SourceId, what: &str) -> EntryKey {
    EntryKey::new(std::slice::from_ref(s), json!({ "tensor": what }))
}

/// A build that writes `bytes` and returns their CRC-32.
fn writes(bytes: &[u8]) -> impl FnOnce(&File) -> Result<u32> + '_ {
    move |f: &File| {
        f.write_all_at(bytes, 0).unwrap();
        Ok(crc32fast::hash(bytes))
    }
}

fn read_all(e: &Entry) -> Vec<u8> {
    let mut v = vec![0u8; e.size as usize];
    e.file.read_exact_at(&mut v, 0).unwrap();
    v
}

fn store(dir: &Path, limit: u64) -> DecodedStore {
    DecodedStore::open(dir, Some(limit)).unwrap()
}

#[test]
fn builds_once_then_hits_and_other_versions_are_other_entries() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("dc");
    let s = store(&dir, 1 << 20);
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    let v1 = src("/m/a.gguf", 100, 1);
    let (e, found) = s.get_or_build(&key(&v1, "t"), 5, writes(b"hello")).unwrap();
    assert_eq!((found, read_all(&e)), (Found::Built, b"hello".to_vec()));
    let data = dir.join(format!("{}.data", e.name));
    assert_eq!(
        std::fs::metadata(&data).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let (e2, found) = s
        .get_or_build(&key(&v1, "t"), 5, |_| panic!("must not build again"))
        .unwrap();
    assert_eq!((found, read_all(&e2)), (Found::Hit, b"hello".to_vec()));
    // Another mount (a new store object) checks the entry once, then hits.
    let s2 = store(&dir, 1 << 20);
    let (_, found) = s2.get_or_build(&key(&v1, "t"), 5, |_| panic!()).unwrap();
    assert_eq!(found, Found::Hit);
    assert_eq!(s2.stats().checks, 1);
    // A changed source is another key: built anew.
    let v2 = src("/m/a.gguf", 100, 2);
    let (e3, found) = s.get_or_build(&key(&v2, "t"), 5, writes(b"HELLO")).unwrap();
    assert_eq!((found, read_all(&e3)), (Found::Built, b"HELLO".to_vec()));
    assert_ne!(e3.name, e.name);
    // ... and at the next mount, the old version's entry is removed (unless
    // open: close ours first).
    drop((e, e2, e3));
    assert_eq!(
        store(&dir, 1 << 20).evict_changed(std::slice::from_ref(&v2)),
        1
    );
    assert_eq!(s.stats().entries, 1);
    let (_, found) = s.get_or_build(&key(&v2, "t"), 5, |_| panic!()).unwrap();
    assert_eq!(found, Found::Hit);
}

#[test]
fn a_corrupted_or_truncated_entry_is_rebuilt_not_served() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("dc");
    let v = src("/m/a.gguf", 100, 1);
    let name = {
        let s = store(&dir, 1 << 20);
        let (e, _) = s.get_or_build(&key(&v, "t"), 5, writes(b"hello")).unwrap();
        e.name.clone()
    };
    let data = dir.join(format!("{name}.data"));
    std::fs::write(&data, b"jello").unwrap();
    let s = store(&dir, 1 << 20);
    let (e, found) = s.get_or_build(&key(&v, "t"), 5, writes(b"hello")).unwrap();
    assert_eq!((found, read_all(&e)), (Found::Built, b"hello".to_vec()));
    assert_eq!(s.stats().corrupt, 1);
    drop(e);
    std::fs::write(&data, b"hell").unwrap();
    let s = store(&dir, 1 << 20);
    let (e, found) = s.get_or_build(&key(&v, "t"), 5, writes(b"hello")).unwrap();
    assert_eq!((found, read_all(&e)), (Found::Built, b"hello".to_vec()));
}

#[test]
fn failed_builds_and_dead_writers_leave_nothing_behind() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("dc");
    let s = store(&dir, 1 << 20);
    let v = src("/m/a.gguf", 100, 1);
    let r = s.get_or_build(&key(&v, "t"), 5, |_| {
        Err(err(ErrorKind::Checksum, "bad block"))
    });
    assert!(r.is_err());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // A temporary of a process that is gone (kill -9 mid-decode), and a
    // data file whose sidecar was never written: neither is served.
    let stem = key(&v, "t").name().to_string();
    std::fs::write(dir.join(format!(".tmp.{stem}.999999999.0.data")), b"hel").unwrap();
    std::fs::write(dir.join(format!("{stem}.data")), b"hello").unwrap();
    let s = store(&dir, 1 << 20);
    assert!(!dir.join(format!(".tmp.{stem}.999999999.0.data")).exists());
    let (e, found) = s.get_or_build(&key(&v, "t"), 5, writes(b"HELLO")).unwrap();
    assert_eq!((found, read_all(&e)), (Found::Built, b"HELLO".to_vec()));
}

#[test]
fn eviction_is_lru_by_size_and_spares_open_entries() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("dc");
    let s = store(&dir, 10);
    let v = src("/m/a.gguf", 100, 1);
    let (a, _) = s.get_or_build(&key(&v, "a"), 4, writes(b"aaaa")).unwrap();
    let (b, _) = s.get_or_build(&key(&v, "b"), 4, writes(b"bbbb")).unwrap();
    drop(b);
    // `a` is open: making room for `c` evicts `b`, not `a`.
    let (c, _) = s.get_or_build(&key(&v, "c"), 4, writes(b"cccc")).unwrap();
    assert_eq!(s.stats().evictions, 1);
    assert_eq!(read_all(&a), b"aaaa");
    // Nothing can go while both are open: `d` is refused, not squeezed in.
    let e = s
        .get_or_build(&key(&v, "d"), 4, writes(b"dddd"))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TooLarge);
    assert!(s.stats().bytes <= 10);
    // Larger than the limit: never stored.
    drop((a, c));
    let e = s
        .get_or_build(&key(&v, "e"), 11, writes(&[0; 11]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TooLarge);
    // Least recently used goes first: use `a` again, then `d` evicts `c`.
    let (a, found) = s.get_or_build(&key(&v, "a"), 4, |_| panic!()).unwrap();
    assert_eq!(found, Found::Hit);
    drop(a);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let (_d, _) = s.get_or_build(&key(&v, "d"), 4, writes(b"dddd")).unwrap();
    let (_, found) = s.get_or_build(&key(&v, "a"), 4, |_| panic!()).unwrap();
    assert_eq!(found, Found::Hit);
    let (_, found) = s.get_or_build(&key(&v, "c"), 4, writes(b"cccc")).unwrap();
    assert_eq!(found, Found::Built);
}

#[test]
fn concurrent_requests_build_once() {
    let t = tempfile::tempdir().unwrap();
    let s = store(&t.path().join("dc"), 1 << 20);
    let v = src("/m/a.gguf", 100, 1);
    let builds = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..8 {
            sc.spawn(|| {
                let (e, _) = s
                    .get_or_build(&key(&v, "t"), 5, |f| {
                        builds.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        writes(b"hello")(f)
                    })
                    .unwrap();
                assert_eq!(read_all(&e), b"hello");
            });
        }
    });
    assert_eq!(builds.load(Ordering::Relaxed), 1);
}

#[test]
fn unsafe_directories_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let open = t.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = DecodedStore::open(&open, Some(1)).unwrap_err();
    assert!(e.to_string().contains("mode 777"), "{e}");
    let real = t.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = t.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let e = DecodedStore::open(&link, Some(1)).unwrap_err();
    assert!(e.to_string().contains("symlink"), "{e}");
    // An entry planted as a symlink is not followed.
    let s = store(&real, 1 << 20);
    let v = src("/m/a.gguf", 100, 1);
    let k = key(&v, "t");
    let target = t.path().join("secret");
    std::fs::write(&target, b"hello").unwrap();
    std::os::unix::fs::symlink(&target, real.join(format!("{}.data", k.name()))).unwrap();
    assert!(s.lookup(&k, 5).is_none());
}

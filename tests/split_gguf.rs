//! Split GGUF sets written by gguf-py's own `GGUFWriter(split_max_tensors=
//! ...)` (the real tool; `small_first_shard=True` for a metadata-only first
//! shard, as llama-gguf-split's `--no-tensor-first-split`): SmolLM2 read
//! with gguf-py and written split into 3 shards, tensor data unchanged.
//! Any shard's path, and the directory, open the whole model: every tensor
//! and every view equals a mount of the unsplit file. A missing, extra,
//! duplicated or foreign shard and mismatched counts are refused, naming
//! the shard. Over HTTP each shard is its own object. The CLI commands take
//! a set.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::http_server::Server;
use common::mount::{Mounted, fuse_available, mount_bin, mountpoint};
use common::*;
use rknot::backend::{Role, open_single};

/// Read a GGUF with gguf-py and write it again with gguf-py's writer, split
/// (argv: source, output path, split_max_tensors, small_first_shard 0/1):
/// every metadata key as read (the writer adds general.architecture
/// itself, first, where the source has it too), every tensor's stored
/// bytes as they are ([`WRITE_AND_LIST`] writes them).
const SPLIT_WRITER: &str = r#"
import sys, gguf
src, out, per, small = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents(),
                    split_max_tensors=per, small_first_shard=small)
for f in r.fields.values():
    if f.name.startswith("GGUF.") or f.name == "general.architecture":
        continue
    vt = f.types[0]
    sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
for t in r.tensors:
    w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
"#;

/// A tiny model written split by gguf-py (argv: output path, tensors,
/// split_max_tensors, a value that makes its data its own).
const TINY_WRITER: &str = r#"
import sys, numpy as np, gguf
out, n, per, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
w = gguf.GGUFWriter(out, "llama", split_max_tensors=per)
w.add_name("tiny %g" % seed)
for i in range(n):
    w.add_tensor("blk.%d.ffn_norm.weight" % i, np.arange(8, dtype=np.float32) * seed + i)
"#;

/// How both writers end: the files written, their paths printed.
const WRITE_AND_LIST: &str = r#"
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("\n".join(str(p) for p in w.format_shard_names(w.path)))
"#;

/// Run a writer script; the shard paths it wrote.
fn run_python(writer: &str, args: &[&str]) -> Option<Vec<PathBuf>> {
    let args: Vec<&Path> = args.iter().map(Path::new).collect();
    let out = python(&format!("{writer}{WRITE_AND_LIST}"), &args)?;
    Some(out.lines().map(PathBuf::from).collect())
}

/// SmolLM2 split by gguf-py into 3 shards in `dir` (`smol-0000k-of-00003`).
fn split_smollm2(model: &Path, dir: &Path, small_first: bool) -> Option<Vec<PathBuf>> {
    let out = dir.join("smol.gguf");
    // 272 tensors: 91 + 91 + 90, or a metadata-only shard then 136 + 136.
    let per = if small_first { "136" } else { "91" };
    let flag = if small_first { "1" } else { "0" };
    let shards = run_python(SPLIT_WRITER, &[model.to_str()?, out.to_str()?, per, flag])?;
    assert_eq!(shards.len(), 3, "{shards:?}");
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(
            s.file_name().unwrap().to_str().unwrap(),
            format!("smol-{:05}-of-00003.gguf", i + 1)
        );
    }
    Some(shards)
}

/// SmolLM2, a temporary directory and SmolLM2 split into it.
fn smollm2_split(small_first: bool) -> Option<(PathBuf, tempfile::TempDir, Vec<PathBuf>)> {
    let model = smollm2()?;
    let dir = tempfile::tempdir().unwrap();
    let shards = split_smollm2(&model, dir.path(), small_first)?;
    Some((model, dir, shards))
}

/// Every tensor's name, from the unsplit file.
fn tensor_names(model: &Path) -> Vec<String> {
    let b = open_single(model, Role::Primary).unwrap();
    b.tensors()
        .entries()
        .iter()
        .map(|t| t.name.dot.clone())
        .collect()
}

/// sha256 of every tensor's `.f32` file in a mount, in `names`' order.
fn mounted_tensor_hashes(m: &Mounted, names: &[String]) -> Vec<String> {
    names
        .iter()
        .map(|n| sha256_hex(&std::fs::read(m.path(&format!("{n}.f32"))).unwrap()))
        .collect()
}

/// sha256 of every file of a mount's views (model.gguf, model.native.gguf,
/// model.safetensors and everything under hf/), by name.
fn view_hashes(m: &Mounted) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for v in ["model.gguf", "model.native.gguf", "model.safetensors"] {
        out.push((
            v.to_string(),
            sha256_hex(&std::fs::read(m.path(v)).unwrap()),
        ));
    }
    for name in listing(&m.path("hf")) {
        let p = m.path("hf").join(&name);
        out.push((format!("hf/{name}"), sha256_hex(&std::fs::read(p).unwrap())));
    }
    out
}

needs! { [fuse, model]
/// Every shard's path and the directory of a set (plain, and with a
/// metadata-only first shard) mount the whole model: every tensor equals
/// the unsplit file's, bit for bit; the root lists the same entries; the
/// views (model.gguf, model.safetensors, hf/) are byte-identical to the
/// unsplit file's (gguf-py keeps the key and tensor order, and the split
/// keys are dropped).
fn every_shard_and_the_directory_mount_the_whole_model() {
    assert!(fuse_available());
    let model = smollm2().unwrap();
    let names = tensor_names(&model);
    assert_eq!(names.len(), 272);
    let (want_tensors, want_views, want_listing) = {
        let m = Mounted::new(&model, &[]);
        (mounted_tensor_hashes(&m, &names), view_hashes(&m), listing(&m.mp))
    };
    for small_first in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let Some(shards) = split_smollm2(&model, dir.path(), small_first) else {
            return;
        };
        let mut sources: Vec<PathBuf> = shards.clone();
        sources.push(dir.path().to_path_buf());
        for (i, src) in sources.iter().enumerate() {
            let m = Mounted::new(src, &[]);
            let what = format!("{} (small first shard: {small_first})", src.display());
            assert_eq!(listing(&m.mp), want_listing, "{what}");
            assert!(
                mounted_tensor_hashes(&m, &names) == want_tensors,
                "{what}: a tensor differs from the unsplit file's"
            );
            let index: serde_json::Value =
                serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
            assert_eq!(index["tensors"].as_array().map(Vec::len), Some(272), "{what}");
            // The views once per set: every mount of it is the same backend.
            if i == 1 {
                assert_eq!(view_hashes(&m), want_views, "{what}");
            }
        }
    }
}
}

/// `rknot ARGS`, checked to succeed; its stdout.
fn rknot_ok(args: &[&str]) -> String {
    let o = run_rknot(args);
    assert!(
        o.status.success(),
        "rknot {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

needs! { [model]
/// inspect, cat, verify, manifest (+ verify --manifest), encode knot and
/// probe take any shard of a set and see the whole model.
fn the_cli_takes_a_split_set() {
    let Some((model, dir, shards)) = smollm2_split(true) else {
        return;
    };
    let (single, shard2) = (model.to_str().unwrap(), shards[1].to_str().unwrap());
    // inspect: the whole set, named as such, the metadata without split keys.
    let text = rknot_ok(&["inspect", shard2]);
    assert!(text.contains("split set of 3 shards"), "{text}");
    assert!(!text.contains("split.count"), "{text}");
    let json = |p: &str| -> serde_json::Value {
        serde_json::from_str(&rknot_ok(&["inspect", "--json", p])).unwrap()
    };
    let (mut a, mut b) = (json(single), json(shard2));
    // Every tensor's source is named by the file opened (the set by its
    // first shard): all else is the unsplit file's.
    for t in [&mut a, &mut b].into_iter().flat_map(|j| j["tensors"].as_array_mut().unwrap()) {
        t["source"]["path"].take();
    }
    assert!(a["tensors"] == b["tensors"], "the tensor tables differ");
    assert_eq!(a["metadata"], b["metadata"], "the metadata differs");
    // cat: a tensor of each shard, decoded as from the unsplit file.
    for t in ["token_embd.weight", "blk.15.ffn_up.weight", "output_norm.weight"] {
        let (x, y) = (run_rknot(&["cat", single, t]), run_rknot(&["cat", shard2, t]));
        assert!(x.status.success() && y.status.success(), "{t}");
        assert!(x.stdout == y.stdout, "{t} differs");
    }
    // verify: every tensor decodes; the same parameters; every shard's bytes.
    let v: serde_json::Value =
        serde_json::from_str(&rknot_ok(&["verify", shard2, "--json"])).unwrap();
    let v1: serde_json::Value =
        serde_json::from_str(&rknot_ok(&["verify", single, "--json"])).unwrap();
    assert_eq!(v["parameters"], v1["parameters"], "{v}");
    let set_bytes: u64 = shards.iter().map(|s| s.metadata().unwrap().len()).sum();
    assert_eq!(v["file_bytes"].as_u64(), Some(set_bytes), "{v}");
    // inspect's size counts every shard's bytes over the set's parameters.
    assert_eq!(b["source"]["file_bytes"].as_u64(), Some(set_bytes), "{}", b["source"]);
    assert_eq!(b["source"]["parameters"], a["source"]["parameters"], "{}", b["source"]);
    // manifest: every shard's lines (whole, header, its tensors), which
    // verify --manifest and sha256sum -c accept.
    let sums = dir.path().join("smol.sums");
    rknot_ok(&["manifest", shard2, "-o", sums.to_str().unwrap()]);
    let text = std::fs::read_to_string(&sums).unwrap();
    for s in &shards {
        let name = s.file_name().unwrap().to_str().unwrap();
        assert!(text.contains(&format!("  {name}\n")), "no whole-file line for {name}");
    }
    let tensor_lines = text.lines().filter(|l| l.contains(".gguf//tensor/")).count();
    assert_eq!(tensor_lines, 272, "{text:.2000}");
    rknot_ok(&["verify", "--manifest", sums.to_str().unwrap(), shard2]);
    let sha = Command::new("sha256sum")
        .args(["-c", "--ignore-missing", "--quiet", "smol.sums"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(sha.status.success(), "{}", String::from_utf8_lossy(&sha.stdout));
    // encode knot: the same dense .knot as from the unsplit file.
    let (k1, k2) = (dir.path().join("a.knot"), dir.path().join("b.knot"));
    rknot_ok(&["encode", "knot", single, "-o", k1.to_str().unwrap()]);
    rknot_ok(&["encode", "knot", shard2, "-o", k2.to_str().unwrap()]);
    assert!(
        std::fs::read(&k1).unwrap() == std::fs::read(&k2).unwrap(),
        "encode knot of the set differs from that of the unsplit file"
    );
    // probe: the model runs.
    assert_probe_answers_paris(&shards[2]);
}
}

/// Write a tiny set of `n` tensors, `per` per shard, in `dir` as
/// `PREFIX-0000k-of-0000N.gguf`.
fn tiny_set(dir: &Path, prefix: &str, n: u32, per: u32, seed: f32) -> Option<Vec<PathBuf>> {
    let out = dir.join(format!("{prefix}.gguf"));
    run_python(
        TINY_WRITER,
        &[
            out.to_str()?,
            &n.to_string(),
            &per.to_string(),
            &seed.to_string(),
        ],
    )
}

/// `rknot inspect PATH` fails, naming `shard` and saying `why`.
fn assert_refused(path: &Path, shard: &str, why: &str) {
    let o = run_rknot(&["inspect", path.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "{} opened: {}",
        path.display(),
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(
        e.contains(shard),
        "{}: the error does not name {shard}: {e}",
        path.display()
    );
    assert!(e.contains(why), "{}: {e}", path.display());
}

#[test]
fn broken_sets_are_refused_naming_the_shard() {
    let make = || -> Option<(tempfile::TempDir, Vec<PathBuf>)> {
        let dir = tempfile::tempdir().unwrap();
        let shards = tiny_set(dir.path(), "tiny", 3, 1, 1.0)?;
        assert_eq!(shards.len(), 3);
        Some((dir, shards))
    };
    let Some((dir, shards)) = make() else { return };
    // The good set opens, from each shard.
    for s in &shards {
        let text = rknot_ok(&["inspect", s.to_str().unwrap()]);
        assert!(text.contains("split set of 3 shards"), "{text}");
    }
    // Missing: from either side of the gap, and through the directory.
    std::fs::remove_file(&shards[1]).unwrap();
    for p in [&shards[0], &shards[2], &dir.path().to_path_buf()] {
        assert_refused(p, "tiny-00002-of-00003.gguf", "is missing");
    }
    // Duplicated: shard 1's bytes under shard 2's name.
    let (dir, shards) = make().unwrap();
    std::fs::copy(&shards[0], &shards[1]).unwrap();
    assert_refused(&shards[2], "tiny-00002-of-00003.gguf", "split.no is 0");
    // Extra: a fourth shard of the same name next to the set.
    let (dir2, shards2) = make().unwrap();
    std::fs::copy(&shards2[2], dir2.path().join("tiny-00004-of-00004.gguf")).unwrap();
    assert_refused(&shards2[0], "tiny-00004-of-00004.gguf", "extra shard");
    // Foreign: shard 2 of another model's 3-shard set (6 tensors).
    let (dir3, shards3) = make().unwrap();
    let other = tempfile::tempdir().unwrap();
    let foreign = tiny_set(other.path(), "tiny", 6, 2, 7.0).unwrap();
    assert_eq!(foreign.len(), 3);
    std::fs::copy(&foreign[1], &shards3[1]).unwrap();
    assert_refused(
        &shards3[0],
        "tiny-00002-of-00003.gguf",
        "split.tensors.count is 6",
    );
    // Mismatched counts: shard 2 of a 4-shard set renamed into the set.
    let (dir4, shards4) = make().unwrap();
    let four = tiny_set(other.path(), "four", 4, 1, 3.0).unwrap();
    std::fs::copy(&four[1], &shards4[1]).unwrap();
    assert_refused(&shards4[2], "tiny-00002-of-00003.gguf", "split.count is 4");
    // A shard whose name is not a shard's cannot find its set.
    let lone = dir4.path().join("renamed.gguf");
    std::fs::copy(&shards4[0], &lone).unwrap();
    assert_refused(&lone, "renamed.gguf", "PREFIX-NNNNN-of-NNNNN.gguf");
    // A directory of two sets: the user names the file.
    let o = run_rknot(&["inspect", other.path().to_str().unwrap()]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("more than one model"),
        "{e}"
    );
    drop((dir, dir3));
}

needs! { [fuse]
/// A broken set does not mount: rknot-mount exits with the error naming
/// the shard, nothing mounted.
fn a_broken_set_does_not_mount() {
    assert!(fuse_available());
    let dir = tempfile::tempdir().unwrap();
    let Some(shards) = tiny_set(dir.path(), "tiny", 3, 1, 1.0) else {
        return;
    };
    std::fs::remove_file(&shards[2]).unwrap();
    let (_mdir, mp) = mountpoint();
    let mut child = Command::new(mount_bin())
        .arg(&shards[1])
        .arg(&mp)
        .arg("--foreground")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let _ = Command::new("fusermount3").arg("-u").arg(&mp).status();
            panic!("rknot-mount of a broken set did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("tiny-00003-of-00003.gguf") && err.contains("missing"), "{err}");
    assert!(!common::mount::is_mounted(&mp));
}
}

needs! { [fuse, model]
/// Over HTTP each shard is its own object, found from shard 2's URL by
/// name and pinned on its own: the mount serves every tensor of the whole
/// model, `rknot cat` of the URL decodes as the local file, and a set
/// missing an object is refused naming its URL.
fn a_split_set_over_http() {
    assert!(fuse_available());
    let Some((model, _dir, shards)) = smollm2_split(false) else {
        return;
    };
    let s = Server::start(Vec::new());
    for p in &shards {
        let name = p.file_name().unwrap().to_str().unwrap();
        s.add(&format!("set/{name}"), std::fs::read(p).unwrap());
    }
    let url = s.url("set/smol-00002-of-00003.gguf");
    let single = open_single(&model, Role::Primary).unwrap();
    let names = tensor_names(&model);
    {
        let m = Mounted::new(Path::new(&url), &[]);
        for (i, n) in names.iter().enumerate() {
            let got = std::fs::read(m.path(&format!("{n}.f32"))).unwrap();
            assert!(got == decode_bytes(single.as_ref(), n), "tensor {i} {n} differs");
        }
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
        let remote = index["remote"].as_array().cloned().unwrap_or_default();
        assert_eq!(remote.len(), 3, "each shard its own pinned object: {index:#}");
    }
    let cat = run_rknot(&["cat", &url, "blk.29.ffn_down.weight"]);
    assert!(cat.status.success(), "{}", String::from_utf8_lossy(&cat.stderr));
    assert!(cat.stdout == decode_bytes(single.as_ref(), "blk.29.ffn_down.weight"));
    // A set whose third object is not there.
    let name = shards[0].file_name().unwrap().to_str().unwrap();
    s.add(&format!("gap/{name}"), std::fs::read(&shards[0]).unwrap());
    let o = run_rknot(&["inspect", &s.url(&format!("gap/{name}"))]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a set missing two objects opened");
    assert!(e.contains("gap/smol-00002-of-00003.gguf") && e.contains("missing"), "{e}");
}
}

needs! { [fuse, model]
/// A set mounted under its manifest (every shard listed) with jobs: an
/// encoding job reads the whole model (the same .knot as the CLI makes of
/// the unsplit file), no job may overwrite a shard, and a tensor whose
/// bytes in shard 3 differ from the manifest fails its reads.
fn a_split_set_mounts_under_its_manifest_with_jobs() {
    assert!(fuse_available());
    let Some((model, dir, shards)) = smollm2_split(true) else {
        return;
    };
    let sums = dir.path().join("smol.sums");
    rknot_ok(&["manifest", shards[0].to_str().unwrap(), "-o", sums.to_str().unwrap()]);
    let want = dir.path().join("want.knot");
    rknot_ok(&["encode", "knot", model.to_str().unwrap(), "-o", want.to_str().unwrap()]);
    let names = tensor_names(&model);
    let last = names.last().unwrap();
    {
        let jobs = tempfile::tempdir().unwrap();
        let m = Mounted::new(
            &shards[2],
            &["--manifest", sums.to_str().unwrap(), "--jobs-dir", jobs.path().to_str().unwrap()],
        );
        m.command("encode knot out=set.knot").unwrap();
        let j = m.wait_job(1, &["done", "failed"], 120);
        assert_eq!(j["state"], "done", "{j}");
        assert!(
            std::fs::read(jobs.path().join("set.knot")).unwrap() == std::fs::read(&want).unwrap(),
            "the job's .knot differs from the unsplit file's"
        );
        std::fs::read(m.path(&format!("{last}.f32"))).unwrap();
        drop(m);
        // A job's output never replaces a shard.
        let m = Mounted::new(&shards[2], &["--jobs-dir", dir.path().to_str().unwrap()]);
        let line = "encode knot out=smol-00002-of-00003.gguf overwrite=1";
        assert_eq!(m.command(line), Err(libc::EINVAL), "{line}");
        assert!(m.last_error().contains("same device and inode"), "{}", m.last_error());
    }
    // One byte of the last tensor's data in shard 3, changed.
    let src = rknot::source::SourceFile::open(&shards[2]).unwrap();
    let off = rknot::format::gguf::GgufFile::read(&src).unwrap().tensor(last).unwrap().offset;
    drop(src);
    let mut bytes = std::fs::read(&shards[2]).unwrap();
    bytes[off as usize] ^= 0x40;
    std::fs::write(&shards[2], bytes).unwrap();
    let m = Mounted::new(&shards[0], &["--manifest", sums.to_str().unwrap()]);
    let e = std::fs::read(m.path(&format!("{last}.f32"))).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    std::fs::read(m.path(&format!("{}.f32", names[0]))).unwrap();
}
}

needs! { [moto]
/// Over S3 (moto) too: a set opens from its last shard's key (the others
/// found by name, each its own object), reads as the local set does, and a
/// missing object is refused naming its URL.
fn a_split_set_over_s3() {
    let dir = tempfile::tempdir().unwrap();
    let Some(shards) = tiny_set(dir.path(), "tiny", 3, 1, 2.0) else {
        return;
    };
    let s3 = common::s3::S3::start();
    s3.create_bucket("models");
    for s in &shards {
        let name = s.file_name().unwrap().to_str().unwrap();
        s3.upload(s, "models", &format!("set/{name}"));
    }
    s3.upload(&shards[0], "models", "gap/tiny-00001-of-00003.gguf");
    let rknot = |args: &[&str]| s3.command(rknot_bin()).args(args).output().unwrap();
    let url = "s3://models/set/tiny-00003-of-00003.gguf";
    let o = rknot(&["inspect", url]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("split set of 3 shards"), "{text}");
    let local = run_rknot(&["cat", shards[2].to_str().unwrap(), "blk.0.ffn_norm.weight"]);
    let remote = rknot(&["cat", url, "blk.0.ffn_norm.weight"]);
    assert!(remote.status.success(), "{}", String::from_utf8_lossy(&remote.stderr));
    assert_eq!(remote.stdout, local.stdout);
    assert_eq!(local.stdout.len(), 32);
    let o = rknot(&["inspect", "s3://models/gap/tiny-00001-of-00003.gguf"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a set missing two objects opened");
    assert!(e.contains("s3://models/gap/tiny-00002-of-00003.gguf") && e.contains("missing"), "{e}");
}
}

//! The house rules the compiler does not check: modules are layered (no
//! import cycles between the crate's top-level modules, none between the
//! files of one module), and no source file grows past the size one person
//! can own unless docs/ARCHITECTURE.md says why.
//!
//! The graph is read from the library's non-test code: every `crate::a::b`
//! and `super::x` path (including the items of a `{...}` group), resolved to
//! the deepest module that exists as a file. A module using its own parent
//! (a child using its `mod.rs`) or its own children does not count: a
//! parent owning its children is how Rust modules work. `#[cfg(test)]`
//! modules are left out (tests may use anything), as are comments.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longest source file, in lines, unless ARCHITECTURE.md names it under
/// "Files over the size limit".
const MAX_LINES: usize = 1200;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Module path of a library file (`src/fs/views/mod.rs` -> `fs::views`),
/// or None for binaries and test-only files.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?.to_string();
    if stem != "mod" && stem != "lib" {
        parts.push(stem);
    }
    if parts.last().is_some_and(|p| p == "tests") {
        return None;
    }
    Some(parts.join("::"))
}

/// The file's code without comment lines and without its inline
/// `#[cfg(test)] mod NAME { ... }` (by convention the last item of a file).
fn non_test_code(text: &str) -> String {
    let test_mod = regex::Regex::new(r"#\[cfg\(test\)\]\s*(pub(\([a-z]+\))?\s+)?mod\s+\w+\s*\{")
        .expect("regex");
    let text = match test_mod.find(text) {
        Some(m) => &text[..m.start()],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The deepest module in `modules` that `path` names, if any.
fn resolve(modules: &BTreeSet<String>, path: &[&str]) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains(m))
}

/// Module -> the modules its code uses.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let named: Vec<(String, PathBuf)> = files
        .into_iter()
        .filter_map(|f| Some((module_of(src, &f)?, f)))
        .collect();
    let modules: BTreeSet<String> = named.iter().map(|(m, _)| m.clone()).collect();
    let path_re = regex::Regex::new(
        r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)(?:::\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\})?",
    )
    .expect("regex");
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, file) in &named {
        let text = std::fs::read_to_string(file).expect("source file");
        let code = non_test_code(&text);
        let me: Vec<&str> = if module.is_empty() {
            Vec::new()
        } else {
            module.split("::").collect()
        };
        let out = edges.entry(module.clone()).or_default();
        for c in path_re.captures_iter(&code) {
            let tail: Vec<&str> = c[2].split("::").filter(|s| !s.is_empty()).collect();
            let mut base: Vec<&str> = Vec::new();
            if &c[1] == "super" {
                base.extend_from_slice(&me[..me.len().saturating_sub(1)]);
            }
            base.extend(tail);
            let mut targets = vec![base.clone()];
            if let Some(group) = c.get(3) {
                for item in group.as_str().split(',') {
                    let first = item.trim().split([' ', ':', '{']).next().unwrap_or("");
                    if !first.is_empty() && first != "self" {
                        let mut t = base.clone();
                        t.push(first);
                        targets.push(t);
                    }
                }
            }
            for t in targets {
                let Some(target) = resolve(&modules, &t) else {
                    continue;
                };
                let related = target == *module
                    || module.starts_with(&format!("{target}::"))
                    || target.starts_with(&format!("{module}::"))
                    || target.is_empty()
                    || module.is_empty();
                if !related {
                    out.insert(target);
                }
            }
        }
    }
    edges
}

/// Strongly connected components with more than one member (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

fn describe(graph: &BTreeMap<String, BTreeSet<String>>, comps: &[Vec<String>]) -> String {
    let mut out = String::new();
    for comp in comps {
        out.push_str(&format!("cycle among {comp:?}:\n"));
        for a in comp {
            for b in graph
                .get(a)
                .into_iter()
                .flatten()
                .filter(|b| comp.contains(b))
            {
                out.push_str(&format!("    {a} uses {b}\n"));
            }
        }
    }
    out
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn top_level_modules_form_layers() {
    let files = graph(&src_dir());
    let top = |m: &str| m.split("::").next().unwrap_or("").to_string();
    let mut tops: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, bs) in &files {
        let entry = tops.entry(top(a)).or_default();
        for b in bs {
            if top(b) != top(a) {
                entry.insert(top(b));
            }
        }
    }
    let found = cycles(&tops);
    assert!(
        found.is_empty(),
        "top-level modules import each other (move the shared piece below both):\n{}",
        describe(&tops, &found)
    );
}

#[test]
fn files_of_a_module_form_layers() {
    let files = graph(&src_dir());
    let found = cycles(&files);
    assert!(
        found.is_empty(),
        "modules import each other (move the shared piece below both):\n{}",
        describe(&files, &found)
    );
}

/// The checker itself: a made-up tree with a cycle through a `{...}` group
/// and a `super::` path is caught; parent/child and test-only uses are not.
#[test]
fn the_checker_sees_cycles_and_ignores_parents_and_tests() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path();
    let write = |p: &str, text: &str| {
        let path = src.join(p);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    };
    write("lib.rs", "pub mod a;\npub mod b;\n");
    write(
        "a/mod.rs",
        "mod x;\nmod y;\nuse crate::b::{Thing, other::More};\n",
    );
    write("a/x.rs", "use super::y::Y;\nuse super::Parent;\n");
    write(
        "a/y.rs",
        "// use super::x::X; (a comment)\npub struct Y;\n#[cfg(test)]\nmod tests {\n    use crate::a::x::X;\n}\n",
    );
    write("b/mod.rs", "pub mod other;\npub struct Thing;\n");
    write(
        "b/other.rs",
        "pub struct More;\nfn f() { crate::a::x::g(); }\n",
    );
    let g = graph(src);
    assert_eq!(g["a::x"], BTreeSet::from(["a::y".to_string()]));
    assert!(g["a::y"].is_empty(), "{:?}", g["a::y"]);
    assert_eq!(
        g["a"],
        BTreeSet::from(["b".to_string(), "b::other".to_string()])
    );
    assert_eq!(g["b::other"], BTreeSet::from(["a::x".to_string()]));
    // a -> b::other -> a::x: a cycle between the top-level modules a and b.
    let top = |m: &str| m.split("::").next().unwrap_or("").to_string();
    let mut tops: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, bs) in &g {
        for b in bs {
            if top(a) != top(b) {
                tops.entry(top(a)).or_default().insert(top(b));
            }
        }
    }
    assert_eq!(cycles(&tops), vec![vec!["a".to_string(), "b".to_string()]]);
    assert!(cycles(&g).is_empty());
}

/// Files over [`MAX_LINES`] lines must be named, with the reason, in
/// docs/ARCHITECTURE.md ("Files over the size limit").
#[test]
fn no_source_file_outgrows_its_owner() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let arch = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let excused: BTreeSet<&str> = arch
        .split("## Files over the size limit")
        .nth(1)
        .map(|s| s.split("\n## ").next().unwrap_or(""))
        .unwrap_or("")
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("tests"), &mut files);
    let mut over = Vec::new();
    for f in files {
        let n = std::fs::read_to_string(&f).expect("source").lines().count();
        let rel = f
            .strip_prefix(root)
            .expect("under the crate")
            .to_string_lossy()
            .into_owned();
        if n > MAX_LINES && !excused.contains(rel.as_str()) {
            over.push(format!("{rel}: {n} lines"));
        }
    }
    assert!(
        over.is_empty(),
        "files over {MAX_LINES} lines (split them by concern, or say why in docs/ARCHITECTURE.md \
         under \"Files over the size limit\"):\n{}",
        over.join("\n")
    );
}

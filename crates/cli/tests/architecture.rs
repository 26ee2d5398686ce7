//! The workspace's shape, checked from its sources: the model knows one device, every library
//! crate documents every public item, and no crate's files import each other in a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn crates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(workspace().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").exists())
        .collect();
    out.sort();
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `a::b` for `src/a/b.rs` or `src/a/b/mod.rs`; "" for the crate root.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("lib" | "main" | "mod")
    ) {
        parts.pop();
    }
    parts.join("::")
}

/// The code of a file without comments and without its trailing `#[cfg(test)] mod tests`.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(cut) => &text[..cut],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
        .collect::<String>()
        .trim_end_matches(':')
        .to_string()
}

/// Every `crate::x::y` path and every item of a `crate::{…}` group in `text`.
fn crate_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            out.extend(group[..end].split(',').map(|p| ident(p.trim())));
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

/// Items the crate root re-exports (`pub use m::Item;`, `pub use m::{A, B};`), by module.
fn reexports(root: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in root.split(';') {
        let Some(rest) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let module = rest.split("::").next().unwrap_or("").to_string();
        let items = match (rest.find('{'), rest.rfind('}')) {
            (Some(a), Some(b)) => rest[a + 1..b].to_string(),
            _ => rest.rsplit("::").next().unwrap_or("").to_string(),
        };
        for item in items.split(',') {
            let item = item.trim().split(" as ").last().unwrap_or("").trim();
            if item.starts_with(|c: char| c.is_ascii_uppercase()) {
                out.insert(item.to_string(), module.clone());
            }
        }
    }
    out
}

/// File A → file B when A's code names `crate::b…`, `super::b`, or an item the root
/// re-exports from b. A module's own children and parents are not edges.
fn import_graph(krate: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let src = krate.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let texts: BTreeMap<String, String> = files
        .iter()
        .map(|f| (module_of(&src, f), std::fs::read_to_string(f).unwrap()))
        .collect();
    let root = texts.get("").cloned().unwrap_or_default();
    let reexported = reexports(&root);
    let related = |a: &str, b: &str| {
        a == b || a.starts_with(&format!("{b}::")) || b.starts_with(&format!("{a}::"))
    };
    let mut graph = BTreeMap::new();
    for (m, text) in &texts {
        let text = code(text);
        let mut targets = BTreeSet::new();
        for path in crate_paths(&text) {
            let segs: Vec<&str> = path.split("::").collect();
            let named = (1..=segs.len())
                .rev()
                .map(|k| segs[..k].join("::"))
                .find(|t| texts.contains_key(t));
            let target = named.or_else(|| reexported.get(segs[0]).cloned());
            if let Some(t) = target.filter(|t| !t.is_empty() && !related(m, t)) {
                targets.insert(t);
            }
        }
        let parent = m.rsplit_once("::").map_or("", |(p, _)| p);
        for (i, _) in text.match_indices("super::") {
            let name = ident(&text[i + "super::".len()..]);
            let first = name.split("::").next().unwrap_or("");
            let t = if parent.is_empty() {
                first.to_string()
            } else {
                format!("{parent}::{first}")
            };
            if texts.contains_key(&t) && !related(m, &t) {
                targets.insert(t);
            }
        }
        graph.insert(m.clone(), targets);
    }
    graph
}

/// Strongly connected components of more than one file (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'g> {
        graph: &'g BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        for w in &s.graph[v] {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.stack.contains(&w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
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
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn no_crate_has_an_import_cycle_among_its_files() {
    let mut found = Vec::new();
    for krate in crates() {
        for comp in cycles(&import_graph(&krate)) {
            found.push(format!("{}: {}", krate.display(), comp.join(" <-> ")));
        }
    }
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(cycles(&graph), vec![vec!["a", "b", "c"]]);
    assert_eq!(crate_paths("use crate::{tp, Llama};"), vec!["tp", "Llama"]);
    assert_eq!(
        crate_paths("crate::moe::step::MoeStep"),
        vec!["moe::step::MoeStep"]
    );
}

#[test]
fn the_model_knows_one_device_and_libraries_document_everything() {
    let model = std::fs::read_to_string(workspace().join("crates/model/Cargo.toml")).unwrap();
    for comm in ["ferrotron-comm", "ferrotron-parallel", "mpi"] {
        assert!(!model.contains(comm), "crates/model depends on {comm}");
    }
    let mut libraries = 0;
    for krate in crates() {
        let lib = krate.join("src/lib.rs");
        if let Ok(text) = std::fs::read_to_string(&lib) {
            libraries += 1;
            assert!(
                text.contains("#![warn(missing_docs)]"),
                "{} does not enforce missing_docs",
                lib.display()
            );
        }
    }
    assert_eq!(libraries, 15, "library crates");
}

/// The command line parses, calls the libraries and prints: under 2,000 lines, and no file
/// of it reaches the kernels (the tensor crate) or the GPU (the cuda crate) itself.
#[test]
fn the_command_line_is_thin() {
    let mut files = Vec::new();
    rust_files(&workspace().join("crates/cli/src"), &mut files);
    let mut lines = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        lines += text.lines().count();
        for krate in ["ferrotron_tensor", "ferrotron_cuda"] {
            assert!(!text.contains(krate), "{} imports {krate}", file.display());
        }
    }
    assert!(lines < 2000, "crates/cli/src has {lines} lines");
}

/// Calls that read or write device memory from the host without a counted transfer: for
/// kernels and collective transports only.
const HOST_ACCESS: [&str; 11] = [
    ".host()",
    ".host_mut()",
    "from_host(",
    "from_host_mut(",
    "from_vec(",
    "to_f32_vec(",
    ".as_f32()",
    ".as_bf16()",
    "from_f32_slice(",
    "from_bf16_slice(",
    "bf16_from_f32_slice(",
];

/// The places in `text` (code, without comments or tests) that touch device memory from the
/// host.
fn host_accesses(text: &str) -> Vec<&'static str> {
    let code = code(text);
    HOST_ACCESS
        .into_iter()
        .filter(|call| code.contains(call))
        .collect()
}

#[test]
fn the_engine_reaches_device_memory_only_through_kernels_collectives_and_counted_transfers() {
    let mut checked = 0;
    for krate in ["model", "parallel", "train"] {
        let mut files = Vec::new();
        rust_files(
            &workspace().join("crates").join(krate).join("src"),
            &mut files,
        );
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let found = host_accesses(&text);
            assert!(
                found.is_empty(),
                "{} reads device memory on the host ({found:?}): use a Backend kernel, a \
                 collective, or Ledger::upload/download (counted)",
                file.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 40, "engine files checked: {checked}");
    // The check finds what it looks for.
    assert_eq!(host_accesses("let v = buf.host().to_vec();"), [".host()"]);
    assert!(host_accesses("// buf.host()\nlet x = 1;").is_empty());
}

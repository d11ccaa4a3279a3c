//! No import cycles between the agent's modules.
//!
//! Reads every file under `proxy-userspace/src`, builds the module graph from the paths the code
//! names (`use crate::a::{b, c::d}`, `crate::a::f()` in expressions and attributes, `super::` and
//! `self::` inside folders, and names brought in by `use` then used as `name::item`), and fails
//! listing every cycle with the file → file edges and the paths that make them. A module is one
//! file: `src/x.rs` is `x`, `src/d/mod.rs` is `d`, `src/d/y.rs` is `d::y`; a parent's `mod y;`
//! declaration is not an edge (that is containment, not use).
//!
//! `#[cfg(test)]` items are left out: a unit test may build its fixtures with a module above the
//! one it tests, and that is no part of the shipping picture.
//!
//! Also checks that every module opens with a `//!` comment.
//!
//! Unprivileged and fast, so it runs in the `cargo test` tier of `cargo xtask test`.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs,
    path::{Path, PathBuf},
};

/// A module path below `crate`, e.g. `["dataplane", "loader"]`; the crate root is `[]`.
type ModPath = Vec<String>;

/// Replaces comments, string and char literals by spaces (keeping newlines), so that braces and
/// paths inside them (intra-doc links like [`crate::sizing`], format strings) are not read.
fn strip(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if c == 'r'
            && matches!(next, Some('"') | Some('#'))
            && (i == 0 || !is_ident_char(b[i - 1]))
            && raw_string_hashes(&b[i + 1..]).is_some()
        {
            // r"..." or r#"..."#
            let hashes = raw_string_hashes(&b[i + 1..]).unwrap();
            let mut j = i + 1 + hashes + 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"'
                    && b[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes
                {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &ch in &b[i..j.min(b.len())] {
                blank(&mut out, ch);
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                if i < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a): only the former is blanked.
            let end = if next == Some('\\') {
                b.get(i + 3..)
                    .and_then(|r| r.iter().position(|&ch| ch == '\''))
                    .map(|p| i + 3 + p)
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    for _ in i..=e {
                        out.push(' ');
                    }
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// For `"...` or `#..#"...` after an `r`: the number of `#`s, or None if it is no raw string.
fn raw_string_hashes(rest: &[char]) -> Option<usize> {
    let n = rest.iter().take_while(|&&c| c == '#').count();
    (rest.get(n) == Some(&'"')).then_some(n)
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

fn tokens(src: &str) -> Vec<Tok> {
    let s: Vec<char> = strip(src).chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c.is_whitespace() {
            i += 1;
        } else if is_ident_char(c) {
            let start = i;
            while i < s.len() && is_ident_char(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            out.push(Tok::Ident(
                word.strip_prefix("r#").unwrap_or(&word).to_owned(),
            ));
        } else if c == ':' && s.get(i + 1) == Some(&':') {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            out.push(Tok::Punct(c));
            i += 1;
        }
    }
    out
}

/// One use of another module: the path as written, resolved to a full path below `crate`.
#[derive(Debug, Clone, PartialEq)]
struct Reference {
    /// The module (possibly an inline `mod` inside the file) the path was written in.
    from: ModPath,
    /// The full path it names, e.g. `["config", "parse_cidr"]`.
    target: ModPath,
}

/// Expands a `use` tree starting at `toks[*i]` (after the `use` keyword) up to its `;`, into
/// (full path as written, name it binds) pairs. A glob binds `*`; `self` in a group binds the
/// group's prefix.
fn use_tree(toks: &[Tok], i: &mut usize, prefix: &[String], out: &mut Vec<(Vec<String>, String)>) {
    let mut path: Vec<String> = prefix.to_vec();
    loop {
        match toks.get(*i) {
            Some(Tok::Ident(w)) if w == "as" => {
                *i += 1;
                if let Some(Tok::Ident(alias)) = toks.get(*i) {
                    *i += 1;
                    let p = strip_trailing_self(&path);
                    out.push((p, alias.clone()));
                }
                return;
            }
            Some(Tok::Ident(w)) => {
                path.push(w.clone());
                *i += 1;
            }
            Some(Tok::PathSep) => *i += 1,
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((path.clone(), "*".to_owned()));
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => use_tree(toks, i, &path, out),
                    }
                }
            }
            // `,` `}` `;` end this branch; the caller consumes them.
            _ => {
                if path.len() > prefix.len() {
                    let p = strip_trailing_self(&path);
                    let name = p.last().cloned().unwrap_or_default();
                    out.push((p, name));
                }
                return;
            }
        }
    }
}

/// `a::b::self` (from `use a::b::{self}`) names `a::b`.
fn strip_trailing_self(path: &[String]) -> Vec<String> {
    let mut p = path.to_vec();
    if p.len() > 1 && p.last().map(String::as_str) == Some("self") {
        p.pop();
    }
    p
}

/// Resolves a path written in module `here` to a full path below `crate`, or None if it names
/// something outside the crate (std, another crate, a local item).
fn resolve(
    here: &[String],
    path: &[String],
    aliases: &HashMap<String, ModPath>,
    children: &BTreeSet<String>,
) -> Option<ModPath> {
    let first = path.first()?;
    let (mut base, rest): (ModPath, &[String]) = match first.as_str() {
        "crate" => (vec![], &path[1..]),
        "self" => (here.to_vec(), &path[1..]),
        "super" => {
            let mut base = here.to_vec();
            let mut n = 0;
            while path.get(n).map(String::as_str) == Some("super") {
                base.pop()?;
                n += 1;
            }
            (base, &path[n..])
        }
        name if children.contains(name) => (here.to_vec(), path),
        name => match aliases.get(name) {
            Some(target) => (target.clone(), &path[1..]),
            None => return None,
        },
    };
    base.extend(rest.iter().filter(|s| *s != "self").cloned());
    Some(base)
}

/// Every reference to a crate path in one file whose module path is `file_mod`.
fn references(file_mod: &[String], src: &str, known: &BTreeSet<ModPath>) -> Vec<Reference> {
    let toks = tokens(src);
    let mut refs = Vec::new();
    // Module stack: (module path, brace depth its body opened at).
    let mut stack: Vec<(ModPath, usize)> = vec![(file_mod.to_vec(), 0)];
    let mut depth = 0usize;
    let mut aliases: HashMap<String, ModPath> = HashMap::new();
    // `mod x;` declarations: bare `x::` names the child module.
    let mut children: BTreeSet<String> = BTreeSet::new();
    for w in toks.windows(3) {
        if let [Tok::Ident(m), Tok::Ident(name), Tok::Punct(';')] = w
            && m == "mod"
        {
            children.insert(name.clone());
        }
    }
    let mut i = 0;
    while i < toks.len() {
        let here = stack.last().unwrap().0.clone();
        match &toks[i] {
            // #[cfg(test)] item: skip it whole.
            Tok::Punct('#')
                if toks.get(i + 1..i + 7)
                    == Some(&[
                        Tok::Punct('['),
                        Tok::Ident("cfg".into()),
                        Tok::Punct('('),
                        Tok::Ident("test".into()),
                        Tok::Punct(')'),
                        Tok::Punct(']'),
                    ]) =>
            {
                i += 7;
                skip_item(&toks, &mut i);
            }
            Tok::Ident(w) if w == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Punct('{'))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    let mut m = here.clone();
                    m.push(name.clone());
                    depth += 1;
                    stack.push((m, depth));
                    i += 3;
                } else {
                    i += 1;
                }
            }
            Tok::Ident(w) if w == "use" => {
                i += 1;
                let mut bound = Vec::new();
                use_tree(&toks, &mut i, &[], &mut bound);
                for (path, name) in bound {
                    let Some(full) = resolve(&here, &path, &aliases, &children) else {
                        continue;
                    };
                    if name == "*" {
                        // A glob brings the target's child modules into scope by name.
                        for k in known {
                            if k.len() == full.len() + 1 && k.starts_with(&full) {
                                aliases.insert(k.last().unwrap().clone(), k.clone());
                            }
                        }
                    } else {
                        aliases.insert(name, full.clone());
                    }
                    refs.push(Reference {
                        from: here.clone(),
                        target: full,
                    });
                }
            }
            Tok::Ident(w) => {
                // A path `a::b::c` in an expression, type or attribute.
                let prev_is_sep = i > 0 && toks[i - 1] == Tok::PathSep;
                let mut path = vec![w.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::PathSep) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(next)) => {
                            path.push(next.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                if !prev_is_sep
                    && path.len() > 1
                    && let Some(full) = resolve(&here, &path, &aliases, &children)
                {
                    refs.push(Reference {
                        from: here.clone(),
                        target: full,
                    });
                }
                i = j;
            }
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                if stack.len() > 1 && stack.last().unwrap().1 == depth {
                    stack.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            _ => i += 1,
        }
    }
    refs
}

/// Skips one item starting at `toks[*i]`: up to its `;`, or its `{ ... }` body if that comes first
/// (further attributes on the item are skipped with it).
fn skip_item(toks: &[Tok], i: &mut usize) {
    let mut depth = 0usize;
    let mut brackets = 0usize;
    while let Some(t) = toks.get(*i) {
        *i += 1;
        match t {
            Tok::Punct('[') => brackets += 1,
            Tok::Punct(']') => brackets = brackets.saturating_sub(1),
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return;
                }
            }
            Tok::Punct(';') if depth == 0 && brackets == 0 => return,
            _ => {}
        }
    }
}

/// The file module a (possibly inline) module path belongs to: its longest known prefix.
fn owner(known: &BTreeSet<ModPath>, path: &[String]) -> Option<ModPath> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| known.contains(p))
}

fn module_of(src_dir: &Path, file: &Path) -> ModPath {
    let rel = file.strip_prefix(src_dir).unwrap().with_extension("");
    let mut parts: ModPath = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod") | Some("lib")) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Edges between file modules: (from, to) → the paths that make the edge.
type Graph = BTreeMap<(ModPath, ModPath), BTreeSet<String>>;

fn graph(files: &[(ModPath, String)]) -> Graph {
    let known: BTreeSet<ModPath> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut g = Graph::new();
    for (m, src) in files {
        for r in references(m, src, &known) {
            let (Some(from), Some(to)) = (owner(&known, &r.from), owner(&known, &r.target)) else {
                continue;
            };
            // A module naming its own items, or a parent naming a child it contains, is no cycle
            // risk by itself; a child naming its parent (`super::Error`) is an edge like any other.
            if from == to {
                continue;
            }
            g.entry((from, to))
                .or_default()
                .insert(format!("crate::{}", r.target.join("::")));
        }
    }
    g
}

/// Strongly connected components with more than one module (Tarjan), each sorted.
fn cycles(g: &Graph) -> Vec<Vec<ModPath>> {
    let nodes: BTreeSet<&ModPath> = g.keys().flat_map(|(a, b)| [a, b]).collect();
    let nodes: Vec<&ModPath> = nodes.into_iter().collect();
    let index_of: HashMap<&ModPath, usize> =
        nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut adj = vec![Vec::new(); nodes.len()];
    for (a, b) in g.keys() {
        adj[index_of[a]].push(index_of[b]);
    }
    struct T<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(t: &mut T, v: usize) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on_stack[v] = true;
        for &w in &t.adj[v].clone() {
            match t.index[w] {
                None => {
                    visit(t, w);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on_stack[w] => t.low[v] = t.low[v].min(iw),
                _ => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let n = nodes.len();
    let mut t = T {
        adj: &adj,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: vec![],
        next: 0,
        out: vec![],
    };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(&mut t, v);
        }
    }
    let mut out: Vec<Vec<ModPath>> = t
        .out
        .into_iter()
        .map(|c| {
            let mut c: Vec<ModPath> = c.into_iter().map(|i| nodes[i].clone()).collect();
            c.sort();
            c
        })
        .collect();
    out.sort();
    out
}

fn describe(g: &Graph, cycles: &[Vec<ModPath>]) -> String {
    let name = |m: &ModPath| {
        if m.is_empty() {
            "crate".to_owned()
        } else {
            m.join("::")
        }
    };
    let mut s = String::new();
    for (n, c) in cycles.iter().enumerate() {
        let members: Vec<String> = c.iter().map(name).collect();
        s += &format!("cycle {}: {}\n", n + 1, members.join(", "));
        for ((a, b), paths) in g {
            if c.contains(a) && c.contains(b) {
                let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
                s += &format!("  {} -> {}: {}\n", name(a), name(b), paths.join(", "));
            }
        }
    }
    s
}

fn graph_of(files: &[(&str, &str)]) -> Graph {
    let files: Vec<(ModPath, String)> = files
        .iter()
        .map(|(m, src)| {
            let path = if m.is_empty() {
                vec![]
            } else {
                m.split("::").map(str::to_owned).collect()
            };
            (path, src.to_string())
        })
        .collect();
    graph(&files)
}

fn edges(g: &Graph) -> Vec<String> {
    g.keys()
        .map(|(a, b)| format!("{} -> {}", a.join("::"), b.join("::")))
        .collect()
}

#[test]
fn the_agent_modules_import_each_other_without_cycles() {
    let src_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rust_files(&src_dir, &mut paths);
    // main.rs is the binary's own crate root: its `crate::` is not the library.
    paths.retain(|p| p.file_name().is_some_and(|n| n != "main.rs"));
    let files: Vec<(ModPath, String)> = paths
        .iter()
        .map(|p| (module_of(&src_dir, p), fs::read_to_string(p).unwrap()))
        .collect();
    assert!(
        files.len() > 20,
        "read only {} files from {}",
        files.len(),
        src_dir.display()
    );
    let g = graph(&files);
    // The graph is not empty by accident of a broken parser: agent wires the stages.
    assert!(
        g.keys()
            .any(|(a, b)| a == &["agent"] && b == &["pipeline", "translate"]),
        "the parser missed agent -> pipeline::translate; edges: {:#?}",
        edges(&g)
    );
    let found = cycles(&g);
    assert!(
        found.is_empty(),
        "import cycles between modules of proxy-userspace/src:\n{}",
        describe(&g, &found)
    );
}

/// Every module opens with a `//!` comment saying what it owns (issue 11: a newcomer reads the
/// tree from those).
#[test]
fn every_module_opens_with_a_doc_comment() {
    let src_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rust_files(&src_dir, &mut paths);
    let bare: Vec<String> = paths
        .iter()
        .filter(|p| !fs::read_to_string(p).unwrap().starts_with("//!"))
        .map(|p| p.strip_prefix(&src_dir).unwrap().display().to_string())
        .collect();
    assert!(
        bare.is_empty(),
        "modules without an opening //! comment: {bare:?}"
    );
}

#[test]
fn parser_expands_nested_use_groups_across_lines() {
    let g = graph_of(&[
        (
            "a",
            "use crate::{\n    b::{self, X},\n    c::{d::{E, F as G}, H},\n};\nfn f() {}",
        ),
        ("b", ""),
        ("c", ""),
        ("c::d", ""),
    ]);
    assert_eq!(edges(&g), ["a -> b", "a -> c", "a -> c::d"]);
}

#[test]
fn parser_reads_crate_paths_in_expressions_types_and_attributes() {
    let g = graph_of(&[
        (
            "a",
            "#[arg(long, value_parser = crate::b::parse)]\nstruct S { x: crate::c::T }\n\
             fn f() -> u8 { crate::d::e::g(1) }",
        ),
        ("b", ""),
        ("c", ""),
        ("d", ""),
        ("d::e", ""),
    ]);
    assert_eq!(edges(&g), ["a -> b", "a -> c", "a -> d::e"]);
}

#[test]
fn parser_resolves_super_self_and_children_inside_folders() {
    let g = graph_of(&[
        (
            "d",
            "pub mod x;\npub mod y;\npub struct Error;\nfn f() { y::go(); }",
        ),
        (
            "d::x",
            "use super::{Error, y};\nfn f() { y::go(); self::h(); }\nfn h() {}",
        ),
        ("d::y", "pub fn go() { super::x::h2(); }"),
    ]);
    assert_eq!(
        edges(&g),
        ["d -> d::y", "d::x -> d", "d::x -> d::y", "d::y -> d::x"]
    );
    let m = |s: &str| -> ModPath { s.split("::").map(str::to_owned).collect() };
    assert_eq!(cycles(&g), [vec![m("d"), m("d::x"), m("d::y")]]);
}

#[test]
fn parser_follows_imported_module_names() {
    let g = graph_of(&[
        (
            "a",
            "use crate::d;\nuse crate::e as ee;\nfn f() { d::x::go(); ee::go(); }",
        ),
        ("d", ""),
        ("d::x", ""),
        ("e", ""),
    ]);
    assert_eq!(edges(&g), ["a -> d", "a -> d::x", "a -> e"]);
}

#[test]
fn parser_ignores_comments_strings_other_crates_and_test_items() {
    let g = graph_of(&[
        (
            "a",
            "//! See [`crate::b`].\n/* crate::c::x */\nuse std::io;\nuse kube::Api;\n\
             fn f() { let s = \"crate::c::y {\"; let c = '{'; let r = r#\"crate::c\"#; io::stdout(); }\n\
             fn g<'a>(x: &'a str) -> &'a str { x }\n\
             #[cfg(test)]\nmod tests { use super::*; use crate::c::Z; fn t() { crate::b::w(); } }\n\
             #[cfg(test)]\nuse crate::b::Q;\n\
             fn h() { crate::d::k(); }",
        ),
        ("b", ""),
        ("c", ""),
        ("d", ""),
    ]);
    assert_eq!(edges(&g), ["a -> d"]);
}

#[test]
fn cycle_report_names_the_modules_and_the_paths() {
    let g = graph_of(&[
        ("a", "use crate::b::X;"),
        ("b", "fn f() { crate::a::y(); }"),
        ("c", "use crate::a::Z;"),
    ]);
    let found = cycles(&g);
    assert_eq!(
        describe(&g, &found),
        "cycle 1: a, b\n  a -> b: crate::b::X\n  b -> a: crate::a::y\n"
    );
}

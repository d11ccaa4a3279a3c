//! Standalone source: a folder of Service and EndpointSlice manifests.
//!
//! Every `*.yaml`, `*.yml` and `*.json` file directly in the folder is read, in name order (not
//! recursive: subfolders are ignored). A YAML file may hold several documents separated by
//! `---`; a JSON file may hold several concatenated values. Each document is dispatched on
//! apiVersion/kind: `v1 Service`, `discovery.k8s.io/v1 EndpointSlice`, and lists of them
//! (`v1 List`, `v1 ServiceList`, `discovery.k8s.io/v1 EndpointSliceList`). A document that cannot
//! be read is reported as a [`Problem`] and skipped; the rest of the file and the other files
//! still load.

use std::{
    collections::{HashMap, hash_map::Entry},
    fs,
    hash::{DefaultHasher, Hash, Hasher},
    io,
    path::{Path, PathBuf},
    sync::Arc,
    time::UNIX_EPOCH,
};

use k8s_openapi::{
    Resource,
    api::{core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{
    pipeline::model::Problem,
    sources::{endpoints::SliceData, names::Name, services::ServiceData, snapshot::Snapshot},
};

/// File name endings read from the folder.
const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// The result of reading a folder: what loaded, and what was skipped and why.
#[derive(Clone, Debug, Default)]
pub struct ManifestLoad {
    pub snapshot: Snapshot,
    pub problems: Vec<Problem>,
}

/// Read every manifest file in `dir` (see the module docs). Never fails as a whole: an unreadable
/// folder or file is a [`Problem`] like any bad document.
pub fn load_dir(dir: &Path) -> ManifestLoad {
    let mut load = Loader::default();
    match manifest_files(dir) {
        Ok(files) => {
            for (file, parsed) in files.iter().zip(parse_files(&files)) {
                load.merge(file, parsed);
            }
        }
        Err(e) => load.problem(dir, "directory", format!("cannot list manifest files: {e}")),
    }
    load.out
}

/// Each file loaded on its own, on every CPU at once (parsing is most of a large folder's
/// load), returned in the order of `files`.
fn parse_files(files: &[PathBuf]) -> Vec<Loader> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(files.len());
    if threads <= 1 {
        return files.iter().map(|f| Loader::of_file(f)).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut parsed: Vec<(usize, Loader)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(file) = files.get(i) else {
                            return mine;
                        };
                        mine.push((i, Loader::of_file(file)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    parsed.sort_unstable_by_key(|(i, _)| *i);
    parsed.into_iter().map(|(_, l)| l).collect()
}

/// A cheap change detector for `dir`: a hash of the names, sizes and modification times (ns) of
/// the manifest files. Poll it and reload when it changes. An unreadable folder has a fingerprint
/// of its own, so it changing back to readable is noticed too.
pub fn fingerprint(dir: &Path) -> u64 {
    let mut h = DefaultHasher::new();
    match manifest_files(dir) {
        Ok(files) => {
            for file in files {
                file.hash(&mut h);
                match fs::metadata(&file) {
                    Ok(meta) => {
                        meta.len().hash(&mut h);
                        // A clock before the epoch hashes as 0 — still stable between polls.
                        let mtime = meta
                            .modified()
                            .ok()
                            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                            .map_or(0, |d| d.as_nanos());
                        mtime.hash(&mut h);
                    }
                    Err(e) => e.kind().hash(&mut h),
                }
            }
        }
        Err(e) => {
            "unreadable".hash(&mut h);
            e.kind().hash(&mut h);
        }
    }
    h.finish()
}

/// The manifest files directly in `dir`, sorted by path.
fn manifest_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let wanted = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| EXTENSIONS.contains(&e));
        if wanted && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

#[derive(Default)]
struct Loader {
    out: ManifestLoad,
    /// (Service?, namespace, name) of each object loaded → the index in `files` of the file it
    /// was first loaded from, to report duplicates. The names are the loaded objects' own
    /// `Arc`s and the file an index: no string per object is allocated while the folder loads
    /// (at 50,000 Services such strings, freed after the load, left holes among the objects'
    /// allocations that stayed resident: 3–6 MiB of RSS, depending on the folder's path length).
    seen: HashMap<(bool, Name, Name), u32>,
    /// The files read so far, in order.
    files: Vec<String>,
}

impl Loader {
    /// One file loaded on its own (duplicates within it reported).
    fn of_file(path: &Path) -> Loader {
        let mut loader = Loader::default();
        loader.file(path);
        loader
    }

    /// Appends what `file` loaded on its own ([`Loader::of_file`]) after the files before it:
    /// its problems, and its objects but those an earlier file already loaded (reported).
    fn merge(&mut self, file: &Path, parsed: Loader) {
        let ManifestLoad { snapshot, problems } = parsed.out;
        self.out.problems.extend(problems);
        if parsed.files.is_empty() {
            // Unreadable: nothing loaded, the problem says why.
            return;
        }
        self.files.push(file.display().to_string());
        for svc in snapshot.services.iter() {
            if self.first_copy::<Service>(file, &svc.namespace, &svc.name) {
                Arc::make_mut(&mut self.out.snapshot.services).push(svc.clone());
            }
        }
        for slice in snapshot.endpoint_slices.iter() {
            if self.first_copy::<EndpointSlice>(file, &slice.namespace, &slice.name) {
                Arc::make_mut(&mut self.out.snapshot.endpoint_slices).push(slice.clone());
            }
        }
    }

    fn problem(&mut self, source: &Path, object: impl Into<String>, reason: impl Into<String>) {
        self.out.problems.push(Problem {
            source: source.display().to_string(),
            object: object.into(),
            reason: reason.into(),
        });
    }

    fn file(&mut self, path: &Path) {
        let text = match fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) => return self.problem(path, "file", format!("cannot read: {e}")),
        };
        self.files.push(path.display().to_string());
        let is_json = path.extension().is_some_and(|e| e == "json");
        // One document at a time: only one parsed document is alive at once (a big folder's
        // peak memory is its objects, not every document's JSON tree).
        let documents: Box<dyn Iterator<Item = Result<Value, String>>> = if is_json {
            Box::new(json_documents(&text).into_iter())
        } else {
            Box::new(yaml_documents(&text))
        };
        for (n, doc) in documents.enumerate() {
            let label = format!("document {}", n + 1);
            match doc {
                Ok(Value::Null) => {} // an empty document (e.g. a trailing `---`)
                Ok(value) => self.document(path, &label, value),
                Err(reason) => self.problem(path, label, reason),
            }
        }
    }

    /// Dispatch one parsed document on apiVersion/kind.
    fn document(&mut self, path: &Path, label: &str, value: Value) {
        let field = |f: &str| {
            value
                .get(f)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let (api_version, kind) = (field("apiVersion"), field("kind"));
        match (api_version.as_str(), kind.as_str()) {
            (Service::API_VERSION, Service::KIND) => {
                if let Some(svc) = self.object::<Service>(path, label, value) {
                    let svc = ServiceData::from(&svc);
                    if self.first_copy::<Service>(path, &svc.namespace, &svc.name) {
                        Arc::make_mut(&mut self.out.snapshot.services).push(Arc::new(svc));
                    }
                }
            }
            (EndpointSlice::API_VERSION, EndpointSlice::KIND) => {
                if let Some(slice) = self.object::<EndpointSlice>(path, label, value) {
                    let slice = SliceData::from(&slice);
                    if self.first_copy::<EndpointSlice>(path, &slice.namespace, &slice.name) {
                        let slices = Arc::make_mut(&mut self.out.snapshot.endpoint_slices);
                        slices.push(Arc::new(slice));
                    }
                }
            }
            ("v1", "List" | "ServiceList") | ("discovery.k8s.io/v1", "EndpointSliceList") => {
                let items = match value {
                    Value::Object(mut map) => map.remove("items"),
                    _ => None,
                };
                match items {
                    Some(Value::Array(items)) => {
                        for (i, item) in items.into_iter().enumerate() {
                            self.document(path, &format!("{label} item {}", i + 1), item);
                        }
                    }
                    None | Some(Value::Null) => {} // an empty list
                    Some(_) => self.problem(path, label, format!("{kind}: items is not a list")),
                }
            }
            ("", _) | (_, "") => self.problem(
                path,
                label,
                "not a Kubernetes object: apiVersion or kind missing",
            ),
            _ => self.problem(
                path,
                format!("{kind} {}", object_name(&value)),
                format!(
                    "unsupported apiVersion/kind {api_version}/{kind}: only v1 Service, \
                     discovery.k8s.io/v1 EndpointSlice and lists of them are read"
                ),
            ),
        }
    }

    /// Deserialize one object, fill in the default namespace, and check it has a name.
    fn object<K>(&mut self, path: &Path, label: &str, value: Value) -> Option<K>
    where
        K: Resource + DeserializeOwned + HasMeta,
    {
        let object = format!("{} {}", K::KIND, object_name(&value));
        let mut k: K = match K::deserialize(value) {
            Ok(k) => k,
            Err(e) => {
                self.problem(path, object, format!("invalid {}: {e}", K::KIND));
                return None;
            }
        };
        let meta = k.meta_mut();
        if meta.name.as_deref().is_none_or(str::is_empty) {
            self.problem(
                path,
                format!("{} ({label})", K::KIND),
                "metadata.name is missing",
            );
            return None;
        }
        meta.namespace.get_or_insert_with(|| "default".to_owned());
        Some(k)
    }

    /// Whether the object of kind `K` named `namespace`/`name` (as converted from an object
    /// [`Loader::object`] accepted: both set) is the first of that name; a later copy is
    /// reported and skipped.
    fn first_copy<K: Resource>(
        &mut self,
        path: &Path,
        namespace: &Option<Name>,
        name: &Option<Name>,
    ) -> bool {
        let (Some(namespace), Some(name)) = (namespace, name) else {
            return true;
        };
        let file = u32::try_from(self.files.len().saturating_sub(1)).unwrap_or(u32::MAX);
        let key = (K::KIND == Service::KIND, namespace.clone(), name.clone());
        match self.seen.entry(key) {
            Entry::Occupied(first) => {
                let first = (self.files.get(*first.get() as usize)).map_or("?", |f| f.as_str());
                let reason =
                    format!("duplicate: already loaded from {first}; this copy is skipped");
                self.problem(path, format!("{} {namespace}/{name}", K::KIND), reason);
                false
            }
            Entry::Vacant(v) => {
                v.insert(file);
                true
            }
        }
    }
}

/// `ns/name` from a raw document, for messages about documents that did not deserialize.
fn object_name(value: &Value) -> String {
    let meta = value.get("metadata");
    let field = |f: &str| meta.and_then(|m| m.get(f)).and_then(Value::as_str);
    format!(
        "{}/{}",
        field("namespace").unwrap_or("default"),
        field("name").unwrap_or("?")
    )
}

/// Access to an object's metadata, for the two kinds read here.
trait HasMeta {
    fn meta_mut(&mut self) -> &mut ObjectMeta;
}

impl HasMeta for Service {
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl HasMeta for EndpointSlice {
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Split a YAML stream into documents and parse each on its own, so that a syntax error in one
/// document does not hide the others (a YAML parser stops a stream at its first error). Documents
/// start at lines beginning with `---`, which YAML reserves for that at column 0.
fn yaml_documents(text: &str) -> impl Iterator<Item = Result<Value, String>> + '_ {
    // (first line number, byte offset) of each document.
    let mut starts: Vec<(usize, usize)> = vec![(1, 0)];
    let mut offset = 0;
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let is_marker = line
            .trim_end_matches(['\n', '\r'])
            .strip_prefix("---")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(' ') || rest.starts_with('\t'));
        // A marker on the first line starts the first document (no empty one before it).
        if is_marker && offset > 0 {
            starts.push((i + 1, offset));
        }
        offset += line.len();
    }
    let ends: Vec<usize> = starts
        .iter()
        .skip(1)
        .map(|(_, o)| *o)
        .chain([text.len()])
        .collect();
    let mut chunks: Vec<(usize, &str)> = starts
        .iter()
        .zip(ends)
        .map(|((line, start), end)| (*line, &text[*start..end]))
        .collect();
    // Text before the first marker only counts as a document if it holds something.
    if chunks.len() > 1 && chunks.first().is_some_and(|(_, c)| is_blank_yaml(c)) {
        chunks.remove(0);
    }
    chunks.into_iter().map(|(line, chunk)| {
        if is_blank_yaml(chunk) {
            return Ok(Value::Null);
        }
        serde_saphyr::from_str_with_options::<Value>(chunk, yaml_options()).map_err(|e| {
            // The chunk starts at the file's line `line`: report the file's line numbers.
            // The user-facing wording (the default one suggests parser options to the caller).
            let at_file_lines = serde_saphyr::render_options! {
                formatter: &serde_saphyr::UserMessageFormatter,
                line_offset: line as u64 - 1,
                snippets: serde_saphyr::SnippetMode::Off,
            };
            format!("invalid YAML: {}", e.render_with_options(at_file_lines))
        })
    })
}

/// How manifests are read: YAML 1.2 booleans (`yes` stays a string), a repeated key keeps its
/// last value (as serde_yaml did), and no size budget beyond the depth and scalar-bytes limits
/// (the folder is the operator's own; a `List` of 50,000 Services is millions of nodes).
fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        strict_booleans: true,
        duplicate_keys: serde_saphyr::DuplicateKeyPolicy::LastWins,
        with_snippet: false,
        budget: serde_saphyr::budget! {
            max_events: usize::MAX,
            max_nodes: usize::MAX,
        },
    }
}

/// Only blank lines, comments and document markers.
fn is_blank_yaml(chunk: &str) -> bool {
    chunk.lines().all(|l| {
        let l = l.trim();
        l.is_empty() || l.starts_with('#') || l == "---" || l == "..."
    })
}

/// Parse concatenated JSON values. JSON has no document separator to resynchronise on, so a
/// syntax error ends the file (reported as the next document).
fn json_documents(text: &str) -> Vec<Result<Value, String>> {
    let mut docs = Vec::new();
    for value in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
        match value {
            Ok(v) => docs.push(Ok(v)),
            Err(e) => {
                docs.push(Err(format!(
                    "invalid JSON: {e}; the rest of the file is skipped"
                )));
                break;
            }
        }
    }
    docs
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// A fresh folder under the temp dir, removed on drop even if the test fails.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(files: &[(&str, &str)]) -> Self {
            static N: AtomicU32 = AtomicU32::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("kpe-manifests-{}-{n}", std::process::id()));
            fs::create_dir_all(&dir).expect("create temp dir");
            let t = Self(dir);
            for (name, text) in files {
                t.write(name, text);
            }
            t
        }

        fn write(&self, name: &str, text: &str) {
            fs::write(self.0.join(name), text).expect("write manifest");
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn svc_yaml(name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: ns\nspec:\n  \
             clusterIP: {ip}\n  ports:\n  - port: 80\n"
        )
    }

    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  \
                         name: a-1\n  labels: {kubernetes.io/service-name: a}\naddressType: \
                         IPv4\nendpoints:\n- addresses: [10.0.0.1]\n";

    fn names(load: &ManifestLoad) -> Vec<String> {
        let svcs = (load.snapshot.services.iter()).map(|s| (&s.namespace, &s.name));
        let slices = (load.snapshot.endpoint_slices.iter()).map(|s| (&s.namespace, &s.name));
        svcs.chain(slices)
            .map(|(namespace, name)| {
                format!(
                    "{}/{}",
                    namespace.as_deref().unwrap_or("-"),
                    name.as_deref().unwrap_or("-")
                )
            })
            .collect()
    }

    #[test]
    fn multi_document_yaml_loads_services_and_slices() {
        let text = format!(
            "---\n{}---\n{}---\n{SLICE}...\n",
            svc_yaml("a", "10.96.0.1"),
            svc_yaml("b", "10.96.0.2")
        );
        let dir = TempDir::new(&[("all.yaml", &text)]);
        let load = load_dir(&dir.0);
        assert_eq!(load.problems, []);
        assert_eq!(names(&load), ["ns/a", "ns/b", "default/a-1"]);
    }

    #[test]
    fn yaml_1_2_booleans_and_repeated_keys_read_as_before() {
        // `yes` is a string in YAML 1.2 (a bool would fail the string-valued labels map); a
        // repeated key keeps its last value.
        let text = "apiVersion: v1\nkind: Service\nmetadata:\n  name: x\n  name: y\n  \
                    namespace: ns\n  labels: {enabled: yes, off: no}\nspec:\n  clusterIP: \
                    10.96.0.7\n  ports:\n  - port: 80\n";
        let dir = TempDir::new(&[("s.yaml", text)]);
        let load = load_dir(&dir.0);
        assert_eq!(load.problems, []);
        assert_eq!(names(&load), ["ns/y"]);
    }

    #[test]
    fn missing_namespace_defaults_to_default() {
        let dir = TempDir::new(&[("s.yml", SLICE)]);
        let load = load_dir(&dir.0);
        assert_eq!(load.problems, []);
        assert_eq!(names(&load), ["default/a-1"]);
    }

    #[test]
    fn v1_list_items_are_dispatched_one_by_one() {
        let text = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  \
                    metadata: {name: a}\n  spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n- \
                    apiVersion: v1\n  kind: ConfigMap\n  metadata: {name: c}\n";
        let dir = TempDir::new(&[("list.yaml", text)]);
        let load = load_dir(&dir.0);
        assert_eq!(names(&load), ["default/a"]);
        assert_eq!(load.problems.len(), 1, "{:?}", load.problems);
        assert_eq!(load.problems[0].object, "ConfigMap default/c");
    }

    #[test]
    fn json_files_load_like_yaml() {
        let text = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j","namespace":"ns"},
                       "spec":{"clusterIP":"10.96.0.9","ports":[{"port":53,"protocol":"UDP"}]}}"#;
        let dir = TempDir::new(&[("svc.json", text)]);
        let load = load_dir(&dir.0);
        assert_eq!(load.problems, []);
        assert_eq!(names(&load), ["ns/j"]);
    }

    #[test]
    fn bad_yaml_document_is_reported_and_the_rest_still_loads() {
        let text = format!(
            "{}---\nkind: Service\nmetadata: [unclosed\n---\n{}",
            svc_yaml("a", "10.96.0.1"),
            svc_yaml("b", "10.96.0.2")
        );
        let dir = TempDir::new(&[
            ("mixed.yaml", &text),
            ("z.yaml", &svc_yaml("c", "10.96.0.3")),
        ]);
        let load = load_dir(&dir.0);
        assert_eq!(names(&load), ["ns/a", "ns/b", "ns/c"]);
        let [p] = load.problems.as_slice() else {
            panic!("one problem expected: {:?}", load.problems)
        };
        assert!(p.source.ends_with("mixed.yaml"), "{p}");
        assert_eq!(p.object, "document 2");
        // Line 12 of the file holds the unclosed `[` (document 2 starts at line 10).
        assert_eq!(
            p.reason,
            "invalid YAML: unclosed bracket '[' at line 12, column 11"
        );
    }

    #[test]
    fn bad_yaml_error_names_the_files_line_in_a_later_document() {
        // A leading marker and comments before document 1, then a bad third document: its
        // position must count every line of the file, not of the document.
        let text = format!(
            "---\n# services\n{}---\n{}---\n# the bad one\napiVersion: v1\nkind: Service\n\
             metadata:\n  name: c\n   namespace: ns\n---\n{}",
            svc_yaml("a", "10.96.0.1"),
            svc_yaml("b", "10.96.0.2"),
            svc_yaml("d", "10.96.0.4"),
        );
        let bad_line = 1 + text.lines().position(|l| l == "   namespace: ns").unwrap();
        assert_eq!(bad_line, 28);
        let dir = TempDir::new(&[("three.yaml", &text)]);
        let load = load_dir(&dir.0);
        assert_eq!(names(&load), ["ns/a", "ns/b", "ns/d"]);
        let [p] = load.problems.as_slice() else {
            panic!("one problem expected: {:?}", load.problems)
        };
        assert!(p.source.ends_with("three.yaml"), "{p}");
        assert_eq!(p.object, "document 3");
        // The over-indented line continues `c` as a plain scalar; its `:` is the error.
        assert_eq!(
            p.reason,
            "invalid YAML: mapping values are not allowed in this context at line 28, column 13"
        );
    }

    #[test]
    fn unknown_kind_is_reported_with_file_object_and_reason() {
        let text = format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: d, namespace: ns}}\n---\n{}",
            svc_yaml("a", "10.96.0.1")
        );
        let dir = TempDir::new(&[("d.yaml", &text)]);
        let load = load_dir(&dir.0);
        assert_eq!(names(&load), ["ns/a"]);
        let [p] = load.problems.as_slice() else {
            panic!("{:?}", load.problems)
        };
        assert!(p.source.ends_with("d.yaml"));
        assert_eq!(p.object, "Deployment ns/d");
        assert!(
            p.reason
                .contains("unsupported apiVersion/kind apps/v1/Deployment"),
            "{p}"
        );
    }

    #[test]
    fn missing_name_is_reported() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {namespace: ns}\nspec: {clusterIP: 10.96.0.1}\n";
        let dir = TempDir::new(&[("n.yaml", text)]);
        let load = load_dir(&dir.0);
        assert!(load.snapshot.services.is_empty());
        let [p] = load.problems.as_slice() else {
            panic!("{:?}", load.problems)
        };
        assert_eq!(p.object, "Service (document 1)");
        assert!(p.reason.contains("metadata.name"), "{p}");
    }

    #[test]
    fn document_failing_k8s_deserialization_is_reported_by_name() {
        let text = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: bad, namespace: ns}}\nspec: {{ports: \
             7}}\n---\n{}",
            svc_yaml("good", "10.96.0.1")
        );
        let dir = TempDir::new(&[("k.yaml", &text)]);
        let load = load_dir(&dir.0);
        assert_eq!(names(&load), ["ns/good"]);
        let [p] = load.problems.as_slice() else {
            panic!("{:?}", load.problems)
        };
        assert_eq!(p.object, "Service ns/bad");
        assert!(p.reason.starts_with("invalid Service"), "{p}");
    }

    #[test]
    fn missing_api_version_or_kind_is_reported() {
        let dir = TempDir::new(&[("x.yaml", "foo: bar\n")]);
        let load = load_dir(&dir.0);
        let [p] = load.problems.as_slice() else {
            panic!("{:?}", load.problems)
        };
        assert_eq!(p.object, "document 1");
    }

    #[test]
    fn a_duplicate_is_per_kind_and_namespace() {
        // A Service and a slice of one name, one name in two namespaces: no duplicates; the
        // slice again (its namespace left out: `default`) in another file is one.
        let slice_as = |name: &str| SLICE.replace("name: a-1", &format!("name: {name}"));
        let dir = TempDir::new(&[
            (
                "a.yaml",
                &format!("{}---\n{}", svc_yaml("a-1", "10.96.0.1"), slice_as("a-1")),
            ),
            (
                "b.yaml",
                &svc_yaml("a-1", "10.96.0.2").replace("ns\n", "other\n"),
            ),
            (
                "c.yaml",
                &format!("{}---\n{}", slice_as("a-1"), slice_as("a-2")),
            ),
        ]);
        let load = load_dir(&dir.0);
        assert_eq!(
            names(&load),
            ["ns/a-1", "other/a-1", "default/a-1", "default/a-2"]
        );
        let [p] = load.problems.as_slice() else {
            panic!("{:?}", load.problems)
        };
        assert_eq!(p.object, "EndpointSlice default/a-1");
        assert!(p.source.ends_with("c.yaml"), "{p}");
        assert_eq!(
            p.reason,
            format!(
                "duplicate: already loaded from {}; this copy is skipped",
                dir.0.join("a.yaml").display()
            )
        );
    }

    #[test]
    fn duplicate_object_across_files_keeps_the_first() {
        let dir = TempDir::new(&[
            ("a.yaml", &svc_yaml("s", "10.96.0.1")),
            ("b.yaml", &svc_yaml("s", "10.96.0.2")),
        ]);
        let load = load_dir(&dir.0);
        assert_eq!(load.snapshot.services.len(), 1);
        let ips = &load.snapshot.services[0].cluster_ips;
        assert_eq!(
            ips.iter().map(|ip| ip.to_string()).collect::<Vec<_>>(),
            ["10.96.0.1"]
        );
        let [p] = load.problems.as_slice() else {
            panic!("{:?}", load.problems)
        };
        assert!(
            p.source.ends_with("b.yaml") && p.reason.contains("a.yaml"),
            "{p}"
        );
    }

    #[test]
    fn other_files_and_subfolders_are_ignored() {
        let dir = TempDir::new(&[
            ("notes.txt", "not yaml: ["),
            ("a.yaml", &svc_yaml("a", "10.96.0.1")),
        ]);
        fs::create_dir(dir.0.join("sub.yaml")).expect("mkdir");
        let load = load_dir(&dir.0);
        assert_eq!(load.problems, []);
        assert_eq!(names(&load), ["ns/a"]);
    }

    #[test]
    fn missing_directory_is_a_problem_not_a_panic() {
        let load = load_dir(Path::new("/nonexistent/kube-proxy-ebpf-manifests"));
        assert_eq!(load.problems.len(), 1);
        assert_eq!(load.problems[0].object, "directory");
    }

    #[test]
    fn fingerprint_changes_with_content_and_file_set() {
        let dir = TempDir::new(&[("a.yaml", &svc_yaml("a", "10.96.0.1"))]);
        let f1 = fingerprint(&dir.0);
        assert_eq!(f1, fingerprint(&dir.0), "stable while nothing changes");
        dir.write("a.yaml", &svc_yaml("a", "10.96.0.11"));
        let f2 = fingerprint(&dir.0);
        assert_ne!(f1, f2, "size changed");
        dir.write("b.yaml", "");
        assert_ne!(f2, fingerprint(&dir.0), "file added");
        let f3 = fingerprint(&dir.0);
        dir.write("ignored.txt", "x");
        assert_eq!(f3, fingerprint(&dir.0), "non-manifest files do not count");
    }
}

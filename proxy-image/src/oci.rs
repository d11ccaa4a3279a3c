//! The image as data: a root filesystem (one layer), its OCI config, manifest and index, and the
//! image-layout archive holding them (`oci-layout`, `index.json`, `blobs/sha256/...`, plus a
//! docker-archive `manifest.json` naming the same blobs, for `docker load`/`podman load`).
//! Pure apart from the writer it is given: equal inputs give byte-identical archives.

use std::{
    collections::BTreeMap,
    io::{self, Write},
};

use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use crate::tar::{Kind, TarWriter};

pub const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// Uncompressed: the same bytes whatever the compressor's version, and the layer's digest is
/// its diff_id.
pub const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";

/// The image's PATH: the agent, and the netfilter tools it runs (rootfs::NETFILTER_TOOLS).
pub const IMAGE_PATH_ENV: &str = "PATH=/usr/local/bin:/usr/sbin";

/// The files of the image's root filesystem, kept sorted by path (parents before children).
#[derive(Clone, Debug, Default)]
pub struct Rootfs {
    entries: BTreeMap<String, (u32, Kind)>,
}

impl Rootfs {
    /// A directory (and its parents, 0755).
    pub fn dir(&mut self, path: &str, mode: u32) {
        let path = relative(path);
        self.parents(&path);
        self.entries.insert(path, (mode, Kind::Dir));
    }

    /// A regular file (and its parent directories, 0755).
    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) {
        let path = relative(path);
        self.parents(&path);
        self.entries.insert(path, (mode, Kind::File(data)));
    }

    /// A symbolic link at `path` to `target` (and its parent directories, 0755). `target` is
    /// kept as given: relative to the link's directory, or absolute in the image.
    pub fn symlink(&mut self, path: &str, target: &str) {
        let path = relative(path);
        self.parents(&path);
        self.entries
            .insert(path, (0o777, Kind::Symlink(target.to_owned())));
    }

    /// The symlinks, as (path, target).
    pub fn symlinks(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().filter_map(|(p, (_, k))| match k {
            Kind::Symlink(t) => Some((p.as_str(), t.as_str())),
            _ => None,
        })
    }

    /// The paths, in archive order.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    fn parents(&mut self, path: &str) {
        let mut at = 0;
        while let Some(i) = path[at..].find('/') {
            let parent = &path[..at + i];
            self.entries
                .entry(parent.to_owned())
                .or_insert((0o755, Kind::Dir));
            at += i + 1;
        }
    }

    /// The layer: a tar of every entry, in path order, all stamped `mtime`.
    pub fn layer(&self, mtime: u64) -> io::Result<Vec<u8>> {
        let mut tar = TarWriter::new(Vec::new(), mtime);
        for (path, (mode, kind)) in &self.entries {
            tar.append(path, *mode, kind)?;
        }
        tar.finish()
    }
}

fn relative(path: &str) -> String {
    path.trim_start_matches('/')
        .trim_end_matches('/')
        .to_owned()
}

/// What the image says about itself.
#[derive(Clone, Debug)]
pub struct ImageMeta {
    /// Repository name as the manifests use it (`kube-proxy-ebpf`).
    pub name: String,
    pub tag: String,
    /// OCI architecture (`amd64`, `arm64`).
    pub architecture: String,
    pub entrypoint: Vec<String>,
    /// The agent's version and the commit it was built from (image labels).
    pub version: String,
    pub revision: Option<String>,
    /// Seconds since the epoch for every timestamp (SOURCE_DATE_EPOCH, or 0).
    pub epoch: u64,
}

impl ImageMeta {
    /// `name:tag`.
    pub fn reference(&self) -> String {
        format!("{}:{}", self.name, self.tag)
    }

    fn labels(&self) -> Value {
        let mut labels = json!({
            "org.opencontainers.image.title": self.name,
            "org.opencontainers.image.version": self.version,
        });
        if let Some(rev) = &self.revision {
            labels["org.opencontainers.image.revision"] = json!(rev);
        }
        labels
    }
}

/// Digests and sizes of what [`write_archive`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    pub manifest_digest: String,
    pub config_digest: String,
    pub layer_digest: String,
    pub layer_size: u64,
}

/// `sha256:<hex>` of `data`.
pub fn digest(data: &[u8]) -> String {
    let hash = Sha256::digest(data);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn blob_path(digest: &str) -> String {
    format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"))
}

fn descriptor(media_type: &str, data: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": digest(data), "size": data.len()})
}

/// The image config: entrypoint, labels, the one layer's diff_id.
pub fn config_json(meta: &ImageMeta, layer_digest: &str) -> Vec<u8> {
    let created = rfc3339(meta.epoch);
    let config = json!({
        "created": created,
        "architecture": meta.architecture,
        "os": "linux",
        "config": {
            "Entrypoint": meta.entrypoint,
            "Env": [IMAGE_PATH_ENV],
            "Labels": meta.labels(),
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": created, "created_by": "cargo xtask image"}],
    });
    serde_json::to_vec(&config).expect("JSON of plain values")
}

/// Writes the OCI image-layout archive of `rootfs` to `out`.
pub fn write_archive<W: Write>(rootfs: &Rootfs, meta: &ImageMeta, out: W) -> io::Result<Written> {
    let layer = rootfs.layer(meta.epoch)?;
    let layer_digest = digest(&layer);
    let config = config_json(meta, &layer_digest);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": descriptor(MEDIA_CONFIG, &config),
        "layers": [descriptor(MEDIA_LAYER, &layer)],
        "annotations": meta.labels(),
    }))
    .expect("JSON of plain values");
    let reference = meta.reference();
    let mut manifest_desc = descriptor(MEDIA_MANIFEST, &manifest);
    // ref.name: the name `podman load` and skopeo give the image; containerd's `ctr import`
    // takes io.containerd.image.name, the fully qualified form a kubelet asks containerd for.
    manifest_desc["annotations"] = json!({
        "org.opencontainers.image.ref.name": reference,
        "io.containerd.image.name": format!("docker.io/library/{reference}"),
    });
    manifest_desc["platform"] = json!({"architecture": meta.architecture, "os": "linux"});
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [manifest_desc],
    }))
    .expect("JSON of plain values");
    let docker_manifest = serde_json::to_vec(&json!([{
        "Config": blob_path(&digest(&config)),
        "RepoTags": [reference],
        "Layers": [blob_path(&layer_digest)],
    }]))
    .expect("JSON of plain values");

    let mut blobs: BTreeMap<String, &[u8]> = BTreeMap::new();
    for data in [&layer[..], &config, &manifest] {
        blobs.insert(blob_path(&digest(data)), data);
    }
    let mut tar = TarWriter::new(out, meta.epoch);
    tar.append_dir("blobs", 0o755)?;
    tar.append_dir("blobs/sha256", 0o755)?;
    for (path, data) in &blobs {
        tar.append_file(path, 0o644, data)?;
    }
    tar.append_file("index.json", 0o644, &index)?;
    tar.append_file("manifest.json", 0o644, &docker_manifest)?;
    tar.append_file("oci-layout", 0o644, br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    tar.finish()?.flush()?;
    Ok(Written {
        manifest_digest: digest(&manifest),
        config_digest: digest(&config),
        layer_digest,
        layer_size: layer.len() as u64,
    })
}

/// `YYYY-MM-DDTHH:MM:SSZ` of `secs` since the epoch (UTC; civil-from-days, proleptic
/// Gregorian).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tar::read;

    fn meta() -> ImageMeta {
        ImageMeta {
            name: "kube-proxy-ebpf".into(),
            tag: "latest".into(),
            architecture: "amd64".into(),
            entrypoint: vec!["/usr/local/bin/kube-proxy-ebpf".into()],
            version: "0.1.0".into(),
            revision: Some("abc123".into()),
            epoch: 1_700_000_000,
        }
    }

    /// The same files added in a different order.
    fn rootfs(reversed: bool) -> Rootfs {
        let files: Vec<(&str, u32, Vec<u8>)> = vec![
            ("/usr/local/bin/kube-proxy-ebpf", 0o755, vec![1; 3000]),
            ("/lib/x86_64-linux-gnu/libc.so.6", 0o755, b"libc".to_vec()),
            ("/lib64/ld-linux-x86-64.so.2", 0o755, b"ld".to_vec()),
        ];
        let dirs = ["/sys/fs/bpf", "/etc/kube-proxy-ebpf", "/tmp"];
        let mut fs = Rootfs::default();
        let links = [
            ("/usr/sbin/nft-link", "nft"),
            ("/usr/sbin/iptables-nft-save", "xtables-nft-multi"),
        ];
        for (p, t) in if reversed {
            links.iter().rev().collect::<Vec<_>>()
        } else {
            links.iter().collect()
        } {
            fs.symlink(p, t);
        }
        if reversed {
            for d in dirs.iter().rev() {
                fs.dir(d, 0o755);
            }
            for (p, m, d) in files.into_iter().rev() {
                fs.file(p, m, d);
            }
        } else {
            for (p, m, d) in files {
                fs.file(p, m, d);
            }
            for d in dirs {
                fs.dir(d, 0o755);
            }
        }
        fs
    }

    fn archive(fs: &Rootfs) -> (Vec<u8>, Written) {
        let mut out = Vec::new();
        let written = write_archive(fs, &meta(), &mut out).unwrap();
        (out, written)
    }

    #[test]
    fn two_builds_of_the_same_files_are_byte_identical() {
        let (a, wa) = archive(&rootfs(false));
        let (b, wb) = archive(&rootfs(true));
        assert_eq!(wa, wb);
        assert!(a == b, "archives differ");
    }

    #[test]
    fn the_layer_is_sorted_owned_by_root_and_stamped_with_the_epoch() {
        let layer = rootfs(true).layer(1_700_000_000).unwrap();
        let entries = read::entries(&layer);
        let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
        let mut sorted = paths.clone();
        sorted.sort();
        assert_eq!(paths, sorted);
        for want in [
            "etc/",
            "lib/",
            "lib/x86_64-linux-gnu/",
            "usr/local/bin/",
            "sys/fs/bpf/",
        ] {
            assert!(paths.contains(&want), "{want} missing: {paths:?}");
        }
        for e in &entries {
            assert_eq!((e.uid, e.gid, e.mtime), (0, 0, 1_700_000_000), "{}", e.path);
        }
        let bin = entries
            .iter()
            .find(|e| e.path == "usr/local/bin/kube-proxy-ebpf")
            .unwrap();
        assert_eq!(
            (bin.mode, bin.typeflag, bin.data.len()),
            (0o755, b'0', 3000)
        );
        let link = entries
            .iter()
            .find(|e| e.path == "usr/sbin/iptables-nft-save")
            .unwrap();
        assert_eq!(
            (link.typeflag, link.link.as_str(), link.data.len()),
            (b'2', "xtables-nft-multi", 0)
        );
        assert!(paths.contains(&"usr/sbin/"), "{paths:?}");
    }

    #[test]
    fn the_archive_is_an_image_layout_whose_digests_match_their_blobs() {
        let (bytes, written) = archive(&rootfs(false));
        let entries = read::entries(&bytes);
        let file = |path: &str| -> &[u8] {
            &entries
                .iter()
                .find(|e| e.path == path)
                .unwrap_or_else(|| panic!("{path} missing"))
                .data
        };
        let layout: Value = serde_json::from_slice(file("oci-layout")).unwrap();
        assert_eq!(layout["imageLayoutVersion"], "1.0.0");
        for e in entries
            .iter()
            .filter(|e| e.path.starts_with("blobs/sha256/") && e.typeflag == b'0')
        {
            assert_eq!(
                digest(&e.data).trim_start_matches("sha256:"),
                e.path.trim_start_matches("blobs/sha256/")
            );
        }
        let index: Value = serde_json::from_slice(file("index.json")).unwrap();
        let desc = &index["manifests"][0];
        assert_eq!(desc["digest"], written.manifest_digest);
        assert_eq!(
            desc["annotations"]["org.opencontainers.image.ref.name"],
            "kube-proxy-ebpf:latest"
        );
        let manifest_bytes = file(&blob_path(&written.manifest_digest));
        assert_eq!(desc["size"], manifest_bytes.len());
        let manifest: Value = serde_json::from_slice(manifest_bytes).unwrap();
        assert_eq!(manifest["layers"][0]["digest"], written.layer_digest);
        assert_eq!(manifest["layers"][0]["size"], written.layer_size);
        let config: Value =
            serde_json::from_slice(file(&blob_path(&written.config_digest))).unwrap();
        assert_eq!(
            config["config"]["Entrypoint"][0],
            "/usr/local/bin/kube-proxy-ebpf"
        );
        assert_eq!(
            (config["os"].as_str(), config["architecture"].as_str()),
            (Some("linux"), Some("amd64"))
        );
        assert_eq!(config["rootfs"]["diff_ids"][0], written.layer_digest);
        assert_eq!(
            config["config"]["Labels"]["org.opencontainers.image.revision"],
            "abc123"
        );
        assert_eq!(config["created"], "2023-11-14T22:13:20Z");
        assert_eq!(config["config"]["Env"][0], "PATH=/usr/local/bin:/usr/sbin");
        let docker: Value = serde_json::from_slice(file("manifest.json")).unwrap();
        assert_eq!(docker[0]["RepoTags"][0], "kube-proxy-ebpf:latest");
        assert_eq!(docker[0]["Config"], blob_path(&written.config_digest));
    }

    #[test]
    fn timestamps_are_utc_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_767_225_599), "2025-12-31T23:59:59Z");
    }
}

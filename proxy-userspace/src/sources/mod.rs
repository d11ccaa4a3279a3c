//! Where the Services come from: the Kubernetes API or a manifest folder. Both give the sync loop
//! the same three things: "the initial state is complete", "something changed", and the current
//! [`Snapshot`] with the problems found reading it.
//!
//! Owns the Kubernetes reflectors (`kube`), the manifest folder (`manifests`), the snapshot and
//! the slice store (`endpoints`). May call: `pipeline` for its vocabulary (problems, protocols,
//! addresses, the annotations translate reads) and `serving::health` (node eligibility). Never
//! `dataplane` or `cli`.

/// `kube::runtime::reflector::Lookup` for a compact object the sources keep instead of the API
/// type (`ServiceData`, `SliceData`): the API kind, group, version and plural as given, the
/// names from the object's own `namespace`/`name`/`resource_version` fields, the uid from `$uid`.
macro_rules! lookup_from_fields {
    ($ty:ty, kind: $kind:literal, group: $group:literal, plural: $plural:literal, uid: $uid:expr) => {
        impl kube::runtime::reflector::Lookup for $ty {
            type DynamicType = ();

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($kind)
            }

            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($group)
            }

            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed("v1")
            }

            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($plural)
            }

            fn name(&self) -> Option<std::borrow::Cow<'_, str>> {
                self.name.as_deref().map(std::borrow::Cow::Borrowed)
            }

            fn namespace(&self) -> Option<std::borrow::Cow<'_, str>> {
                self.namespace.as_deref().map(std::borrow::Cow::Borrowed)
            }

            fn resource_version(&self) -> Option<std::borrow::Cow<'_, str>> {
                self.resource_version
                    .as_deref()
                    .map(std::borrow::Cow::Borrowed)
            }

            fn uid(&self) -> Option<std::borrow::Cow<'_, str>> {
                let uid: fn(&$ty) -> Option<&str> = $uid;
                uid(self).map(std::borrow::Cow::Borrowed)
            }
        }
    };
}

pub mod endpoints;
pub mod kube;
pub mod manifests;
pub mod names;
pub mod object_version;
pub mod services;
pub mod snapshot;

use std::{path::PathBuf, time::Duration};

use tokio::time::{Interval, MissedTickBehavior};

use crate::{
    pipeline::model::Problem,
    sources::{
        kube::KubeSource,
        snapshot::{Changes, Snapshot},
    },
};

/// How often the manifest folder is checked for changes.
pub const MANIFEST_POLL: Duration = Duration::from_millis(200);

/// What a source knows at one moment.
#[derive(Clone, Debug, Default)]
pub struct SourceState {
    pub snapshot: Snapshot,
    pub problems: Vec<Problem>,
    /// This node's zone, when the source knows it (the Node's `topology.kubernetes.io/zone`).
    pub zone: Option<String>,
    /// Whether this node may receive traffic (/healthz); always true without a Node object.
    pub node_eligible: bool,
    /// The IPv4 CIDRs of the cluster's ServiceCIDR objects (none from manifests).
    pub service_cidrs: Vec<(std::net::Ipv4Addr, u8)>,
    /// Their IPv6 CIDRs.
    pub service_cidrs6: Vec<(std::net::Ipv6Addr, u8)>,
    /// What changed since the last read, where the source knows it (the Kubernetes stores);
    /// the whole snapshot is compared otherwise.
    pub changes: Changes,
}

pub enum Source {
    Manifests(ManifestSource),
    Kube(KubeSource),
}

impl Source {
    /// Whether [`Source::state`] is cheap to read again and again (the Kubernetes stores: pointer
    /// copies), so the periodic pass can go in slices, each reading it; the manifest folder is
    /// parsed again at every read.
    pub fn cheap_to_read(&self) -> bool {
        matches!(self, Source::Kube(_))
    }

    /// Resolves once the source's initial state is complete (the manifest folder: at once).
    pub async fn wait_ready(&self) {
        match self {
            Source::Manifests(_) => {}
            Source::Kube(k) => k.wait_ready().await,
        }
    }

    /// Resolves when the state may have changed since the last call. Cancel-safe.
    pub async fn changed(&mut self) {
        match self {
            Source::Manifests(m) => m.changed().await,
            Source::Kube(k) => k.changed().await,
        }
    }

    /// The current state (read in full: the sync is level-triggered), with what changed since
    /// the last call where the source knows it (one reader: the agent's sync).
    pub fn state(&self) -> SourceState {
        match self {
            Source::Manifests(m) => {
                let load = m.load();
                SourceState {
                    snapshot: load.snapshot,
                    problems: load.problems,
                    zone: None,
                    node_eligible: true,
                    service_cidrs: Vec::new(),
                    service_cidrs6: Vec::new(),
                    changes: Changes::default(),
                }
            }
            Source::Kube(k) => {
                let (snapshot, changes) = k.snapshot_and_changes();
                SourceState {
                    snapshot,
                    problems: Vec::new(),
                    zone: k.zone(),
                    node_eligible: k.node_eligible(),
                    service_cidrs: k.service_cidrs(),
                    service_cidrs6: k.service_cidrs(),
                    changes,
                }
            }
        }
    }
}

/// The manifest folder, polled for changes (names, sizes, modification times).
pub struct ManifestSource {
    dir: PathBuf,
    fingerprint: u64,
    poll: Interval,
    /// The folder's first load, begun at once on a thread of its own so that it runs while the
    /// agent loads its programs (both are most of a start), and taken by the first
    /// [`Source::state`] if the folder has not changed meanwhile.
    /// With the folder's fingerprint when it began.
    first_load: std::sync::Mutex<Option<FirstLoad>>,
}

type FirstLoad = (u64, std::thread::JoinHandle<manifests::ManifestLoad>);

impl ManifestSource {
    pub fn new(dir: PathBuf) -> Self {
        let fingerprint = manifests::fingerprint(&dir);
        let mut poll = tokio::time::interval(MANIFEST_POLL);
        poll.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let first_load = std::thread::Builder::new()
            .name("manifests".into())
            .spawn({
                let dir = dir.clone();
                move || manifests::load_dir(&dir)
            })
            .ok()
            .map(|thread| (fingerprint, thread));
        Self {
            dir,
            fingerprint,
            poll,
            first_load: std::sync::Mutex::new(first_load),
        }
    }

    /// The folder as it is now: the first load if nothing changed since it began.
    fn load(&self) -> manifests::ManifestLoad {
        let first = (self.first_load.lock())
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .and_then(|(began, thread)| Some((began, thread.join().ok()?)));
        match first {
            Some((began, load)) if manifests::fingerprint(&self.dir) == began => load,
            _ => manifests::load_dir(&self.dir),
        }
    }

    async fn changed(&mut self) {
        loop {
            self.poll.tick().await;
            let now = manifests::fingerprint(&self.dir);
            if now != self.fingerprint {
                self.fingerprint = now;
                return;
            }
        }
    }
}

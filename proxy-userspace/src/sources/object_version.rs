//! What identifies one version of an API object (its fingerprint) and when the change behind it
//! was triggered (the endpoints controller's annotation): pure functions over `ObjectMeta`.
//!
//! Read by [`crate::sources::endpoints`] (kept in each `SliceData`) and [`crate::serving::metrics`] (what changed
//! between syncs, network programming latency); calls nothing else in the crate.

use std::{
    hash::{DefaultHasher, Hash as _, Hasher as _},
    time::{Duration, SystemTime},
};

use k8s_openapi::{Metadata, apimachinery::pkg::apis::meta::v1::ObjectMeta, jiff::Timestamp};
use serde::Serialize;

/// EndpointSlice annotation: when the change that produced this slice version happened.
pub const ANNOTATION_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// What identifies this version of an object: its resourceVersion (and uid) when it has one,
/// else a hash of its JSON.
pub fn fingerprint<T>(o: &T) -> u64
where
    T: Metadata<Ty = ObjectMeta> + Serialize,
{
    let meta = o.metadata();
    let mut h = DefaultHasher::new();
    match (&meta.resource_version, &meta.uid) {
        (Some(rv), uid) => (rv, uid).hash(&mut h),
        (None, _) => {
            // Streamed into the hasher: no buffer per object.
            let _ = serde_json::to_writer(HashWriter(&mut h), o);
        }
    }
    h.finish()
}

/// `io::Write` into a `Hasher`.
struct HashWriter<'a>(&'a mut DefaultHasher);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The endpoints controller's trigger-time annotation, as a time.
pub fn trigger_time(meta: &ObjectMeta) -> Option<SystemTime> {
    let raw = meta.annotations.as_ref()?.get(ANNOTATION_TRIGGER_TIME)?;
    let ts: Timestamp = raw.parse().ok()?;
    system_time(ts)
}

/// jiff's `SystemTime` conversions need its `std` feature, which k8s-openapi leaves off.
pub fn system_time(ts: Timestamp) -> Option<SystemTime> {
    let secs = u64::try_from(ts.as_second()).ok()?;
    let nanos = u32::try_from(ts.subsec_nanosecond()).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

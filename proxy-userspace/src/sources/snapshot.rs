//! What a source (the manifest folder or the Kubernetes API) says, before translation.

use std::sync::Arc;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::sources::{endpoints::SliceData, services::ServiceData};

/// All Services and EndpointSlices a source knows at one moment. `translate` reads only this, so
/// both sources feed the same pure code. Every object has a name and a namespace (sources fill
/// in `default` where a manifest leaves it out).
///
/// Objects are shared, not copied, and so are the lists: the Kubernetes source keeps its lists
/// up to date per watch event and hands them out (`Arc` clones), so taking a snapshot costs two
/// pointer copies; an object that did not change keeps its `Arc` and its place from one snapshot
/// to the next (which is how [`crate::pipeline::translate_cache`] finds the Services to translate
/// again). Change a list with `Arc::make_mut` (copies it only when it is shared).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Services as kept by the sources (converted on arrival, see [`ServiceData`]).
    pub services: Objects<ServiceData>,
    /// EndpointSlices as kept by the sources (parsed on arrival, see [`SliceData`]).
    pub endpoint_slices: Objects<SliceData>,
}

/// A shared list of shared objects.
pub type Objects<T> = Arc<Vec<Arc<T>>>;

/// One object that changed between two snapshots, as the Kubernetes stores log it: what its key
/// held before and holds now (`None`: absent).
#[derive(Clone, Debug)]
pub struct Changed<T> {
    pub before: Option<Arc<T>>,
    pub after: Option<Arc<T>>,
}

/// What changed since the previous snapshot, when the source knows it (the Kubernetes stores;
/// `None` for a kind whose store relisted or changed too much). Consumed by
/// [`crate::pipeline::translate_cache::TranslateCache::hint`].
#[derive(Clone, Debug, Default)]
pub struct Changes {
    pub services: Option<Vec<Changed<ServiceData>>>,
    pub endpoint_slices: Option<Vec<Changed<SliceData>>>,
}

impl Snapshot {
    /// A snapshot owning the given objects (converted as the sources do).
    pub fn new(services: Vec<Service>, endpoint_slices: Vec<EndpointSlice>) -> Self {
        Self {
            services: Arc::new(
                services
                    .iter()
                    .map(|s| Arc::new(ServiceData::from(s)))
                    .collect(),
            ),
            endpoint_slices: Arc::new(
                endpoint_slices
                    .iter()
                    .map(|s| Arc::new(SliceData::from(s)))
                    .collect(),
            ),
        }
    }
}

//! What a source (the manifest folder or the Kubernetes API) says, before translation.

use std::sync::Arc;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::sources::{endpoints::SliceData, services::ServiceData};

/// All Services and EndpointSlices a source knows at one moment. `translate` reads only this, so
/// both sources feed the same pure code. Every object has a name and a namespace (sources fill
/// in `default` where a manifest leaves it out).
///
/// Objects are shared, not copied: the Kubernetes source hands out its reflector stores' `Arc`s,
/// so taking a snapshot costs one pointer per object, and an object that did not change keeps
/// its `Arc` from one snapshot to the next (which is how [`crate::pipeline::translate_cache`] finds the
/// Services to translate again).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Services as kept by the sources (converted on arrival, see [`ServiceData`]).
    pub services: Vec<Arc<ServiceData>>,
    /// EndpointSlices as kept by the sources (parsed on arrival, see [`SliceData`]).
    pub endpoint_slices: Vec<Arc<SliceData>>,
}

impl Snapshot {
    /// A snapshot owning the given objects (converted as the sources do).
    pub fn new(services: Vec<Service>, endpoint_slices: Vec<EndpointSlice>) -> Self {
        Self {
            services: services
                .iter()
                .map(|s| Arc::new(ServiceData::from(s)))
                .collect(),
            endpoint_slices: endpoint_slices
                .iter()
                .map(|s| Arc::new(SliceData::from(s)))
                .collect(),
        }
    }
}

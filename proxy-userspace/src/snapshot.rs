//! What a source (the manifest folder or the Kubernetes API) says, before translation.

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

/// All Services and EndpointSlices a source knows at one moment. `translate` reads only this, so
/// both sources feed the same pure code. Every object has a name and a namespace (sources fill
/// in `default` where a manifest leaves it out).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
}

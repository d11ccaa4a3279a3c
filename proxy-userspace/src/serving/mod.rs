//! What the agent serves: the HTTP server under `/healthz`, `/livez` and `/metrics`, the
//! health-check node ports of externalTrafficPolicy Local Services, and the status file. It owns
//! the health and metric state the other stages report into.
//!
//! May call: `pipeline` (the model it reports on), `sources` (the snapshot metrics are counted
//! from), `dataplane` (the pinned counters map `/metrics` reads). Never `cli`.

pub mod health;
pub mod healthcheck;
pub mod http;
pub mod metrics;
pub mod status;

//! The pure pipeline: snapshot → translate (cached per object) → the desired state → the plan
//! (full or incremental) → ordered map operations against the programmed shadow. It owns the
//! desired-state model, endpoint categorisation, id allocation, Maglev table descriptions and
//! the ABI encoding, and does no IO.
//!
//! May call: `sources` (the snapshot and the parsed slice types it reads), `serving::metrics`
//! (the sync-kind label it reports), `proxy_common`. Never `dataplane` or `cli`.

pub mod addresses;
pub mod diff;
pub mod encode;
pub mod fast_hash;
pub mod ids;
pub mod incremental;
pub mod maglev;
pub mod model;
pub mod opened;
pub mod programmed;
pub mod takeover;
pub mod topology;
pub mod translate;
pub mod translate_cache;

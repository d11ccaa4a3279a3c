//! Host types ↔ map ABI. The only place that turns `Ipv4Addr`/`u16`/`Protocol` into the
//! network-order byte arrays of `proxy_common` (and back, for adoption and `dump`).

use std::net::Ipv4Addr;

use proxy_common::{
    Backend, RevNat, SCOPE_EXTERNAL, SOURCE_RANGE_FRONTEND_BITS, ServiceKey, SourceRangeKey,
    backend_flags, service_flags,
};

use crate::model::{DesiredBackend, DesiredFrontend, EndpointAddr, Frontend, Protocol};

/// The `SERVICES` key of one slot of a frontend (slot 0 = the frontend entry).
pub fn service_key(frontend: &Frontend, slot: u16) -> ServiceKey {
    ServiceKey::new(
        frontend.addr.octets(),
        frontend.port.to_be_bytes(),
        frontend.protocol.number(),
        slot,
    )
}

/// The frontend a `SERVICES` key belongs to; `None` for a protocol or scope this agent does not
/// write.
pub fn decode_service_key(key: &ServiceKey) -> Option<(Frontend, u16)> {
    if key.scope != SCOPE_EXTERNAL {
        return None;
    }
    let frontend = Frontend {
        addr: Ipv4Addr::from(key.addr),
        port: u16::from_be_bytes(key.port),
        protocol: Protocol::from_number(key.proto)?,
    };
    Some((frontend, key.slot))
}

/// `service_flags` bits of a frontend entry.
pub fn frontend_flags(df: &DesiredFrontend) -> u16 {
    let mut flags = 0;
    if df.kind.is_external() {
        flags |= service_flags::EXTERNAL;
        if df.external_local {
            flags |= service_flags::EXTERNAL_LOCAL;
        }
    }
    if !df.source_ranges.is_empty() {
        flags |= service_flags::SOURCE_RANGES;
    }
    flags
}

/// The `SRCRANGES_V1` entries (LPM prefix length, key data) allowing a frontend's source ranges.
pub fn source_range_keys(frontend: &Frontend, df: &DesiredFrontend) -> Vec<(u32, SourceRangeKey)> {
    df.source_ranges
        .iter()
        .map(|(net, len)| {
            (
                SOURCE_RANGE_FRONTEND_BITS + u32::from(*len),
                SourceRangeKey {
                    frontend_addr: frontend.addr.octets(),
                    frontend_port: frontend.port.to_be_bytes(),
                    proto: frontend.protocol.number(),
                    _pad: 0,
                    source: net.octets(),
                },
            )
        })
        .collect()
}

/// `backend_flags` bits for a backend's conditions.
pub fn backend_flags(terminating: bool, local: bool) -> u8 {
    let mut flags = 0;
    if terminating {
        flags |= backend_flags::TERMINATING;
    }
    if local {
        flags |= backend_flags::LOCAL;
    }
    flags
}

/// The `BACKENDS` value for a backend.
pub fn backend(b: &DesiredBackend) -> Backend {
    Backend {
        addr: b.endpoint.addr.octets(),
        port: b.endpoint.port.to_be_bytes(),
        proto: b.endpoint.protocol.number(),
        flags: backend_flags(b.terminating, b.local),
    }
}

/// The endpoint a `BACKENDS` value names (identity only, flags ignored).
pub fn decode_endpoint(b: &Backend) -> Option<EndpointAddr> {
    Some(EndpointAddr {
        addr: Ipv4Addr::from(b.addr),
        port: u16::from_be_bytes(b.port),
        protocol: Protocol::from_number(b.proto)?,
    })
}

/// A `BACKENDS` value back in host types; `None` for an unknown protocol.
pub fn decode_backend(b: &Backend) -> Option<DesiredBackend> {
    Some(DesiredBackend {
        endpoint: decode_endpoint(b)?,
        terminating: b.flags & backend_flags::TERMINATING != 0,
        local: b.flags & backend_flags::LOCAL != 0,
    })
}

/// The `REVNAT` value for a frontend: the source a reply must appear to come from.
pub fn rev_nat(frontend: &Frontend) -> RevNat {
    RevNat {
        addr: frontend.addr.octets(),
        port: frontend.port.to_be_bytes(),
        _pad: [0; 2],
    }
}

/// A `REVNAT` value back in host types.
pub fn decode_rev_nat(r: &RevNat) -> (Ipv4Addr, u16) {
    (Ipv4Addr::from(r.addr), u16::from_be_bytes(r.port))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FE: Frontend = Frontend {
        addr: Ipv4Addr::new(10, 96, 0, 10),
        port: 0x1f90,
        protocol: Protocol::Tcp,
    };

    #[test]
    fn service_key_is_network_order() {
        let key = service_key(&FE, 3);
        assert_eq!(key.addr, [10, 96, 0, 10]);
        assert_eq!(key.port, [0x1f, 0x90]);
        assert_eq!(key.proto, 6);
        assert_eq!(key.scope, SCOPE_EXTERNAL);
        assert_eq!(key.slot, 3);
        assert_eq!(key._pad, [0; 2]);
    }

    #[test]
    fn service_key_round_trip() {
        for protocol in [Protocol::Tcp, Protocol::Udp] {
            let fe = Frontend { protocol, ..FE };
            assert_eq!(decode_service_key(&service_key(&fe, 7)), Some((fe, 7)));
        }
        let mut key = service_key(&FE, 0);
        key.proto = 132;
        assert_eq!(decode_service_key(&key), None, "SCTP is not ours");
    }

    #[test]
    fn backend_round_trip_with_flags() {
        for (terminating, local) in [(false, false), (true, false), (false, true), (true, true)] {
            let b = DesiredBackend {
                endpoint: EndpointAddr {
                    addr: Ipv4Addr::new(10, 244, 1, 11),
                    port: 8080,
                    protocol: Protocol::Udp,
                },
                terminating,
                local,
            };
            let raw = backend(&b);
            assert_eq!(raw.port, 8080u16.to_be_bytes());
            assert_eq!(raw.proto, 17);
            assert_eq!(decode_backend(&raw), Some(b));
        }
    }

    #[test]
    fn rev_nat_round_trip() {
        let raw = rev_nat(&FE);
        assert_eq!(raw._pad, [0; 2]);
        assert_eq!(decode_rev_nat(&raw), (FE.addr, FE.port));
    }
}

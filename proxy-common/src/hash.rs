//! Flow hash and backend pick: pure, so the datapath and host tests compute the same thing.

/// Constant mixed with the per-node seed (so seed 0, the default of tests, is not murmur3's 0).
const FLOW_HASH_BASE: u32 = 0x9e37_79b9;

#[inline(always)]
pub(crate) const fn mix(h: u32, word: u32) -> u32 {
    // murmur3's per-block mix.
    let k = word
        .wrapping_mul(0xcc9e_2d51)
        .rotate_left(15)
        .wrapping_mul(0x1b87_3593);
    (h ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

#[inline(always)]
pub(crate) const fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Hash of a flow's 5-tuple as it arrives (addresses and ports in network order), keyed by the
/// node's `seed` (`DatapathConfig::hash_seed`, random per node): without the seed nobody can tell
/// which backend or SNAT port a 5-tuple gets, so nobody can aim flows at one backend. (murmur3 is
/// not a cryptographic PRF: a 32-bit seed resists guessing, not an attacker who observes many
/// picks and searches the seed offline.)
#[inline(always)]
pub const fn flow_hash(
    seed: u32,
    saddr: [u8; 4],
    daddr: [u8; 4],
    sport: [u8; 2],
    dport: [u8; 2],
    proto: u8,
) -> u32 {
    let ports = ((sport[0] as u32) << 24)
        | ((sport[1] as u32) << 16)
        | ((dport[0] as u32) << 8)
        | dport[1] as u32;
    let mut h = FLOW_HASH_BASE ^ seed ^ proto as u32;
    h = mix(h, u32::from_be_bytes(saddr));
    h = mix(h, u32::from_be_bytes(daddr));
    h = mix(h, ports);
    fmix(h ^ 13)
}

/// Hash of one address (network order) for the address-hashing schedulers (`sh`: the client's,
/// `dh`: the destination's). Unseeded, like IPVS's: every node maps an address to the same slot
/// of the same backend set, so a client moved between nodes (ECMP) keeps its endpoint.
#[inline(always)]
pub const fn addr_hash(addr: [u8; 4]) -> u32 {
    fmix(mix(FLOW_HASH_BASE, u32::from_be_bytes(addr)) ^ 4)
}

/// Backend slot (1..=count) for a hash; `None` when there are no backends.
/// Multiply-shift instead of `%`: no division in the datapath and no modulo bias worth naming.
#[inline(always)]
pub const fn pick_slot(hash: u32, count: u16) -> Option<u16> {
    if count == 0 {
        return None;
    }
    Some((((hash as u64) * (count as u64)) >> 32) as u16 + 1)
}

/// A bounded walk over the ports `min..=max` that starts where a flow hash falls: how a new flow
/// looks for a free port (SNAT node ports, reply-tuple clash resolution), so flows spread over
/// the range and one flow always tries the same ports in the same order.
///
/// The walk jumps by about 0.618 of the range each step (a golden-ratio Weyl sequence), never to
/// the next port: ports are taken in runs (the kernel hands out ephemeral ports in sequence, so
/// one client's flows through a VIP hold a block of consecutive reply tuples), and a walk of
/// consecutive ports that starts inside a run of 16 held ones finds none free. Netfilter escapes
/// the same way, with random jumps between its rounds (`nf_nat_l4proto_unique_tuple`). Any
/// `n` steps of the walk land at least about `range / (2.6 n)` ports apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortProbe {
    min: u16,
    range: u32,
    start: u32,
    stride: u32,
}

impl PortProbe {
    /// The walk for a flow with this hash over `min..=max` (`min <= max`).
    #[inline(always)]
    pub const fn new(hash: u32, min: u16, max: u16) -> Self {
        let range = (max - min) as u32 + 1;
        Self {
            min,
            range,
            start: ((hash as u64 * range as u64) >> 32) as u32,
            // ⌊range / φ⌋, made odd (coprime with the power-of-two part of the range).
            stride: ((range as u64 * 0x9E37_79B9) >> 32) as u32 | 1,
        }
    }

    /// The `i`-th port of the walk (host order); `port(0)` is where the hash falls.
    #[inline(always)]
    pub const fn port(&self, i: u32) -> u16 {
        let jump = ((i as u64 * self.stride as u64) % self.range as u64) as u32;
        let mut off = self.start + jump;
        if off >= self.range {
            off -= self.range;
        }
        (self.min as u32 + off) as u16
    }
}

/// The source ports a SNATed flow tries, in order: the client's own port first where it may keep
/// it, then a [`PortProbe`] walk from the flow hash.
#[derive(Clone, Copy)]
pub struct SnatPorts {
    /// The client's port to try first (host order), 0 for none.
    keep: u16,
    probe: PortProbe,
}

impl SnatPorts {
    /// The ports of a flow with this hash and client port (host order), SNATed with `proto` on
    /// the node's own address (`on_node_addr`) or on another source (hairpin, a tunnel device's
    /// address): TCP and UDP on the node's address keep the client's port if it is unprivileged
    /// and walk the whole unprivileged range; anything else walks the dedicated range.
    #[inline(always)]
    pub const fn new(hash: u32, proto: u8, client_port: u16, on_node_addr: bool) -> Self {
        use crate::{SNAT_NODE_PORT_MIN, SNAT_PORT_MAX, SNAT_PORT_MIN};
        if on_node_addr && crate::shares_node_ports(proto) {
            Self {
                keep: if client_port >= SNAT_NODE_PORT_MIN {
                    client_port
                } else {
                    0
                },
                probe: PortProbe::new(hash, SNAT_NODE_PORT_MIN, SNAT_PORT_MAX),
            }
        } else {
            Self {
                keep: 0,
                probe: PortProbe::new(hash, SNAT_PORT_MIN, SNAT_PORT_MAX),
            }
        }
    }

    /// The `i`-th port to try (host order).
    #[inline(always)]
    pub const fn port(&self, i: u32) -> u16 {
        if self.keep == 0 {
            self.probe.port(i)
        } else if i == 0 {
            self.keep
        } else {
            self.probe.port(i - 1)
        }
    }

    /// Is the `i`-th port the client's own?
    #[inline(always)]
    pub const fn kept(&self, i: u32) -> bool {
        i == 0 && self.keep != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snat_ports_keep_the_clients_port_on_the_node_address_for_tcp_and_udp_only() {
        use crate::{SNAT_NODE_PORT_MIN, SNAT_PORT_MAX, SNAT_PORT_MIN, proto};
        for p in [proto::TCP, proto::UDP] {
            let ports = SnatPorts::new(0xdead_beef, p, 40_000, true);
            assert_eq!(ports.port(0), 40_000);
            assert!(ports.kept(0) && !ports.kept(1));
            let walk: Vec<u16> = (1..33).map(|i| ports.port(i)).collect();
            assert!(walk.iter().all(|&x| x >= SNAT_NODE_PORT_MIN));
            assert!(
                walk.iter().any(|&x| x < SNAT_PORT_MIN),
                "the walk covers the whole unprivileged range: {walk:?}"
            );
            // A privileged client port is never kept: the walk starts at once.
            let low = SnatPorts::new(0xdead_beef, p, 53, true);
            assert!(!low.kept(0));
            assert_eq!(low.port(0), ports.port(1));
        }
        for (p, node) in [
            (proto::SCTP, true),
            (proto::ICMP, true),
            (proto::TCP, false),
            (proto::UDP, false),
        ] {
            let ports = SnatPorts::new(7, p, 40_000, node);
            assert!(!ports.kept(0), "{p} on node address {node}");
            assert!(
                (0..64).all(|i| (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&ports.port(i))),
                "{p} on node address {node}"
            );
        }
    }

    #[test]
    fn same_tuple_same_hash_and_any_field_changes_it() {
        let base = flow_hash(
            0,
            [10, 244, 1, 2],
            [10, 96, 0, 10],
            [0x9c, 0x40],
            [0, 80],
            6,
        );
        assert_eq!(
            base,
            flow_hash(
                0,
                [10, 244, 1, 2],
                [10, 96, 0, 10],
                [0x9c, 0x40],
                [0, 80],
                6
            )
        );
        assert_ne!(
            base,
            flow_hash(
                0,
                [10, 244, 1, 3],
                [10, 96, 0, 10],
                [0x9c, 0x40],
                [0, 80],
                6
            )
        );
        assert_ne!(
            base,
            flow_hash(
                0,
                [10, 244, 1, 2],
                [10, 96, 0, 11],
                [0x9c, 0x40],
                [0, 80],
                6
            )
        );
        assert_ne!(
            base,
            flow_hash(
                0,
                [10, 244, 1, 2],
                [10, 96, 0, 10],
                [0x9c, 0x41],
                [0, 80],
                6
            )
        );
        assert_ne!(
            base,
            flow_hash(
                0,
                [10, 244, 1, 2],
                [10, 96, 0, 10],
                [0x9c, 0x40],
                [0, 81],
                6
            )
        );
        assert_ne!(
            base,
            flow_hash(
                0,
                [10, 244, 1, 2],
                [10, 96, 0, 10],
                [0x9c, 0x40],
                [0, 80],
                17
            )
        );
    }

    #[test]
    fn the_seed_changes_the_hash_and_the_pick() {
        let tuple = |seed| {
            flow_hash(
                seed,
                [10, 244, 1, 2],
                [10, 96, 0, 10],
                [0x9c, 0x40],
                [0, 80],
                6,
            )
        };
        assert_eq!(tuple(7), tuple(7));
        assert_ne!(tuple(0), tuple(1));
        assert_ne!(tuple(1), tuple(0x8000_0000));
        // Over 1,000 client ports, two seeds send about 7/8 of the flows to different backends
        // of 8 (independent picks agree 1/8 of the time).
        let pick = |seed, port: u16| {
            let h = flow_hash(
                seed,
                [10, 244, 1, 2],
                [10, 96, 0, 10],
                port.to_be_bytes(),
                [0, 80],
                6,
            );
            pick_slot(h, 8)
        };
        let same = (30_000u16..31_000)
            .filter(|&p| pick(0x1234_5678, p) == pick(0x9abc_def0, p))
            .count();
        assert!(
            (60..=190).contains(&same),
            "{same} of 1000 picks equal under two seeds"
        );
    }

    #[test]
    fn pick_slot_stays_in_range() {
        assert_eq!(pick_slot(12345, 0), None);
        for count in 1..=64u16 {
            for h in [0u32, 1, u32::MAX / 2, u32::MAX - 1, u32::MAX] {
                let s = pick_slot(h, count).unwrap();
                assert!(
                    (1..=count).contains(&s),
                    "hash {h} count {count} gave slot {s}"
                );
            }
        }
    }

    #[test]
    fn source_ports_spread_evenly_over_backends() {
        // 30,000 client ports over 3 backends: each gets its third within 3%.
        let mut hits = [0u32; 3];
        for port in 20_000u16..50_000 {
            let h = flow_hash(
                0,
                [10, 244, 1, 2],
                [10, 96, 0, 10],
                port.to_be_bytes(),
                [0, 80],
                6,
            );
            hits[(pick_slot(h, 3).unwrap() - 1) as usize] += 1;
        }
        for (i, n) in hits.iter().enumerate() {
            assert!(
                (9_700..=10_300).contains(n),
                "backend {i} got {n} of 30000: {hits:?}"
            );
        }
    }

    #[test]
    fn a_port_probe_starts_at_the_hash_and_stays_inside_the_range() {
        let p = PortProbe::new(u32::MAX, 61_000, 65_535);
        assert_eq!(
            p.port(0),
            65_535,
            "the top of the hash space starts at the top"
        );
        assert_eq!(PortProbe::new(0, 1_024, 65_535).port(0), 1_024);
        for h in [0u32, 1, 77, 1 << 31, u32::MAX - 3, u32::MAX] {
            for (min, max) in [(1_024, 65_535), (61_000, 65_535), (7, 7), (100, 101)] {
                let p = PortProbe::new(h, min, max);
                for i in 0..64 {
                    assert!((min..=max).contains(&p.port(i)), "{h} {min}..={max} #{i}");
                }
            }
        }
    }

    /// The datapath's walks (clash resolution, SNAT) never step to a neighbouring port: a block
    /// of held consecutive ports (one client's flows through a VIP) around where a walk starts
    /// cannot take all its probes, and no probe is tried twice.
    #[test]
    fn a_port_probe_jumps_over_a_block_of_consecutive_ports_and_never_repeats() {
        use crate::{
            CLASH_PORT_MAX, CLASH_PORT_MIN, CLASH_PROBES, SNAT_PORT_MAX, SNAT_PORT_MIN, SNAT_PROBES,
        };
        for (min, max, probes) in [
            (CLASH_PORT_MIN, CLASH_PORT_MAX, CLASH_PROBES),
            (SNAT_PORT_MIN, SNAT_PORT_MAX, SNAT_PROBES),
        ] {
            let range = (max - min) as u32 + 1;
            for h in (0..1_000u32).map(|i| i.wrapping_mul(0x2545_F491)) {
                let p = PortProbe::new(h, min, max);
                let ports: Vec<u32> = (0..probes).map(|i| p.port(i) as u32).collect();
                let mut unique = ports.clone();
                unique.sort_unstable();
                unique.dedup();
                assert_eq!(
                    unique.len(),
                    ports.len(),
                    "{min}..={max} hash {h}: a port twice"
                );
                // The held block: the range / 16 ports from where the walk starts.
                let start = ports[0] - min as u32;
                let in_block = ports
                    .iter()
                    .filter(|&&port| (port - min as u32 + range - start) % range < range / 16)
                    .count();
                assert!(
                    in_block <= 2,
                    "{min}..={max} hash {h}: {in_block} of {probes} probes in one block"
                );
            }
        }
    }

    #[test]
    fn address_hash_is_stable_per_address_and_spreads_addresses() {
        let a = [10, 244, 1, 2];
        assert_eq!(pick_slot(addr_hash(a), 3), pick_slot(addr_hash(a), 3));
        let mut per_slot = [0u32; 3];
        for i in 0..3_000u32 {
            let addr = (0x0af4_0000 + i).to_be_bytes();
            per_slot[pick_slot(addr_hash(addr), 3).unwrap() as usize - 1] += 1;
        }
        // 3,000 consecutive addresses over 3 slots: each within 10% of 1,000.
        assert!(
            per_slot.iter().all(|n| (900..=1_100).contains(n)),
            "{per_slot:?}"
        );
    }
}

//! SNAT garbage collection: removes the `SNAT_V1` and `SNAT6_V1` entries of flows that went
//! idle past their timeout (vanished without FIN/RST, or closed), so they stop holding their
//! node port and stop showing in `dump snat`. The LRU still evicts under pressure; the datapath
//! still reclaims an idle port when it probes.
//!
//! A SNATed flow has two entries (proxy-ebpf `snat.rs`, `ipv6/snat.rs`): `out` (client →
//! backend, value: node address:port) and `in` (backend → node address:port, value: client
//! address:port). Both are refreshed by the client's forwarded packets, but the backend's
//! replies refresh only `in`, so `in` carries the flow's last activity. A flow is dead by the
//! datapath's own reclaim rule: its `in` entry is idle past its timeout
//! (`proxy_common::timeouts::idle_expired`, by protocol and the `in` entry's state). A dead flow
//! loses both entries; an `out` entry whose `in` entry is alive is kept however old its own
//! timestamp. An entry without its partner (the partner was evicted, or the port was reclaimed
//! by another flow) is removed when it is itself idle past its timeout, and never takes the
//! other flow's entry with it.
//!
//! Both families' entries have the same fields (IPv6 with 16-byte addresses) and the same rules:
//! the sweep is written once over [`SnatFamily`].

use std::{collections::HashMap, fmt::Debug, hash::Hash};

use proxy_common::{
    DatapathConfig, SnatKey, SnatValue, ct_dir,
    ipv6::{Snat6Key, Snat6Value},
    timeouts::idle_expired,
};

use crate::dataplane::maps::{Snat, Snat6};

/// One family's SNAT key (`SnatKey`, `Snat6Key`) and what the sweep reads of it and its value.
pub trait SnatFamily: Copy + Eq + Hash + Debug {
    type Value: Copy + Debug;
    fn dir(&self) -> u8;
    fn proto(&self) -> u8;
    /// (last seen, state, flags) of a value.
    fn stamp(value: &Self::Value) -> (u64, u8, u8);
    /// The `in` key of a flow from its `out` entry (proxy-ebpf `Flow::in_key`).
    fn in_key_of_out(&self, out: &Self::Value) -> Self;
    /// The `out` key of a flow from its `in` entry (proxy-ebpf `Flow::out_key`).
    fn out_key_of_in(&self, inn: &Self::Value) -> Self;
}

/// The two key types have the same fields (only the address width differs).
macro_rules! snat_family {
    ($key:ty, $value:ty) => {
        impl SnatFamily for $key {
            type Value = $value;

            fn dir(&self) -> u8 {
                self.dir
            }

            fn proto(&self) -> u8 {
                self.proto
            }

            fn stamp(v: &$value) -> (u64, u8, u8) {
                (v.last_seen_ns, v.state, v.flags)
            }

            fn in_key_of_out(&self, out: &$value) -> Self {
                Self {
                    saddr: self.daddr,
                    daddr: out.addr,
                    sport: self.dport,
                    dport: out.port,
                    proto: self.proto,
                    dir: ct_dir::REPLY,
                    _pad: [0; 2],
                }
            }

            fn out_key_of_in(&self, inn: &$value) -> Self {
                Self {
                    saddr: inn.addr,
                    daddr: self.saddr,
                    sport: inn.port,
                    dport: self.sport,
                    proto: self.proto,
                    dir: ct_dir::ORIGINAL,
                    _pad: [0; 2],
                }
            }
        }
    };
}
snat_family!(SnatKey, SnatValue);
snat_family!(Snat6Key, Snat6Value);

/// The `in` key of a flow from its `out` entry: the backend's reply to the node address and
/// port the flow was given.
pub fn in_key_of_out<K: SnatFamily>(out_key: &K, out: &K::Value) -> K {
    out_key.in_key_of_out(out)
}

/// The `out` key of a flow from its `in` entry: the client's forwarded packet to the backend.
pub fn out_key_of_in<K: SnatFamily>(in_key: &K, inn: &K::Value) -> K {
    in_key.out_key_of_in(inn)
}

/// One SNATed flow's addresses (ip, port): the client, the backend it was sent to, and the node
/// address:port it leaves with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowAddrs {
    pub client: ([u8; 4], u16),
    pub backend: ([u8; 4], u16),
    pub node: ([u8; 4], u16),
    pub proto: u8,
}

impl FlowAddrs {
    /// The flow's `out` and `in` entries as the datapath writes them (for tools and tests that
    /// write entries by hand), both last seen at `last_seen_ns` in `state`.
    pub fn entries(&self, state: u8, last_seen_ns: u64) -> [(SnatKey, SnatValue); 2] {
        let value = |(addr, port): ([u8; 4], u16)| SnatValue {
            last_seen_ns,
            addr,
            port: port.to_be_bytes(),
            state,
            flags: 0,
        };
        let out_key = SnatKey {
            saddr: self.client.0,
            daddr: self.backend.0,
            sport: self.client.1.to_be_bytes(),
            dport: self.backend.1.to_be_bytes(),
            proto: self.proto,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        };
        let out = value(self.node);
        [
            (out_key, out),
            (in_key_of_out(&out_key, &out), value(self.client)),
        ]
    }
}

/// Are these one flow's two entries? Each must name the other (proxy-ebpf `own_in_entry`): an
/// `in` entry reclaimed by another flow no longer points back at the old `out` entry.
pub fn is_pair<K: SnatFamily>(out_key: &K, out: &K::Value, in_key: &K, inn: &K::Value) -> bool {
    out_key.dir() == ct_dir::ORIGINAL
        && in_key.dir() == ct_dir::REPLY
        && in_key_of_out(out_key, out) == *in_key
        && out_key_of_in(in_key, inn) == *out_key
}

/// Is this entry idle past its flow's timeout?
fn idle<K: SnatFamily>(key: &K, value: &K::Value, now_ns: u64, cfg: &DatapathConfig) -> bool {
    let (last_seen_ns, state, flags) = K::stamp(value);
    idle_expired(last_seen_ns, key.proto(), state, flags, now_ns, cfg)
}

/// What one pass removes.
#[derive(Debug, PartialEq, Eq)]
pub struct Sweep<K = SnatKey> {
    /// Dead flows, as (`in` key, `out` key): the `in` entry is idle past its timeout.
    pub flows: Vec<(K, K)>,
    /// Entries without their partner, idle past their own timeout.
    pub orphans: Vec<K>,
}

impl<K> Default for Sweep<K> {
    fn default() -> Self {
        Self {
            flows: Vec::new(),
            orphans: Vec::new(),
        }
    }
}

/// Pure: which entries of `entries` (one listing of the map) are dead at `now_ns`. O(entries).
pub fn sweep<K: SnatFamily>(
    entries: &[(K, K::Value)],
    now_ns: u64,
    cfg: &DatapathConfig,
) -> Sweep<K> {
    let index: HashMap<K, K::Value> = entries.iter().copied().collect();
    let mut out = Sweep::default();
    for (key, value) in entries {
        match key.dir() {
            ct_dir::REPLY => {
                if !idle(key, value, now_ns, cfg) {
                    continue;
                }
                let out_key = out_key_of_in(key, value);
                match index.get(&out_key) {
                    Some(o) if is_pair(&out_key, o, key, value) => out.flows.push((*key, out_key)),
                    _ => out.orphans.push(*key),
                }
            }
            ct_dir::ORIGINAL => {
                let in_key = in_key_of_out(key, value);
                let paired = index
                    .get(&in_key)
                    .is_some_and(|i| is_pair(key, value, &in_key, i));
                // A paired `out` entry lives and dies with its `in` entry (above).
                if !paired && idle(key, value, now_ns, cfg) {
                    out.orphans.push(*key);
                }
            }
            // Not written by the datapath: left to the LRU.
            _ => {}
        }
    }
    out
}

/// What a garbage collection did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Collected {
    /// Dead flows removed (two entries each, or one if the `out` entry changed meanwhile).
    pub flows: usize,
    /// Entries without a partner removed.
    pub orphans: usize,
    /// Entries removed in all.
    pub removed: usize,
    /// Entries left (as of the listing, less those removed).
    pub remaining: usize,
}

/// A SNAT map as the collection reads and cleans it (`SNAT_V1`, `SNAT6_V1`; a fake in tests).
pub trait SnatTable<K: SnatFamily> {
    /// One listing (a racing LRU eviction just drops an entry from it).
    fn entries(&self) -> Vec<(K, K::Value)>;
    /// One entry as it is now (`None` if gone).
    fn get(&self, key: &K) -> Option<K::Value>;
    /// Removes one entry (already gone is fine).
    fn remove(&mut self, key: &K);
}

impl SnatTable<SnatKey> for Snat {
    fn entries(&self) -> Vec<(SnatKey, SnatValue)> {
        Snat::entries(self)
    }

    fn get(&self, key: &SnatKey) -> Option<SnatValue> {
        Snat::get(self, key)
    }

    fn remove(&mut self, key: &SnatKey) {
        Snat::remove(self, key)
    }
}

impl SnatTable<Snat6Key> for Snat6 {
    fn entries(&self) -> Vec<(Snat6Key, Snat6Value)> {
        Snat6::entries(self)
    }

    fn get(&self, key: &Snat6Key) -> Option<Snat6Value> {
        Snat6::get(self, key)
    }

    fn remove(&mut self, key: &Snat6Key) {
        Snat6::remove(self, key)
    }
}

/// A map in memory (tests: the fake of a pinned map).
#[cfg(test)]
impl<K: SnatFamily> SnatTable<K> for HashMap<K, K::Value> {
    fn entries(&self) -> Vec<(K, K::Value)> {
        self.iter().map(|(k, v)| (*k, *v)).collect()
    }

    fn get(&self, key: &K) -> Option<K::Value> {
        HashMap::get(self, key).copied()
    }

    fn remove(&mut self, key: &K) {
        HashMap::remove(self, key);
    }
}

/// Lists the map, removes what [`sweep`] calls dead. Each removal first reads its entry again
/// and checks it is still dead: a packet may have refreshed the flow since the listing, or the
/// datapath may have reclaimed the port for a new flow (its fresh `in` entry is kept).
pub fn collect<K: SnatFamily>(
    snat: &mut impl SnatTable<K>,
    now_ns: u64,
    cfg: &DatapathConfig,
) -> Collected {
    let entries = snat.entries();
    let total = entries.len();
    let sweep = sweep(&entries, now_ns, cfg);
    let mut done = Collected::default();
    for (in_key, out_key) in sweep.flows {
        let Some(inn) = snat.get(&in_key) else {
            continue;
        };
        if !idle(&in_key, &inn, now_ns, cfg) {
            continue;
        }
        snat.remove(&in_key);
        done.removed += 1;
        done.flows += 1;
        // Unless the flow was given another port meanwhile (its `out` entry then names another
        // `in` entry, which is alive).
        if snat
            .get(&out_key)
            .is_some_and(|out| in_key_of_out(&out_key, &out) == in_key)
        {
            snat.remove(&out_key);
            done.removed += 1;
        }
    }
    for key in sweep.orphans {
        if snat.get(&key).is_some_and(|v| idle(&key, &v, now_ns, cfg)) {
            snat.remove(&key);
            done.removed += 1;
            done.orphans += 1;
        }
    }
    done.remaining = total.saturating_sub(done.removed);
    done
}

#[cfg(test)]
mod tests {
    use proxy_common::{HAIRPIN_SNAT_ADDR, ct_state, proto};

    use super::*;

    const S: u64 = 1_000_000_000;
    const NOW: u64 = 10_000 * S;
    const CFG: DatapathConfig = DatapathConfig {
        tcp_established_timeout_s: 100,
        tcp_transitory_timeout_s: 10,
        tcp_close_wait_timeout_s: 50,
        udp_timeout_s: 5,
        udp_stream_timeout_s: 20,
        ..DatapathConfig::DEFAULT
    };
    const NODE: [u8; 4] = [192, 168, 50, 10];
    const BACKEND: [u8; 4] = [10, 244, 2, 20];

    /// One flow's two entries as the datapath writes them: client:cport → BACKEND:8080 leaves
    /// as `node`:`nport`; both last seen `idle_s` ago in `state`.
    fn pair(
        client: [u8; 4],
        cport: u16,
        node: [u8; 4],
        nport: u16,
        proto: u8,
        state: u8,
        idle_s: u64,
    ) -> [(SnatKey, SnatValue); 2] {
        FlowAddrs {
            client: (client, cport),
            backend: (BACKEND, 8080),
            node: (node, nport),
            proto,
        }
        .entries(state, NOW - idle_s * S)
    }

    fn tcp(cport: u16, nport: u16, state: u8, idle_s: u64) -> [(SnatKey, SnatValue); 2] {
        pair(
            [203, 0, 113, 7],
            cport,
            NODE,
            nport,
            proto::TCP,
            state,
            idle_s,
        )
    }

    fn udp(cport: u16, nport: u16, idle_s: u64) -> [(SnatKey, SnatValue); 2] {
        pair(
            [203, 0, 113, 7],
            cport,
            NODE,
            nport,
            proto::UDP,
            ct_state::UDP,
            idle_s,
        )
    }

    /// The pair after the backend's first reply (the datapath marks both entries).
    fn answered(mut pair: [(SnatKey, SnatValue); 2]) -> [(SnatKey, SnatValue); 2] {
        for (_, v) in &mut pair {
            v.flags |= proxy_common::ct_flags::SEEN_REPLY;
        }
        pair
    }

    fn dead_flows(entries: &[(SnatKey, SnatValue)]) -> Vec<(SnatKey, SnatKey)> {
        let s = sweep(entries, NOW, &CFG);
        assert!(s.orphans.is_empty(), "no orphans expected: {s:?}");
        s.flows
    }

    #[test]
    fn pair_keys_derive_from_each_other() {
        for [(ok, ov), (ik, iv)] in [
            tcp(40_001, 61_234, ct_state::ESTABLISHED, 0),
            udp(5353, 65_535, 0),
            // Hairpin: the client is its own backend, SNATed to the link-local address.
            pair(
                BACKEND,
                33_000,
                HAIRPIN_SNAT_ADDR,
                61_000,
                proto::TCP,
                ct_state::SYN_SENT,
                0,
            ),
        ] {
            assert_eq!(in_key_of_out(&ok, &ov), ik);
            assert_eq!(out_key_of_in(&ik, &iv), ok);
            assert!(is_pair(&ok, &ov, &ik, &iv));
            assert!(!is_pair(&ik, &iv, &ok, &ov), "directions swapped");
        }
    }

    #[test]
    fn an_in_entry_reclaimed_by_another_flow_is_not_a_pair() {
        let [(ok, ov), (ik, _)] = tcp(40_001, 61_234, ct_state::ESTABLISHED, 0);
        let [_, (_, other_client)] = tcp(40_002, 61_234, ct_state::ESTABLISHED, 0);
        assert_eq!(in_key_of_out(&ok, &ov), ik, "same node port and backend");
        assert!(!is_pair(&ok, &ov, &ik, &other_client));
    }

    #[test]
    fn flows_die_by_state_timeout() {
        for (what, flow, dead) in [
            (
                "established, 50 s of 100",
                tcp(1, 61_001, ct_state::ESTABLISHED, 50),
                false,
            ),
            (
                "established, 101 s of 100",
                tcp(2, 61_002, ct_state::ESTABLISHED, 101),
                true,
            ),
            (
                "opening, 11 s of 10",
                tcp(3, 61_003, ct_state::SYN_SENT, 11),
                true,
            ),
            (
                "opening, 9 s of 10",
                tcp(4, 61_004, ct_state::SYN_SENT, 9),
                false,
            ),
            (
                "closing, 11 s of 10",
                tcp(5, 61_005, ct_state::CLOSING, 11),
                true,
            ),
            ("udp, 6 s of 5", udp(6, 61_006, 6), true),
            ("udp, 4 s of 5", udp(7, 61_007, 4), false),
            (
                "answered udp, 6 s of 20",
                answered(udp(8, 61_008, 6)),
                false,
            ),
            (
                "answered udp, 21 s of 20",
                answered(udp(9, 61_009, 21)),
                true,
            ),
            (
                "half-closed, 11 s of 50",
                tcp(10, 61_010, ct_state::FIN_ORIGINAL, 11),
                false,
            ),
        ] {
            let got = dead_flows(&flow);
            let want = if dead {
                vec![(flow[1].0, flow[0].0)]
            } else {
                vec![]
            };
            assert_eq!(got, want, "{what}");
        }
    }

    #[test]
    fn the_in_entry_decides_replies_keep_a_flow_alive() {
        // Only the backend sends (replies refresh `in` only): the old `out` entry stays.
        let mut flow = tcp(1, 61_001, ct_state::ESTABLISHED, 1_000);
        flow[1].1.last_seen_ns = NOW - S;
        assert_eq!(dead_flows(&flow), vec![]);
        // The backend's FIN made `in` CLOSING while `out` is still ESTABLISHED: the transitory
        // timeout applies, as when the datapath reclaims the port.
        let mut flow = tcp(2, 61_002, ct_state::ESTABLISHED, 11);
        flow[1].1.state = ct_state::CLOSING;
        assert_eq!(dead_flows(&flow), vec![(flow[1].0, flow[0].0)]);
    }

    #[test]
    fn a_dead_out_entry_never_takes_a_live_flow_s_in_entry() {
        // Flow A went silent; the datapath reclaimed its node port for flow B (same backend).
        let [a_out, _] = tcp(1, 61_001, ct_state::ESTABLISHED, 1_000);
        let b = tcp(2, 61_001, ct_state::ESTABLISHED, 0);
        let s = sweep(&[a_out, b[0], b[1]], NOW, &CFG);
        assert_eq!(s.flows, vec![]);
        assert_eq!(s.orphans, vec![a_out.0], "only A's out entry");
    }

    #[test]
    fn orphans_expire_on_their_own_timestamp() {
        let [out_old, in_old] = udp(1, 61_001, 6);
        let [out_new, in_new] = udp(2, 61_002, 1);
        let s = sweep(&[out_old, in_new], NOW, &CFG);
        assert_eq!(s.orphans, vec![out_old.0]);
        let s = sweep(&[in_old, out_new], NOW, &CFG);
        assert_eq!(s.orphans, vec![in_old.0]);
        assert_eq!(s.flows, vec![]);
    }

    #[test]
    fn a_mixed_table_is_swept_in_one_pass() {
        let mut entries = Vec::new();
        let mut want_flows = Vec::new();
        for i in 0..100u16 {
            let dead = i % 3 == 0;
            let f = tcp(
                10_000 + i,
                61_000 + i,
                ct_state::ESTABLISHED,
                if dead { 200 } else { 1 },
            );
            if dead {
                want_flows.push((f[1].0, f[0].0));
            }
            entries.extend(f);
        }
        entries.reverse();
        let mut s = sweep(&entries, NOW, &CFG);
        s.flows.sort_by_key(|(k, _)| k.dport);
        assert_eq!(s.flows, want_flows);
        assert!(s.orphans.is_empty());
    }

    // IPv6 (`SNAT6_V1`): the same rules through the same code, and `collect` over a map in
    // memory.

    const NODE6: [u8; 16] = [0xfd, 0, 0, 0x50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10];
    const BACKEND6: [u8; 16] = [0xfd, 0, 0, 0x10, 2, 0x44, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0x20];
    const CLIENT6: [u8; 16] = [0xfd, 0, 0, 0x50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    const VIP6: [u8; 16] = [0xfd, 0, 0, 0x10, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x30];

    /// One IPv6 flow's two entries as the datapath writes them (`pair` for IPv6): client:cport →
    /// `backend`:8080 leaves as `node`:`nport`.
    #[allow(clippy::too_many_arguments)]
    fn pair6(
        client: [u8; 16],
        cport: u16,
        backend: [u8; 16],
        node: [u8; 16],
        nport: u16,
        proto: u8,
        state: u8,
        idle_s: u64,
    ) -> [(Snat6Key, Snat6Value); 2] {
        let value = |addr, port: u16| Snat6Value {
            last_seen_ns: NOW - idle_s * S,
            addr,
            port: port.to_be_bytes(),
            state,
            flags: 0,
            _pad: [0; 4],
        };
        let out_key = Snat6Key {
            saddr: client,
            daddr: backend,
            sport: cport.to_be_bytes(),
            dport: 8080u16.to_be_bytes(),
            proto,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        };
        let out = value(node, nport);
        [
            (out_key, out),
            (in_key_of_out(&out_key, &out), value(client, cport)),
        ]
    }

    fn tcp6(cport: u16, nport: u16, state: u8, idle_s: u64) -> [(Snat6Key, Snat6Value); 2] {
        pair6(
            CLIENT6,
            cport,
            BACKEND6,
            NODE6,
            nport,
            proto::TCP,
            state,
            idle_s,
        )
    }

    #[test]
    fn ipv6_pair_keys_derive_from_each_other_hairpin_included() {
        for [(ok, ov), (ik, iv)] in [
            tcp6(40_001, 61_234, ct_state::ESTABLISHED, 0),
            // Hairpin: the client is its own backend, SNATed to the frontend it sent to.
            pair6(
                BACKEND6,
                33_000,
                BACKEND6,
                VIP6,
                61_000,
                proto::UDP,
                ct_state::UDP,
                0,
            ),
        ] {
            assert_eq!(ik.saddr, ok.daddr, "in: from the backend");
            assert_eq!(ik.daddr, ov.addr, "in: to the SNAT address");
            assert_eq!(out_key_of_in(&ik, &iv), ok);
            assert!(is_pair(&ok, &ov, &ik, &iv));
            assert!(!is_pair(&ik, &iv, &ok, &ov), "directions swapped");
        }
        let [(ok, ov), (ik, _)] = tcp6(40_001, 61_234, ct_state::ESTABLISHED, 0);
        let [_, (_, other_client)] = tcp6(40_002, 61_234, ct_state::ESTABLISHED, 0);
        assert!(
            !is_pair(&ok, &ov, &ik, &other_client),
            "an in entry reclaimed by another flow"
        );
    }

    #[test]
    fn ipv6_flows_die_by_the_same_timeouts_as_ipv4() {
        for (state, idle_s) in [
            (ct_state::ESTABLISHED, 50),
            (ct_state::ESTABLISHED, 101),
            (ct_state::SYN_SENT, 11),
            (ct_state::SYN_SENT, 9),
            (ct_state::CLOSING, 11),
            (ct_state::FIN_ORIGINAL, 11),
        ] {
            let v4 = tcp(1, 61_001, state, idle_s);
            let v6 = tcp6(1, 61_001, state, idle_s);
            let (d4, d6) = (sweep(&v4, NOW, &CFG), sweep(&v6, NOW, &CFG));
            assert_eq!(
                d4.flows.len(),
                d6.flows.len(),
                "state {state}, idle {idle_s} s: {d4:?} vs {d6:?}"
            );
            let want6 = if d4.flows.is_empty() {
                vec![]
            } else {
                vec![(v6[1].0, v6[0].0)]
            };
            assert_eq!(d6.flows, want6, "state {state}, idle {idle_s} s");
            assert!(d6.orphans.is_empty());
        }
        let udp6 = |idle_s| {
            pair6(
                CLIENT6,
                5353,
                BACKEND6,
                NODE6,
                61_500,
                proto::UDP,
                ct_state::UDP,
                idle_s,
            )
        };
        assert_eq!(sweep(&udp6(6), NOW, &CFG).flows.len(), 1, "udp 6 s of 5");
        assert!(sweep(&udp6(4), NOW, &CFG).flows.is_empty(), "udp 4 s of 5");
    }

    /// A table of dead, live, orphaned, reclaimed and hairpin IPv6 entries: `collect` removes
    /// exactly the dead flows' pairs and the idle orphans, and reports what is left.
    #[test]
    fn ipv6_collect_removes_dead_flows_and_idle_orphans_and_keeps_the_rest() {
        let dead = tcp6(1, 61_001, ct_state::ESTABLISHED, 200);
        let live = tcp6(2, 61_002, ct_state::ESTABLISHED, 1);
        // Only the backend sends: the `in` entry is fresh, the old `out` entry stays.
        let mut replied = tcp6(3, 61_003, ct_state::ESTABLISHED, 1_000);
        replied[1].1.last_seen_ns = NOW - S;
        let [orphan_out, _] = tcp6(4, 61_004, ct_state::ESTABLISHED, 200);
        let [_, young_orphan_in] = tcp6(5, 61_005, ct_state::ESTABLISHED, 1);
        // Flow A went silent and its port was reclaimed by flow B: A's `out` is an orphan.
        let [a_out, _] = tcp6(6, 61_006, ct_state::ESTABLISHED, 1_000);
        let b = tcp6(7, 61_006, ct_state::ESTABLISHED, 0);
        let hairpin = |cport, idle_s| {
            pair6(
                BACKEND6,
                cport,
                BACKEND6,
                VIP6,
                cport + 20_000,
                proto::TCP,
                ct_state::ESTABLISHED,
                idle_s,
            )
        };
        let (hairpin_dead, hairpin_live) = (hairpin(41_000, 200), hairpin(41_001, 1));

        let mut table = HashMap::<Snat6Key, Snat6Value>::new();
        for (k, v) in [dead, live, replied, b, hairpin_dead, hairpin_live]
            .into_iter()
            .flatten()
            .chain([orphan_out, young_orphan_in, a_out])
        {
            table.insert(k, v);
        }
        let before = table.len();
        let done = collect(&mut table, NOW, &CFG);
        assert_eq!(
            done,
            Collected {
                flows: 2,
                orphans: 2,
                removed: 6,
                remaining: before - 6,
            }
        );
        for (k, _) in dead
            .iter()
            .chain(&hairpin_dead)
            .chain([&orphan_out, &a_out])
        {
            assert!(!table.contains_key(k), "removed: {k:?}");
        }
        for (k, _) in live
            .iter()
            .chain(&replied)
            .chain(&b)
            .chain(&hairpin_live)
            .chain([&young_orphan_in])
        {
            assert!(table.contains_key(k), "kept: {k:?}");
        }
        assert_eq!(table.len(), done.remaining);
        assert_eq!(
            collect(&mut table, NOW, &CFG),
            Collected {
                remaining: done.remaining,
                ..Collected::default()
            },
            "a second pass finds nothing"
        );
    }
}

//! Taking a node over from kube-proxy without cutting its connections: netfilter's NAT bindings
//! of Service flows become the datapath's flows (which ones and how: `pipeline::takeover`), in
//! an order that never lets both translate one packet, nor neither.
//!
//! tc ingress runs before netfilter. A packet the datapath translated and netfilter still holds
//! a binding for would meet that binding's reply tuple and leave with another source port (a
//! reset connection), so each flow moves in steps:
//! 1. Before the programs attach: every binding is written into the conntrack (and SNAT) maps
//!    flagged `ct_flags::NETFILTER`: its packets pass untouched, netfilter keeps translating.
//! 2. Once attached: the table is read again for bindings opened in between (the new flows
//!    from now on are the datapath's).
//! 3. Per flow: `ct_flags::HANDOFF` (its packets are dropped), netfilter's entry deleted, the
//!    flags cleared: the datapath translates it from its next packet on. A packet that arrives
//!    in those microseconds is lost, never sent elsewhere, and the sender retransmits it.
//!
//! A masqueraded flow whose port lies below the SNAT range stays netfilter's until it ends
//! (`Imported::movable`), as do flows the node itself opened.

use std::{
    collections::{BTreeMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya::maps::{HashMap, Map, MapData};
use proxy_common::ct_flags;
use tracing::{info, warn};

use crate::{
    dataplane::{
        bpffs::PinLayout,
        clock,
        ct_netlink::{self, CtNetlink},
    },
    pipeline::{
        programmed::Programmed,
        takeover::{self, FlowAbi, FlowEntries, Imported, NfFlow, NfTuple, Skipped, nf_status},
    },
};

/// What a takeover did, for the log and the tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Bindings written as flows.
    pub imported: usize,
    /// Of those, moved to the datapath (netfilter's entry deleted).
    pub moved: usize,
    /// Left to netfilter until they end (see the module doc).
    pub left_to_netfilter: usize,
    /// Entries not taken over, by reason.
    pub skipped: BTreeMap<String, usize>,
    /// Bindings whose flow the datapath already carried (its own entry kept: see
    /// `FlowMaps::write`).
    pub already_tracked: usize,
}

impl Report {
    /// Connections netfilter still translates: left to it, or not taken over (closed ones
    /// aside).
    pub fn netfilter_keeps(&self) -> usize {
        let skipped: usize = (self.skipped.iter())
            .filter(|(why, _)| *why != &format!("{:?}", Skipped::Closed))
            .map(|(_, n)| n)
            .sum();
        self.left_to_netfilter + skipped
    }
}

/// One family's conntrack and SNAT maps, opened from their pins.
struct FlowMaps<A: FlowAbi> {
    ct: HashMap<MapData, A::CtKey, A::CtValue>,
    snat: HashMap<MapData, A::CtKey, A::SnatValue>,
}

impl<A: FlowAbi> FlowMaps<A> {
    fn open(pins: &PinLayout) -> anyhow::Result<Self> {
        let open = |name: &'static str| -> anyhow::Result<Map> {
            Ok(Map::LruHashMap(MapData::from_pin(pins.map(name)).map_err(
                |e| anyhow::anyhow!("opening pinned map {name}: {e}"),
            )?))
        };
        Ok(Self {
            ct: HashMap::try_from(open(A::MAP_CONNTRACK)?)?,
            snat: HashMap::try_from(open(A::MAP_SNAT)?)?,
        })
    }

    /// Writes the flow's entries unless the datapath has its ORIGINAL entry already, created
    /// before `over_since` (then nothing is written: a flow the datapath carries stays as it is).
    /// An entry the datapath created since then (the programs attached meanwhile and met a
    /// packet of a connection netfilter had started) is replaced: netfilter's binding is the
    /// one the connection began with. Was it written?
    fn write(&mut self, e: &FlowEntries<A>, over_since: u64) -> anyhow::Result<bool> {
        if let Ok(ours) = self.ct.get(&e.original.0, 0)
            && A::ct_created(&ours) < over_since
        {
            return Ok(false);
        }
        self.ct.insert(e.original.0, e.original.1, 0)?;
        self.ct.insert(e.reply.0, e.reply.1, 0)?;
        for (key, value) in e.snat.iter().flatten() {
            self.snat.insert(key, value, 0)?;
        }
        Ok(true)
    }

    /// Sets and clears flags on the flow's entries (the ORIGINAL and SNAT `in` entries decide;
    /// the others follow). A racing packet's refresh in between is lost, nothing else.
    fn set_flags(&mut self, e: &FlowEntries<A>, set: u8, clear: u8) -> anyhow::Result<()> {
        for key in [e.original.0, e.reply.0] {
            if let Ok(mut v) = self.ct.get(&key, 0) {
                let flags = (A::ct_flags(&v) | set) & !clear;
                A::set_ct_flags(&mut v, flags);
                self.ct.insert(key, v, 0)?;
            }
        }
        for (key, _) in e.snat.iter().flatten() {
            if let Ok(mut v) = self.snat.get(key, 0) {
                let flags = (A::snat_flags(&v) | set) & !clear;
                A::set_snat_flags(&mut v, flags);
                self.snat.insert(key, v, 0)?;
            }
        }
        Ok(())
    }
}

/// A flow written as netfilter's, with what moving it takes.
struct Held<A: FlowAbi> {
    nf: ct_netlink::Entry,
    entries: FlowEntries<A>,
    movable: bool,
}

/// One family's side of a takeover.
struct Family<A: FlowAbi> {
    maps: FlowMaps<A>,
    held: Vec<Held<A>>,
}

impl<A: FlowAbi> Family<A> {
    fn open(pins: &PinLayout) -> Option<Self> {
        match FlowMaps::open(pins) {
            Ok(maps) => Some(Self {
                maps,
                held: Vec::new(),
            }),
            Err(e) => {
                warn!("{} flows are not taken over from netfilter: {e:#}", A::NAME);
                None
            }
        }
    }

    /// Imports the bindings of `dump` not seen before (`seen`: original tuples); see
    /// [`FlowMaps::write`] for `over_since`.
    fn import(
        &mut self,
        dump: &[ct_netlink::Entry],
        over_since: u64,
        seen: &mut HashSet<ct_netlink::Tuple>,
        programmed: &Programmed<A>,
        (local, node_snat): (&HashSet<IpAddr>, &HashSet<IpAddr>),
        report: &mut Report,
    ) {
        let now = clock::monotonic_ns();
        for entry in dump {
            let Some(nf) = nf_flow::<A>(entry) else {
                continue;
            };
            if !seen.insert(entry.original) {
                continue;
            }
            let flow = match takeover::import(&nf, programmed, |a| local.contains(&a.into())) {
                Ok(f) => f,
                Err(Skipped::NotTranslated) => continue,
                Err(why) => {
                    *report.skipped.entry(format!("{why:?}")).or_default() += 1;
                    continue;
                }
            };
            let entries = takeover::entries(&flow, now, ct_flags::NETFILTER);
            match self.maps.write(&entries, over_since) {
                Ok(true) => {
                    report.imported += 1;
                    self.held.push(Held {
                        nf: entry.clone(),
                        entries,
                        movable: flow.movable(|a| node_snat.contains(&a.into())),
                    });
                }
                Ok(false) => report.already_tracked += 1,
                Err(e) => {
                    warn!(flow = %describe(&flow), "taking over a flow from netfilter: {e:#}")
                }
            }
        }
    }

    /// Moves every movable held flow to the datapath (the module doc's step 3).
    fn hand_over(&mut self, ct: &mut CtNetlink, family: u8, report: &mut Report) {
        for held in self.held.drain(..) {
            if !held.movable {
                report.left_to_netfilter += 1;
                continue;
            }
            if let Err(e) = self.maps.set_flags(&held.entries, ct_flags::HANDOFF, 0) {
                warn!("taking over a flow from netfilter: {e:#}; netfilter keeps it");
                report.left_to_netfilter += 1;
                continue;
            }
            let (set, clear) = match ct.delete(family, &held.nf) {
                Ok(_) => (0, ct_flags::NETFILTER | ct_flags::HANDOFF),
                Err(e) => {
                    warn!(
                        "deleting netfilter's entry of a taken-over flow: {e}; netfilter keeps it"
                    );
                    (ct_flags::NETFILTER, ct_flags::HANDOFF)
                }
            };
            let moved = clear & ct_flags::NETFILTER != 0;
            match self.maps.set_flags(&held.entries, set, clear) {
                Ok(()) if moved => report.moved += 1,
                Ok(()) => report.left_to_netfilter += 1,
                Err(e) => warn!("taking over a flow from netfilter: {e:#}"),
            }
        }
    }
}

/// A takeover between its steps (see the module doc).
pub struct Takeover {
    ct: CtNetlink,
    v4: Option<Family<Ipv4Addr>>,
    v6: Option<Family<Ipv6Addr>>,
    seen: HashSet<ct_netlink::Tuple>,
    local: HashSet<IpAddr>,
    /// The node's SNAT addresses as the datapath has them (see `Imported::movable`).
    node_snat: HashSet<IpAddr>,
    /// The first read's end: entries the datapath creates after it may be replaced.
    read_at: u64,
    pub report: Report,
}

impl Takeover {
    /// Step 1: netfilter's bindings toward the Services in `v4`/`v6` written as netfilter's.
    pub fn before_attach(
        pins: &PinLayout,
        v4: &Programmed<Ipv4Addr>,
        v6: &Programmed<Ipv6Addr>,
        node_snat: HashSet<IpAddr>,
    ) -> anyhow::Result<Self> {
        let ct = CtNetlink::open()?;
        let mut t = Self {
            ct,
            v4: Family::open(pins),
            v6: Family::open(pins),
            seen: HashSet::new(),
            local: local_addresses(),
            node_snat,
            read_at: u64::MAX,
            report: Report::default(),
        };
        t.import(v4, v6)?;
        t.read_at = clock::monotonic_ns();
        Ok(t)
    }

    /// Step 2, once the programs are attached: bindings opened since step 1.
    pub fn after_attach(
        &mut self,
        v4: &Programmed<Ipv4Addr>,
        v6: &Programmed<Ipv6Addr>,
    ) -> anyhow::Result<()> {
        self.import(v4, v6)
    }

    fn import(
        &mut self,
        v4: &Programmed<Ipv4Addr>,
        v6: &Programmed<Ipv6Addr>,
    ) -> anyhow::Result<()> {
        if let Some(f) = &mut self.v4 {
            let dump = self.ct.list(libc::AF_INET as u8)?;
            f.import(
                &dump,
                self.read_at,
                &mut self.seen,
                v4,
                (&self.local, &self.node_snat),
                &mut self.report,
            );
        }
        if let Some(f) = &mut self.v6 {
            let dump = self.ct.list(libc::AF_INET6 as u8)?;
            f.import(
                &dump,
                self.read_at,
                &mut self.seen,
                v6,
                (&self.local, &self.node_snat),
                &mut self.report,
            );
        }
        Ok(())
    }

    /// Step 3: the held flows move to the datapath. Returns the whole takeover's report.
    pub fn hand_over(mut self) -> Report {
        if let Some(f) = &mut self.v4 {
            f.hand_over(&mut self.ct, libc::AF_INET as u8, &mut self.report);
        }
        if let Some(f) = &mut self.v6 {
            f.hand_over(&mut self.ct, libc::AF_INET6 as u8, &mut self.report);
        }
        if self.report != Report::default() {
            info!(
                imported = self.report.imported,
                moved = self.report.moved,
                left_to_netfilter = self.report.left_to_netfilter,
                already_tracked = self.report.already_tracked,
                skipped = ?self.report.skipped,
                "took over netfilter's Service flows"
            );
        }
        self.report
    }
}

/// A dumped entry as this family's flow (`None`: the other family, no reply tuple, or dying).
fn nf_flow<A: FlowAbi>(e: &ct_netlink::Entry) -> Option<NfFlow<A>> {
    let reply = e.reply?;
    if e.status & nf_status::DYING != 0 {
        return None;
    }
    let tuple = |t: &ct_netlink::Tuple| {
        Some(NfTuple {
            src: A::of(t.src)?,
            dst: A::of(t.dst)?,
            sport: t.sport,
            dport: t.dport,
        })
    };
    Some(NfFlow {
        proto: e.original.proto,
        original: tuple(&e.original)?,
        reply: tuple(&reply)?,
        seen_reply: e.status & nf_status::SEEN_REPLY != 0,
        tcp_state: e.tcp_state,
    })
}

fn describe<A: FlowAbi>(f: &Imported<A>) -> String {
    format!(
        "{}:{} → {}:{} → {}:{} ({})",
        f.client, f.client_port, f.frontend, f.frontend_port, f.backend, f.backend_port, f.proto
    )
}

/// Every address of this network namespace (flows from them were opened by the node itself).
fn local_addresses() -> HashSet<IpAddr> {
    nix::ifaddrs::getifaddrs()
        .map(|addrs| {
            addrs
                .filter_map(|a| {
                    let s = a.address?;
                    s.as_sockaddr_in()
                        .map(|v4| IpAddr::V4(v4.ip()))
                        .or_else(|| s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
                })
                .collect()
        })
        .unwrap_or_default()
}

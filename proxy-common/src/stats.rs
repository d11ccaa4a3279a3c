//! Datapath counters: one per-CPU `u64` array (`STATS_V1`) indexed by [`Counter`].
//! The enum is only an index; it is never stored in a map value.

macro_rules! counters {
    ($( $(#[$doc:meta])* $variant:ident = $name:literal, )+) => {
        /// What the datapath counts. Drop reasons start with `Drop`.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $( $(#[$doc])* $variant, )+
        }

        impl Counter {
            /// Every counter, in index order.
            pub const ALL: &'static [Counter] = &[$(Counter::$variant,)+];

            /// Stable snake_case name (metric label, `dump stats` row).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)+
                }
            }
        }
    };
}

counters! {
    /// Packets seen by the ingress program.
    IngressPackets = "ingress_packets",
    /// Packets seen by the egress program.
    EgressPackets = "egress_packets",
    /// Neither IPv4 nor IPv6 (ARP, runt frames), or IPv6 while the IPv6 programs are not in the
    /// program array: passed untouched.
    NotIpv4 = "not_ipv4",
    /// IPv4 but not to a Service and not a tracked flow (passed untouched).
    NotService = "not_service",
    /// A new flow: backend picked, conntrack entries written, packet DNATed.
    NewFlow = "new_flow",
    /// A packet of a known flow DNATed.
    EstablishedFlow = "established_flow",
    /// A reply reverse-NATed on egress (backend → frontend).
    ReplyTranslated = "reply_translated",
    /// An idle-expired conntrack entry replaced by a new pick.
    ConntrackExpired = "conntrack_expired",
    /// A UDP flow whose backend disappeared, sent to a newly picked backend.
    StaleBackendReselected = "stale_backend_reselected",
    /// A TCP flow whose backend disappeared, answered with a RST.
    StaleBackendReset = "stale_backend_reset",
    /// A packet to a Service without endpoints answered with ICMP port unreachable.
    NoEndpointsRejected = "no_endpoints_rejected",
    /// IPv4 header with options (parsed past, allowed).
    IpOptions = "ip_options",
    /// Dropped: a later fragment of a datagram whose first fragment was dropped or answered in
    /// its place (ICMP error, RST).
    DropFragment = "drop_fragment",
    /// Dropped: truncated or malformed header on a packet to a Service.
    DropMalformed = "drop_malformed",
    /// Dropped: conntrack entry could not be written.
    DropConntrackFull = "drop_conntrack_full",
    /// Dropped: a slot named a backend that does not exist (transient during updates).
    DropNoBackend = "drop_no_backend",
    /// Dropped: the reject answer (ICMP/RST) could not be built.
    DropRejectFailed = "drop_reject_failed",
    /// Dropped: packet rewrite (checksum/store helper) failed.
    DropRewriteFailed = "drop_rewrite_failed",
    /// IPv4 with a bad header (version, IHL, lengths) or a truncated TCP/UDP header that is not
    /// addressed to a Service, or seen on egress: passed untouched (the kernel's own checks apply).
    MalformedPassed = "malformed_passed",
    /// A later fragment of a datagram whose first fragment was passed untouched (not a Service,
    /// not a tracked reply), or a later fragment of neither TCP nor UDP: passed untouched.
    FragmentPassed = "fragment_passed",
    /// Egress packet without a reply conntrack entry (passed untouched).
    ReplyNotTracked = "reply_not_tracked",
    /// A new external flow to a remote backend got a node source port (SNAT entries written).
    SnatNew = "snat_new",
    /// A forwarded packet SNATed to the node on egress.
    SnatTranslated = "snat_translated",
    /// A reply to a SNATed flow translated back to the client on ingress.
    SnatReplyTranslated = "snat_reply_translated",
    /// An external flow to a remote backend sent without SNAT: the node has no SNAT address yet.
    SnatNoNodeAddr = "snat_no_node_addr",
    /// Dropped (or, in the socket hooks, connect()/sendmsg() failed with ETIMEDOUT): a Local
    /// traffic policy (internal or external) with endpoints on other nodes but none on this one
    /// (`service_flags::DROP_WHEN_EMPTY`; not rejected).
    DropNoLocalEndpoints = "drop_no_local_endpoints",
    /// Dropped: no free SNAT port for the flow's backend within the probe limit.
    DropSnatPortsExhausted = "drop_snat_ports_exhausted",
    /// A hairpin flow (client picked as its own backend) SNATed to the link-local address.
    HairpinSnat = "hairpin_snat",
    /// Dropped: a new flow to a LoadBalancer IP from outside its loadBalancerSourceRanges.
    DropSourceRange = "drop_source_range",
    /// An ICMP error about a translated flow rewritten (outer and quoted headers).
    IcmpErrorTranslated = "icmp_error_translated",
    /// A connect()/sendmsg() of the node's own namespace to a Service sent to a backend.
    SockTranslated = "sock_translated",
    /// getpeername()/recvmsg() of such a socket shown the Service instead of the backend.
    SockReverseTranslated = "sock_reverse_translated",
    /// A connect()/sendmsg() of the node's own namespace to a Service without endpoints:
    /// refused with ECONNREFUSED.
    SockNoEndpointsRefused = "sock_no_endpoints_refused",
    /// A translated socket's frontend could not be recorded: getpeername()/recvmsg() on it show
    /// the backend.
    SockRevNatFailed = "sock_revnat_failed",
    /// A new flow whose reply tuple a live flow already held got another source port
    /// (netfilter's clash resolution); its replies go back to the client's own port.
    ReplyTupleRemapped = "reply_tuple_remapped",
    /// A flow held a reply tuple that an idle-expired flow still claimed: the old flow's entries
    /// were removed.
    ReplyTupleReclaimed = "reply_tuple_reclaimed",
    /// Dropped: a new flow's reply tuple clashed and no free source port was found.
    DropReplyTupleExhausted = "drop_reply_tuple_exhausted",
    /// A packet of a flow straight to a pod (no Service), tracked so that no translated flow
    /// takes its reply tuple.
    DirectFlow = "direct_flow",
    /// A conntrack entry of a live flow that had been evicted (LRU) was written again from the
    /// other one.
    ConntrackRestored = "conntrack_restored",
    /// Dropped: the new-flow program could not be tail-called (not loaded into the program
    /// array); a packet to a Service must not leave untranslated.
    DropTailCall = "drop_tail_call",
    /// A later fragment given the IPv4 addresses its datagram's first fragment was translated to.
    FragmentTranslated = "fragment_translated",
    /// A later fragment whose first fragment this hook has not seen (out of order, lost, evicted,
    /// or more than 30 s ago): passed untouched.
    FragmentUnmatched = "fragment_unmatched",
    /// A first fragment whose outcome could not be recorded (map update failed): its later
    /// fragments will be unmatched.
    FragmentNotRecorded = "fragment_not_recorded",
    /// A SNATed flow left through a tunnel device with its own address (`SNATDEV_V1`): its node
    /// port moved from the node's SNAT address to that device's (once per flow).
    SnatDeviceSource = "snat_device_source",
    /// Dropped: an ICMP error or TCP RST was due but this CPU's answer budget (`ratelimit`) was
    /// spent.
    DropRejectRateLimited = "drop_reject_rate_limited",
    /// A new flow to an allocated ClusterIP on a port that is none of its Services' (upstream
    /// nftables' "reject traffic to invalid ports of ClusterIPs"): ICMP port unreachable (the
    /// socket hooks: ECONNREFUSED).
    ClusterIpPortRejected = "cluster_ip_port_rejected",
    /// Dropped: a new flow to an address inside the Service CIDRs that no Service has (upstream
    /// nftables' "drop traffic to unallocated ClusterIPs"; the socket hooks: ETIMEDOUT).
    DropUnallocatedServiceIp = "drop_unallocated_service_ip",
    /// A new flow of a session affinity frontend sent to the client's recorded endpoint (still
    /// usable for the frontend, last used within the timeout); its last use refreshed.
    AffinityHit = "affinity_hit",
    /// A new flow of a session affinity frontend without a usable record (none, expired, or its
    /// endpoint no longer usable here): picked by the scheduler, and recorded.
    AffinityMiss = "affinity_miss",
    /// A new flow's backend chosen by a frontend's scheduler, per scheduler
    /// (`ServiceValue::scheduler`; in `sched::code` order, see [`pick_counter_index`]): random
    /// (the flow hash).
    PickRandom = "pick_random",
    /// ... round robin.
    PickRoundRobin = "pick_round_robin",
    /// ... least connection.
    PickLeastConnection = "pick_least_connection",
    /// ... source hashing.
    PickSourceHash = "pick_source_hash",
    /// ... destination hashing.
    PickDestinationHash = "pick_destination_hash",
    /// ... Maglev.
    PickMaglev = "pick_maglev",
    /// A new flow of a Maglev (`mh`) frontend whose table (or the chunk of its position) was
    /// missing or empty there: picked by the flow hash instead.
    MaglevFallback = "maglev_fallback",
    /// A packet of no translated flow passed to the node's stack as it is, without the Service
    /// lookup: the datapath has handed over to another Service proxy (`presence`); flows
    /// translated before keep their translation.
    HandedOver = "handed_over",
    /// A bind of another proxy's port while no agent ran: the datapath handed over (once).
    HandOverBind = "hand_over_bind",
    /// A connect()/sendmsg() of a pod's socket to a Service sent to a backend by the socket
    /// hooks, while no agent ran to attach the pod's interface.
    SockPodTranslated = "sock_pod_translated",
    /// A packet of a direct flow whose destination has become a Service frontend since the flow
    /// began (a client that sent before the Service existed): handled as a new flow.
    DirectBecameFrontend = "direct_became_frontend",
    /// An IPv6 TCP/UDP packet with extension headers before its L4 header (walked, kept).
    Ipv6ExtHeaders = "ipv6_ext_headers",
    /// IPv6 whose extension header chain could not be walked to a TCP/UDP/ICMPv6 header (more
    /// than `ipv6::MAX_EXT_HEADERS`, ESP, an unknown or truncated header): passed untouched.
    Ipv6ExtUnparsed = "ipv6_ext_unparsed",
    /// A packet of a flow taken over from netfilter's NAT that netfilter still translates
    /// (`ct_flags::NETFILTER`): passed untouched.
    NetfilterFlow = "netfilter_flow",
    /// Dropped: a packet of a taken-over flow in the microseconds its netfilter entry was being
    /// deleted (`ct_flags::HANDOFF`).
    DropTakeoverHandoff = "drop_takeover_handoff",
    /// A SNATed flow kept its client's source port (the translated tuple was free).
    SnatPortKept = "snat_port_kept",
    /// A SNAT port skipped because a socket of the node holds it toward that backend (or
    /// listens on it).
    SnatPortLocalSocket = "snat_port_local_socket",
    /// A connection of the node's own that would have shared its tuple with a live SNATed flow:
    /// its source port remapped, as netfilter's NAT does for a clashing local connection.
    SnatNodeConnectionRemapped = "snat_node_connection_remapped",
    /// A sendmsg() of an unconnected UDP socket of the node's went to the backend the socket's
    /// earlier datagrams to that frontend went to (`SOCKPICK_V1`), not a new pick.
    SockBackendKept = "sock_backend_kept",
    /// A new flow's first packet found its flow created by another CPU between its lookup and
    /// its insert (two receive queues): it followed that flow's backend.
    ConntrackInsertRaced = "conntrack_insert_raced",
    /// Dropped: a new flow's reply tuple was taken by another flow between the check and the
    /// insert (netfilter's `insert_failed`); a retransmission picks again.
    DropConntrackInsertFailed = "drop_conntrack_insert_failed",
}

/// Number of entries in the stats array.
pub const COUNTER_COUNT: u32 = Counter::ALL.len() as u32;

/// The `Pick*` counter of a frontend's scheduler code, as a stats index: the six counters are
/// consecutive in code order. A code the datapath does not know picks by the flow hash and
/// counts as `PickRandom`.
#[inline(always)]
pub const fn pick_counter_index(scheduler: u8) -> u32 {
    let offset = if scheduler <= crate::sched::code::MAGLEV {
        scheduler as u32
    } else {
        crate::sched::code::RANDOM as u32
    };
    Counter::PickRandom as u32 + offset
}

/// The `Pick*` counter of each scheduler, in `Scheduler::ALL` order (metrics, docs).
pub const PICK_COUNTERS: [Counter; 6] = [
    Counter::PickRandom,
    Counter::PickRoundRobin,
    Counter::PickLeastConnection,
    Counter::PickSourceHash,
    Counter::PickDestinationHash,
    Counter::PickMaglev,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_dense_indices() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i, "{} out of order", c.name());
        }
    }

    #[test]
    fn each_scheduler_code_counts_its_own_pick_counter() {
        for (s, c) in crate::sched::Scheduler::ALL.iter().zip(PICK_COUNTERS) {
            assert_eq!(pick_counter_index(s.code()), c as u32, "{s:?}");
            assert!(c.name().starts_with("pick_"), "{}", c.name());
        }
        assert_eq!(pick_counter_index(200), Counter::PickRandom as u32);
        assert!(pick_counter_index(u8::MAX) < COUNTER_COUNT);
    }
}

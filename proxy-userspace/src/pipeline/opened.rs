//! Frontends a plan opens: a frontend entry that is new, or that had no endpoints and now has.
//! After such a plan is written, flow state recorded toward those destinations before cannot
//! stand: the datapath's direct flows are checked again (the frontend generation moves on) and,
//! for UDP, the kernel's own conntrack entries toward them are deleted, as kube-proxy does when
//! a UDP Service port gains its first endpoint or a new NodePort, externalIP or LB IP.

use std::{collections::BTreeSet, net::IpAddr};

use proxy_common::proto;

use super::{
    encode::{FamilyAbi, SlotKey},
    programmed::{MapOp, Programmed},
};

/// A destination a plan opened (a frontend's address, port and protocol).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Opened {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
    /// Has it endpoints now (else the datapath rejects or drops its new flows)?
    pub serving: bool,
}

/// What a plan opened (to be read before it is applied to `programmed`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenedFrontends {
    pub frontends: BTreeSet<Opened>,
}

impl OpenedFrontends {
    /// Adds the frontends `ops` open, judged against `programmed` as it is before they apply.
    pub fn add<A: FamilyAbi + Into<IpAddr>>(
        &mut self,
        ops: &[MapOp<A>],
        programmed: &Programmed<A>,
    ) {
        for op in ops {
            let MapOp::PutService { key, value } = op else {
                continue;
            };
            if key.slot() != 0 {
                continue;
            }
            let before = programmed.services.get(key);
            let new = before.is_none();
            let serving = value.count > 0;
            let gained_endpoints = serving && before.is_some_and(|b| b.count == 0);
            if !new && !gained_endpoints {
                continue;
            }
            let (addr, port, proto, _, _) = A::service_key_parts(key);
            self.frontends.insert(Opened {
                addr: addr.into(),
                port: u16::from_be_bytes(port),
                proto,
                serving,
            });
        }
    }

    pub fn is_empty(&self) -> bool {
        self.frontends.is_empty()
    }

    /// The serving UDP destinations whose kernel conntrack entries go (kube-proxy clears UDP
    /// only: a TCP or SCTP connection that never reached a Service has nothing to resume).
    pub fn udp_serving(&self) -> Vec<(IpAddr, u16)> {
        let set: BTreeSet<(IpAddr, u16)> = (self.frontends.iter())
            .filter(|o| o.proto == proto::UDP && o.serving)
            .map(|o| (o.addr, o.port))
            .collect();
        set.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use proxy_common::ServiceValue;

    use super::*;

    fn key(addr: [u8; 4], port: u16, proto: u8, slot: u16) -> proxy_common::ServiceKey {
        Ipv4Addr::service_key(Ipv4Addr::from(addr), port.to_be_bytes(), proto, 0, slot)
    }

    fn frontend(count: u16) -> ServiceValue {
        ServiceValue {
            count,
            rev_nat_id: 1,
            ..Default::default()
        }
    }

    #[test]
    fn new_frontends_and_frontends_gaining_endpoints_are_opened() {
        let mut programmed = Programmed::<Ipv4Addr>::default();
        let rejecting = key([10, 96, 0, 20], 53, proto::UDP, 0);
        let serving = key([10, 96, 0, 30], 80, proto::TCP, 0);
        programmed.services.insert(rejecting, frontend(0));
        programmed.services.insert(serving, frontend(2));
        let ops = vec![
            // A new NodePort without endpoints yet: opened, not serving.
            MapOp::PutService {
                key: key([192, 168, 50, 2], 30053, proto::UDP, 0),
                value: frontend(0),
            },
            // The rejecting UDP port gains an endpoint.
            MapOp::PutService {
                key: rejecting,
                value: frontend(1),
            },
            // A serving frontend gains another endpoint, and a slot is written: nothing opened.
            MapOp::PutService {
                key: serving,
                value: frontend(3),
            },
            MapOp::PutService {
                key: key([10, 96, 0, 30], 80, proto::TCP, 3),
                value: ServiceValue::slot(7),
            },
        ];
        let mut opened = OpenedFrontends::default();
        opened.add(&ops, &programmed);
        let got: Vec<_> = opened
            .frontends
            .iter()
            .map(|o| (o.port, o.serving))
            .collect();
        assert_eq!(got, vec![(53, true), (30053, false)]);
        assert_eq!(
            opened.udp_serving(),
            vec![(IpAddr::from([10, 96, 0, 20]), 53)]
        );
    }

    #[test]
    fn a_plan_that_opens_nothing_is_empty() {
        let mut programmed = Programmed::<Ipv4Addr>::default();
        let k = key([10, 96, 0, 30], 80, proto::TCP, 0);
        programmed.services.insert(k, frontend(1));
        let mut opened = OpenedFrontends::default();
        opened.add(
            &[
                MapOp::PutService {
                    key: k,
                    value: frontend(0),
                },
                MapOp::DeleteService { key: k },
            ],
            &programmed,
        );
        assert!(opened.is_empty());
    }
}

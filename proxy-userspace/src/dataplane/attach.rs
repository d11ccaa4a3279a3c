//! Attaching the tc programs with TCX links, pinned under `<pin dir>/links/` so they outlive the
//! agent. A restarted agent adopts each pinned link and swaps in its freshly loaded program with
//! one atomic `bpf_link_update` — packets never see a moment without a program.

use std::{collections::BTreeSet, fmt, path::PathBuf};

use aya::{
    Ebpf,
    programs::{
        LinkOrder, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
    },
};
use proxy_common::{PROG_TC_EGRESS, PROG_TC_EGRESS_L3, PROG_TC_INGRESS, PROG_TC_INGRESS_L3};

use super::{Error, Result, bpffs::PinLayout, interfaces::Interface, loader::program_mut};

/// Where a new link goes in the interface's TCX chain: first. Our programs hand every packet they
/// neither drop nor redirect on with TCX_NEXT, so the programs after ours (a CNI's, a policy
/// agent's, and all legacy clsact filters, which run after every TCX program) see each packet,
/// already translated: a pod's packet to a Service carries its backend's address, as netfilter's
/// DNAT gives it to everything after PREROUTING, and a reply carries the Service's address.
/// Appending instead would put us behind programs that end the chain (Cilium appends with
/// `link.Tail()` and returns TC_ACT_OK/redirect), which would silently disable every Service.
/// A program attached later in front of ours sees untranslated packets; ours still runs when it
/// returns TCX_NEXT. Adopting a pinned link on restart swaps the program in place, so the
/// position is kept.
const CHAIN_POSITION: LinkOrder = LinkOrder::first();

/// Which hook of an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    Ingress,
    Egress,
}

impl Hook {
    const ALL: [Hook; 2] = [Hook::Ingress, Hook::Egress];

    /// The program for this hook: the `_l3` one on a device whose packets start at the IPv4
    /// header (`l3`), the Ethernet one otherwise.
    pub fn program(self, l3: bool) -> &'static str {
        match (self, l3) {
            (Hook::Ingress, false) => PROG_TC_INGRESS,
            (Hook::Egress, false) => PROG_TC_EGRESS,
            (Hook::Ingress, true) => PROG_TC_INGRESS_L3,
            (Hook::Egress, true) => PROG_TC_EGRESS_L3,
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Ingress => TcAttachType::Ingress,
            Hook::Egress => TcAttachType::Egress,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Hook::Ingress => "ingress",
            Hook::Egress => "egress",
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One link: program on (interface, hook). The pin name carries the ifindex so a pin left by an
/// interface that was deleted (and maybe re-created under the same name) is never adopted.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId {
    pub ifindex: u32,
    pub ifname: String,
    pub hook: Hook,
}

impl LinkId {
    pub fn pin_name(&self) -> String {
        format!("{}_{}_{}", self.ifindex, self.ifname, self.hook)
    }

    /// Parses a pin name made by `pin_name` (interface names may contain `_`).
    pub fn from_pin_name(s: &str) -> Option<Self> {
        let (index, rest) = s.split_once('_')?;
        let (ifname, hook) = rest.rsplit_once('_')?;
        let hook = match hook {
            "ingress" => Hook::Ingress,
            "egress" => Hook::Egress,
            _ => return None,
        };
        Some(Self {
            ifindex: index.parse().ok()?,
            ifname: ifname.to_string(),
            hook,
        })
    }
}

/// What a reconcile did.
#[derive(Debug, Default)]
pub struct AttachReport {
    pub attached: Vec<LinkId>,
    pub adopted: Vec<LinkId>,
    pub released: Vec<LinkId>,
    pub failed: Vec<(LinkId, String)>,
}

/// What a reconcile may do.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reconcile {
    /// Attach, adopt (swapping the program in) and release.
    Full,
    /// Attach where nothing is pinned; touch no pinned link.
    MissingOnly,
}

/// Keeps the programs attached to exactly the wanted interfaces.
pub struct Attacher {
    pins: PinLayout,
    /// Links this process has attached or adopted.
    current: BTreeSet<LinkId>,
}

impl Attacher {
    pub fn new(pins: PinLayout) -> Self {
        Self {
            pins,
            current: BTreeSet::new(),
        }
    }

    /// Interfaces carrying both programs now.
    pub fn interfaces(&self) -> BTreeSet<String> {
        self.current.iter().map(|l| l.ifname.clone()).collect()
    }

    /// The pin names (under `links/`) of the links this process attached or adopted.
    pub fn pin_names(&self) -> BTreeSet<String> {
        self.current.iter().map(LinkId::pin_name).collect()
    }

    fn pin_path(&self, id: &LinkId) -> PathBuf {
        self.pins.links_dir().join(id.pin_name())
    }

    /// Makes the pinned links equal to `wanted` × {ingress, egress}: adopts pins left by an earlier
    /// agent (replacing their program atomically), attaches where none exists, and releases pins
    /// of interfaces that are gone or no longer match. Failures are per link and reported.
    /// Interfaces whose index is in `l3` (no Ethernet header: ipip, gre, WireGuard) get the `_l3`
    /// programs, attached or adopted alike (a device's hardware type never changes, and its pin
    /// name carries the ifindex, so a pin is only ever adopted for the device it was made for).
    pub fn reconcile(
        &mut self,
        ebpf: &mut Ebpf,
        wanted: &[Interface],
        l3: &BTreeSet<u32>,
    ) -> AttachReport {
        self.reconcile_as(ebpf, wanted, l3, Reconcile::Full)
    }

    /// Attaches where no link is pinned yet, and nothing else: pinned links keep the program
    /// they run and gone interfaces keep their pins until the next [`Attacher::reconcile`]. For
    /// the time before the first sync on adopted maps, when a pod's new interface must get
    /// programs at once (the maps already carry the Services) but the running ones are only
    /// replaced once the maps carry this agent's state.
    pub fn attach_missing(
        &mut self,
        ebpf: &mut Ebpf,
        wanted: &[Interface],
        l3: &BTreeSet<u32>,
    ) -> AttachReport {
        self.reconcile_as(ebpf, wanted, l3, Reconcile::MissingOnly)
    }

    fn reconcile_as(
        &mut self,
        ebpf: &mut Ebpf,
        wanted: &[Interface],
        l3: &BTreeSet<u32>,
        how: Reconcile,
    ) -> AttachReport {
        let mut report = AttachReport::default();
        let wanted: BTreeSet<LinkId> = wanted
            .iter()
            .flat_map(|i| {
                Hook::ALL.map(|hook| LinkId {
                    ifindex: i.index,
                    ifname: i.name.clone(),
                    hook,
                })
            })
            .collect();
        let pinned = self.pinned_links();
        if how == Reconcile::MissingOnly {
            for id in wanted.difference(&pinned) {
                if self.current.contains(id) {
                    continue;
                }
                let program = id.hook.program(l3.contains(&id.ifindex));
                match self.attach(ebpf, id, program) {
                    Ok(()) => {
                        self.current.insert(id.clone());
                        report.attached.push(id.clone());
                    }
                    Err(e) => report.failed.push((id.clone(), e.to_string())),
                }
            }
            return report;
        }

        for id in pinned.difference(&wanted) {
            let _ = super::maps::remove_if_exists(&self.pin_path(id));
            self.current.remove(id);
            report.released.push(id.clone());
        }
        self.current.retain(|id| wanted.contains(id));

        for id in &wanted {
            if self.current.contains(id) {
                continue;
            }
            let program = id.hook.program(l3.contains(&id.ifindex));
            let result = if pinned.contains(id) {
                self.adopt(ebpf, id, program).map(|()| report.adopted.push(id.clone())).or_else(|e| {
                    tracing::warn!(link = %id.pin_name(), "adopting pinned link failed ({e}); attaching anew");
                    let _ = super::maps::remove_if_exists(&self.pin_path(id));
                    self.attach(ebpf, id, program).map(|()| report.attached.push(id.clone()))
                })
            } else {
                self.attach(ebpf, id, program)
                    .map(|()| report.attached.push(id.clone()))
            };
            match result {
                Ok(()) => {
                    self.current.insert(id.clone());
                }
                Err(e) => report.failed.push((id.clone(), e.to_string())),
            }
        }
        report
    }

    fn pinned_links(&self) -> BTreeSet<LinkId> {
        let Ok(dir) = std::fs::read_dir(self.pins.links_dir()) else {
            return BTreeSet::new();
        };
        dir.filter_map(|e| e.ok())
            .filter_map(|e| LinkId::from_pin_name(&e.file_name().to_string_lossy()))
            .collect()
    }

    fn adopt(&self, ebpf: &mut Ebpf, id: &LinkId, program: &'static str) -> Result<()> {
        let path = self.pin_path(id);
        let link_err = |source| Error::Link {
            path: path.clone(),
            source,
        };
        let pinned = PinnedLink::from_pin(&path).map_err(link_err)?;
        let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(link_err)?;
        let prog = program_mut(ebpf, program)?;
        let attach_err = |source| Error::Attach {
            interface: id.ifname.clone(),
            program,
            source,
        };
        let link_id = prog.attach_to_link(link).map_err(attach_err)?;
        // Dropping our handle only closes the fd: the pin keeps the link (and program) attached.
        drop(prog.take_link(link_id).map_err(attach_err)?);
        Ok(())
    }

    fn attach(&self, ebpf: &mut Ebpf, id: &LinkId, program: &'static str) -> Result<()> {
        let prog = program_mut(ebpf, program)?;
        let attach_err = |source| Error::Attach {
            interface: id.ifname.clone(),
            program,
            source,
        };
        let link_id = prog
            .attach_with_options(
                &id.ifname,
                id.hook.attach_type(),
                TcAttachOptions::TcxOrder(CHAIN_POSITION),
            )
            .map_err(attach_err)?;
        let link = prog.take_link(link_id).map_err(attach_err)?;
        let path = self.pin_path(id);
        let fd_link = FdLink::try_from(link).map_err(|source| Error::Link {
            path: path.clone(),
            source,
        })?;
        fd_link
            .pin(&path)
            .map_err(|source| Error::PinLink { path, source })?;
        Ok(())
    }
}

/// Detaches every pinned link and removes its pin. The explicit BPF_LINK_DETACH makes the programs
/// leave the interfaces before this returns (dropping the last reference alone detaches later,
/// asynchronously).
pub fn release_all(pins: &PinLayout) -> std::io::Result<usize> {
    let mut n = 0;
    if let Ok(dir) = std::fs::read_dir(pins.links_dir()) {
        for e in dir.flatten() {
            if let Err(err) = super::link_sys::detach_pinned_link(&e.path()) {
                tracing::warn!(link = %e.path().display(), "explicit detach failed ({err}); removing the pin detaches it");
            }
            std::fs::remove_file(e.path())?;
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_names_round_trip_with_underscores_in_interface_names() {
        for ifname in ["veth-be1", "my_dev_0", "eth0"] {
            for hook in Hook::ALL {
                let id = LinkId {
                    ifindex: 42,
                    ifname: ifname.into(),
                    hook,
                };
                assert_eq!(LinkId::from_pin_name(&id.pin_name()), Some(id));
            }
        }
        assert_eq!(LinkId::from_pin_name("garbage"), None);
        assert_eq!(LinkId::from_pin_name("x_eth0_ingress"), None);
        assert_eq!(LinkId::from_pin_name("3_eth0_sideways"), None);
    }
}

//! `xtask-bench change-latency`: what one endpoint change costs at N Services.
//!
//! In process: the agent itself ([`Agent::start`] on a fresh pin dir, real maps, nothing
//! attached) synced to N Services × 10 endpoints, then K single-endpoint changes (an endpoint
//! added, removed or its ready condition flipped, in a random Service), each followed by the
//! change-triggered [`Agent::sync`]; each sync's parts are timed by the agent
//! ([`Agent::last_sync_parts`]).

use std::{
    net::Ipv4Addr,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube_proxy_ebpf::{
    agent::{Agent, SyncParts},
    dataplane::{bpffs::PinLayout, interfaces::Patterns},
    pipeline::translate::NodeContext,
    sources::{endpoints::SliceData, snapshot::Snapshot},
};
use proxy_common::{DatapathConfig, Scheduler, SockLbConfig};

use crate::{inproc, stats::percentile, workload};

/// xorshift64*: a reproducible change sequence.
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % n as u64) as usize
    }
}

/// The generated Services as the API would hold them (every object with a resourceVersion).
pub struct Cluster {
    pub specs: Vec<workload::SvcSpec>,
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    version: u64,
}

/// What one change did.
#[derive(Clone, Copy, Debug)]
pub enum Change {
    Added,
    Removed,
    ReadyFlipped,
}

impl Cluster {
    pub fn new(n: usize, endpoints: usize) -> Self {
        let mut specs = workload::generated(n);
        for (i, s) in specs.iter_mut().enumerate() {
            let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * 64) as u32;
            s.endpoints = (0..endpoints as u32)
                .map(|j| Ipv4Addr::from(base + j))
                .collect();
        }
        let mut c = Self {
            services: Vec::new(),
            slices: Vec::new(),
            specs,
            version: 1,
        };
        for i in 0..c.specs.len() {
            let mut svc = workload::service(&c.specs[i]);
            svc.metadata.resource_version = Some(c.next_version());
            let mut slice = workload::slice(&c.specs[i]);
            slice.metadata.resource_version = Some(c.next_version());
            c.services.push(svc);
            c.slices.push(slice);
        }
        c
    }

    fn next_version(&mut self) -> String {
        self.version += 1;
        self.version.to_string()
    }

    /// One endpoint of Service `i` added (below 2 endpoints less than at start, never above 60),
    /// removed, or its ready condition flipped.
    pub fn change(&mut self, rng: &mut Rng, i: usize) -> Change {
        let version = self.next_version();
        let slice = &mut self.slices[i];
        slice.metadata.resource_version = Some(version);
        let eps = slice.endpoints.get_or_insert_with(Vec::new);
        let kind = match rng.below(3) {
            0 if eps.len() < 60 => Change::Added,
            1 if eps.len() > 1 => Change::Removed,
            _ => Change::ReadyFlipped,
        };
        match kind {
            Change::Added => {
                let mut e = eps[0].clone();
                let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * 64) as u32;
                let used: Vec<String> = eps.iter().map(|e| e.addresses[0].clone()).collect();
                let free = (0..64u32)
                    .map(|j| Ipv4Addr::from(base + j).to_string())
                    .find(|a| !used.contains(a))
                    .expect("fewer than 64 endpoints");
                e.addresses = vec![free];
                if let Some(c) = e.conditions.as_mut() {
                    c.ready = Some(true);
                }
                eps.push(e);
            }
            Change::Removed => {
                eps.remove(rng.below(eps.len()));
            }
            Change::ReadyFlipped => {
                let j = rng.below(eps.len());
                let c = eps[j].conditions.get_or_insert_with(Default::default);
                c.ready = Some(!c.ready.unwrap_or(true));
            }
        }
        kind
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            services: self.services.iter().cloned().map(Arc::new).collect(),
            endpoint_slices: (self.slices.iter())
                .map(|s| Arc::new(SliceData::from(s)))
                .collect(),
        }
    }
}

/// Per-part samples, µs.
#[derive(Default)]
struct Samples {
    total: Vec<f64>,
    translate: Vec<f64>,
    plan: Vec<f64>,
    report: Vec<f64>,
    apply: Vec<f64>,
    after: Vec<f64>,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl Samples {
    fn push(&mut self, total: Duration, p: SyncParts) {
        self.total.push(us(total));
        self.translate.push(us(p.translate));
        self.plan.push(us(p.plan));
        self.report.push(us(p.report));
        self.apply.push(us(p.apply));
        self.after.push(us(p.after));
    }

    fn print(mut self) {
        for (name, v) in [
            ("Agent::sync", &mut self.total),
            ("  translate", &mut self.translate),
            ("  plan", &mut self.plan),
            ("  report", &mut self.report),
            ("  apply", &mut self.apply),
            ("  after-apply", &mut self.after),
        ] {
            println!(
                "{name:<14} p50 {:>9.1} µs  p99 {:>9.1} µs  max {:>9.1} µs",
                percentile(v, 0.5),
                percentile(v, 0.99),
                percentile(v, 1.0)
            );
        }
    }
}

/// Part (a): in process.
pub fn in_process(services: usize, endpoints: usize, changes: usize) -> Result<()> {
    proxy_testenv::ensure_bpffs()?;
    let pin_dir = proxy_testenv::PinDir::new(&format!("kpe-change-latency-{}", std::process::id()))?;
    let pins = PinLayout::new(pin_dir.path());
    let node = NodeContext {
        node_name: "bench-node".into(),
        zone: None,
        scheduler: Scheduler::Random,
    };
    let sizes = inproc::sizes_for(services * endpoints.div_ceil(10).max(1) * 2);
    let mut agent = Agent::start(
        pins,
        DatapathConfig::DEFAULT,
        node,
        Patterns::parse(""),
        sizes,
        SockLbConfig::default(),
    )
    .context("starting the agent's datapath (root needed)")?;
    let mut cluster = Cluster::new(services, endpoints);
    let mut snap = cluster.snapshot();
    let t = Instant::now();
    agent.sync(&snap, Vec::new(), true)?;
    println!(
        "first sync of {services} Services × {endpoints} endpoints: {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut samples = Samples::default();
    let mut kinds = [0usize; 3];
    for _ in 0..changes {
        let i = rng.below(services);
        kinds[cluster.change(&mut rng, i) as usize] += 1;
        // As the Kubernetes store does: the changed object gets a new Arc, the others keep theirs.
        snap.endpoint_slices[i] = Arc::new(SliceData::from(&cluster.slices[i]));
        agent.queued();
        let t = Instant::now();
        agent.sync(&snap, Vec::new(), false)?;
        samples.push(t.elapsed(), agent.last_sync_parts());
    }
    println!(
        "{changes} changes ({} added, {} removed, {} ready flipped), change-triggered syncs:",
        kinds[0], kinds[1], kinds[2]
    );
    samples.print();
    // A full sync afterwards, for comparison.
    let t = Instant::now();
    agent.sync(&snap, Vec::new(), true)?;
    println!(
        "periodic full sync afterwards: {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

//! The agent's side of `AGENT_V1` (`proxy_common::presence`): a heartbeat written from a thread
//! of its own while the agent runs (so a long sync never makes a live agent look absent), the
//! stop mark written when it stops, and the hand-over state read and taken back at start.
//!
//! Without a heartbeat the datapath treats the agent as gone: the socket hooks translate pods'
//! sockets too (a pod created now has no tc programs until an agent attaches them), and a bind
//! of kube-proxy's ports hands new flows over to the node's stack.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use aya::maps::{Array, MapData};
use proxy_common::presence::{ALIVE_FOR_MS, AgentPresence, HEARTBEAT_PERIOD_MS, MAP_AGENT};

use super::{Error, Result, bpffs::PinLayout, clock::monotonic_ns};

fn map_err(source: aya::maps::MapError) -> Error {
    Error::Map {
        name: MAP_AGENT,
        source,
    }
}

/// `AGENT_V1`.
pub struct AgentMap {
    map: Array<MapData, AgentPresence>,
}

impl AgentMap {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        let map = ebpf.take_map(MAP_AGENT).ok_or(Error::Missing {
            what: "map",
            name: MAP_AGENT,
        })?;
        Ok(Self {
            map: Array::try_from(map).map_err(map_err)?,
        })
    }

    /// The pinned map (`dump`, tests); `None` when the pins have none (an older agent's).
    pub fn open_pinned(pins: &PinLayout) -> Option<Self> {
        let data = MapData::from_pin(pins.map(MAP_AGENT)).ok()?;
        Some(Self {
            map: Array::try_from(aya::maps::Map::Array(data)).ok()?,
        })
    }

    pub fn read(&self) -> Result<AgentPresence> {
        self.map.get(&0, 0).map_err(map_err)
    }

    fn write(&mut self, value: &AgentPresence) -> Result<()> {
        self.map.set(0, value, 0).map_err(map_err)
    }
}

/// What the datapath had done while no agent ran, as found at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandedOver {
    /// How long ago it handed over.
    pub ago: Duration,
    /// The port whose bind handed over (0: the time bound).
    pub port: u16,
}

/// The running heartbeat; [`Heartbeat::stop`] (or dropping it) marks the agent stopped.
pub struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<AgentMap>>,
    settings: AgentPresence,
}

impl Heartbeat {
    /// Takes the datapath back (a hand-over is cleared: this agent is the node's Service proxy
    /// now) and starts beating. `handover_after`: hand over also when no agent has run for this
    /// long (`None`: only when another proxy binds its port). Returns the hand-over it found.
    pub fn start(
        mut map: AgentMap,
        handover_after: Option<Duration>,
    ) -> Result<(Self, Option<HandedOver>)> {
        let found = map.read()?;
        let now = monotonic_ns();
        let handed_over = (found.handed_over_ns != 0).then(|| HandedOver {
            ago: Duration::from_nanos(now.saturating_sub(found.handed_over_ns)),
            port: found.handed_over_port,
        });
        let settings = AgentPresence {
            heartbeat_ns: now,
            handed_over_ns: 0,
            running: 1,
            alive_for_ms: ALIVE_FOR_MS,
            handover_after_s: handover_after
                .map_or(0, |d| u32::try_from(d.as_secs().max(1)).unwrap_or(u32::MAX)),
            handed_over_port: 0,
            _pad: 0,
        };
        map.write(&settings)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn({
                let stop = stop.clone();
                move || {
                    let period = Duration::from_millis(u64::from(HEARTBEAT_PERIOD_MS));
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::park_timeout(period);
                        let beat = AgentPresence {
                            heartbeat_ns: monotonic_ns(),
                            ..settings
                        };
                        if let Err(e) = map.write(&beat) {
                            tracing::warn!("writing the heartbeat: {e}");
                        }
                    }
                    map
                }
            })
            .map_err(|source| Error::Io {
                what: "starting the heartbeat thread".into(),
                source,
            })?;
        Ok((
            Self {
                stop,
                thread: Some(thread),
                settings,
            },
            handed_over,
        ))
    }

    /// Stops beating and marks the agent stopped: from now on the datapath knows no agent runs
    /// (pods' sockets are translated by the socket hooks until the next agent beats).
    pub fn stop(mut self) {
        self.finish();
    }

    fn finish(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.stop.store(true, Ordering::Relaxed);
        thread.thread().unpark();
        match thread.join() {
            Ok(mut map) => {
                let stopped = AgentPresence {
                    heartbeat_ns: monotonic_ns(),
                    running: 0,
                    ..self.settings
                };
                if let Err(e) = map.write(&stopped) {
                    tracing::warn!("marking the agent stopped: {e}");
                }
            }
            Err(_) => tracing::warn!("the heartbeat thread panicked"),
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.finish();
    }
}

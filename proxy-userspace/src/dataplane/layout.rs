//! The pinned maps' layout version and the migrations between layouts.
//!
//! Pinned maps outlive the agent, so an agent may find pins another release made. A *layout* is
//! the set of pinned maps with their types, keys and values ([`proxy_common::LAYOUT_VERSION`]);
//! the pin directory records its layout in the `LAYOUT` marker ([`proxy_common::MAP_LAYOUT`]:
//! the layout, and the oldest layout whose agents can use the pins). Pins without a marker come
//! from a release before it and are layout 1 ([`UNMARKED_LAYOUT`]).
//!
//! Before anything is adopted, [`Migrator::prepare`] reads the marker:
//! - pins of this layout, or none: adopted (or created) as they are, the marker written at once;
//! - pins of an older layout: adopted, and the [`Migration`]s from it to this layout run: each
//!   copies the entries of the maps that changed (renamed with a new `_V<n>`, so the old
//!   programs keep theirs) into the new maps, converted, once after the load (the bulk, before
//!   the programs are swapped: [`Migrator::after_load`]) and once after the new programs are
//!   attached (what the old programs created meanwhile: [`Migrator::after_attach`]), which then
//!   unpins the old maps and writes the marker;
//! - pins of a newer layout that this agent can use (the newer one only added maps): adopted,
//!   the marker left as it is;
//! - pins of a newer layout it cannot use: refused ([`Error::NewerLayout`]) before anything is
//!   touched, naming the layout and the way out (`cleanup`, or the newer release).
//!
//! Today layout 1 is the only layout: [`MIGRATIONS`] is empty, and the framework is exercised
//! by tests/upgrade.rs with a synthetic layout 0 (a map whose values grew).

use aya::maps::{Array, HashMap, Map, MapData, MapType};
use proxy_common::{LAYOUT_OLDEST_READER, LAYOUT_VERSION, MAP_LAYOUT};

use super::{Error, Result, bpffs::PinLayout, maps::remove_if_exists};

/// The layout of pins that carry no marker: every release before the marker pinned layout 1.
pub const UNMARKED_LAYOUT: u32 = 1;

/// The migrations from each older layout to the next, in order. None yet: layout 1 is the only
/// layout. A change of a pinned map's key or value adds one here, with the map under a new
/// name (`CONNTRACK_V2` beside `CONNTRACK_V1`), [`LAYOUT_VERSION`] raised and
/// [`LAYOUT_OLDEST_READER`] raised to it.
pub const MIGRATIONS: &[Migration] = &[];

/// What the marker of a pin directory says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Marker {
    /// The layout of the pins.
    pub layout: u32,
    /// The oldest layout whose agents can use them.
    pub oldest_reader: u32,
}

/// One step from layout `from` to `from + 1`.
#[derive(Clone, Copy)]
pub struct Migration {
    pub from: u32,
    /// What changed, for the log.
    pub what: &'static str,
    /// Copies the old maps' entries into the new ones, converted, never over an entry already
    /// there ([`copy_hash`]); returns how many it copied. Runs twice (see the module doc), so a
    /// second run copies only what appeared since the first.
    pub copy: fn(&PinLayout) -> Result<usize>,
    /// The old layout's maps this step replaced, unpinned once the new programs are attached.
    pub retired: &'static [&'static str],
}

impl std::fmt::Debug for Migration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Migration")
            .field("from", &self.from)
            .field("what", &self.what)
            .field("retired", &self.retired)
            .finish()
    }
}

/// What to do with a pin directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No pinned maps: create them, mark them with this layout.
    Fresh,
    /// Pins of layout `from` (at most this one): adopt them, migrating from `from`.
    Adopt { from: u32 },
    /// Pins of a newer layout that agents of this one can use: adopt them, keep their marker.
    AdoptNewer { pins: Marker },
}

/// Pure: the verdict on a pin directory holding `marker` (if any) and pinned maps
/// (`has_pins`), for an agent of layout `current`.
pub fn verdict(
    dir: &std::path::Path,
    marker: Option<Marker>,
    has_pins: bool,
    current: u32,
) -> Result<Verdict> {
    match marker {
        None if !has_pins => Ok(Verdict::Fresh),
        None => Ok(Verdict::Adopt {
            from: UNMARKED_LAYOUT,
        }),
        Some(m) if m.layout <= current => Ok(Verdict::Adopt { from: m.layout }),
        Some(m) if m.oldest_reader <= current => Ok(Verdict::AdoptNewer { pins: m }),
        Some(m) => Err(Error::NewerLayout {
            dir: dir.to_path_buf(),
            found: m.layout,
            oldest_reader: m.oldest_reader,
            known: current,
        }),
    }
}

/// Pure: the migrations that take layout `from` to `to`, in order; an error names a missing one.
pub fn chain(migrations: &[Migration], from: u32, to: u32) -> Result<Vec<Migration>> {
    (from..to)
        .map(|layout| {
            migrations
                .iter()
                .find(|m| m.from == layout)
                .copied()
                .ok_or_else(|| Error::Layout {
                    what: format!(
                        "no migration from map layout {layout} to {} (pins of layout {from}, this \
                         agent's is {to}): run `kube-proxy-ebpf cleanup` (drops every flow) and \
                         start again",
                        layout + 1
                    ),
                })
        })
        .collect()
}

/// A pin directory's layout, checked before the maps are adopted, and the migrations to run.
#[derive(Debug)]
pub struct Migrator {
    pins: PinLayout,
    verdict: Verdict,
    current: Marker,
    steps: Vec<Migration>,
}

impl Migrator {
    /// Reads the marker of `pins` and decides (see [`verdict`]) for an agent of layout
    /// `current.layout`: refuses pins it cannot use, before anything is touched.
    pub fn prepare(pins: &PinLayout, migrations: &[Migration], current: Marker) -> Result<Self> {
        let marker = read_marker(pins)?;
        let has_pins = pins.map(proxy_common::MAP_SERVICES).exists();
        let verdict = verdict(&pins.dir, marker, has_pins, current.layout)?;
        let steps = match verdict {
            Verdict::Adopt { from } => chain(migrations, from, current.layout)?,
            Verdict::Fresh | Verdict::AdoptNewer { .. } => Vec::new(),
        };
        Ok(Self {
            pins: pins.clone(),
            verdict,
            current,
            steps,
        })
    }

    /// [`Migrator::prepare`] for this release's layout and [`MIGRATIONS`].
    pub fn for_this_release(pins: &PinLayout) -> Result<Self> {
        Self::prepare(
            pins,
            MIGRATIONS,
            Marker {
                layout: LAYOUT_VERSION,
                oldest_reader: LAYOUT_OLDEST_READER,
            },
        )
    }

    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    /// Layout migrations still to finish.
    pub fn pending(&self) -> usize {
        self.steps.len()
    }

    /// After the maps are loaded (new ones created, others adopted), before any program is
    /// swapped: with nothing to migrate, marks the pins with this layout; else copies the old
    /// maps' entries into the new ones. Returns the entries copied.
    pub fn after_load(&self) -> Result<usize> {
        if matches!(self.verdict, Verdict::AdoptNewer { .. }) {
            return Ok(0);
        }
        if self.steps.is_empty() {
            write_marker(&self.pins, self.current)?;
            return Ok(0);
        }
        let mut copied = 0;
        for step in &self.steps {
            let n = (step.copy)(&self.pins)?;
            tracing::info!(
                from = step.from,
                to = step.from + 1,
                entries = n,
                "map layout migration: {} (copied before the program swap)",
                step.what
            );
            copied += n;
        }
        Ok(copied)
    }

    /// The old maps the pending steps unpin in [`Migrator::after_attach`] (the pin keeper must
    /// stop holding them, or it would pin them again).
    pub fn retiring(&self) -> Vec<&'static str> {
        self.steps
            .iter()
            .flat_map(|s| s.retired.iter().copied())
            .collect()
    }

    /// After the new programs are attached (the old ones no longer write the old maps): copies
    /// what the old programs created since [`Migrator::after_load`], unpins the old maps and
    /// marks the pins with this layout. Returns the entries copied; nothing to do without
    /// migrations.
    pub fn after_attach(&mut self) -> Result<usize> {
        let steps = std::mem::take(&mut self.steps);
        let mut copied = 0;
        for step in &steps {
            let n = (step.copy)(&self.pins)?;
            for name in step.retired {
                let path = self.pins.map(name);
                remove_if_exists(&path).map_err(|source| Error::Io {
                    what: format!("unpinning the retired {}", path.display()),
                    source,
                })?;
            }
            tracing::info!(
                from = step.from,
                to = step.from + 1,
                entries = n,
                retired = ?step.retired,
                "map layout migration done: {} (copied after the program swap)",
                step.what
            );
            copied += n;
        }
        // Marked only now: an agent stopped before this point migrates again (the copies skip
        // what is there, the retired maps are gone or still whole).
        if !steps.is_empty() {
            write_marker(&self.pins, self.current)?;
        }
        Ok(copied)
    }
}

/// The marker of `pins`, `None` when there is none; an error when something else is pinned
/// under its name.
pub fn read_marker(pins: &PinLayout) -> Result<Option<Marker>> {
    let path = pins.map(MAP_LAYOUT);
    if !path.exists() {
        return Ok(None);
    }
    let bad = |why: String| Error::Layout {
        what: format!(
            "the layout marker {} {why}: not this agent's; run `kube-proxy-ebpf cleanup` or \
             remove it",
            path.display()
        ),
    };
    let data = MapData::from_pin(&path).map_err(|e| bad(format!("cannot be opened ({e})")))?;
    let array: Array<_, u32> =
        Array::try_from(Map::Array(data)).map_err(|e| bad(format!("is not a u32 array ({e})")))?;
    let get = |i: u32| {
        array
            .get(&i, 0)
            .map_err(|e| bad(format!("has no entry {i} ({e})")))
    };
    Ok(Some(Marker {
        layout: get(0)?,
        oldest_reader: get(1)?,
    }))
}

/// Writes `marker` into the pin directory's marker, creating and pinning it if missing.
pub fn write_marker(pins: &PinLayout, marker: Marker) -> Result<()> {
    let path = pins.map(MAP_LAYOUT);
    let map_err = |source| Error::Map {
        name: MAP_LAYOUT,
        source,
    };
    let data = if path.exists() {
        MapData::from_pin(&path).map_err(map_err)?
    } else {
        let data = MapData::create(marker_definition(), MAP_LAYOUT, None).map_err(map_err)?;
        data.pin(&path).map_err(|e| Error::Io {
            what: format!("pinning the layout marker at {}", path.display()),
            source: std::io::Error::other(e.to_string()),
        })?;
        data
    };
    let mut array: Array<_, u32> = Array::try_from(Map::Array(data)).map_err(map_err)?;
    array.set(0, marker.layout, 0).map_err(map_err)?;
    array.set(1, marker.oldest_reader, 0).map_err(map_err)?;
    Ok(())
}

/// The marker's kernel map: an array of two `u32`.
fn marker_definition() -> aya_obj::Map {
    aya_obj::Map::Legacy(aya_obj::maps::LegacyMap {
        def: aya_obj::maps::bpf_map_def {
            map_type: aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
            key_size: 4,
            value_size: 4,
            max_entries: 2,
            map_flags: 0,
            id: 0,
            pinning: aya_obj::maps::PinningType::None,
        },
        inner_def: None,
        section_index: 0,
        section_kind: aya_obj::EbpfSectionKind::Maps,
        symbol_index: None,
        data: Vec::new(),
    })
}

/// What a [`copy_hash`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copied {
    /// Entries written into the new map.
    pub copied: usize,
    /// Entries the new map already had (written by the new programs, or an earlier pass).
    pub present: usize,
    /// Entries `convert` dropped.
    pub dropped: usize,
}

/// Copies the entries of the pinned hash (or LRU hash) map `old` into the pinned `new`, each
/// converted by `convert` (`None` drops it), never over a key `new` already holds. A missing
/// `old` (already retired) copies nothing. The tool of a [`Migration::copy`].
pub fn copy_hash<K1, V1, K2, V2>(
    pins: &PinLayout,
    old: &'static str,
    new: &'static str,
    convert: impl Fn(&K1, &V1) -> Option<(K2, V2)>,
) -> Result<Copied>
where
    K1: aya::Pod,
    V1: aya::Pod,
    K2: aya::Pod,
    V2: aya::Pod,
{
    if !pins.map(old).exists() {
        return Ok(Copied::default());
    }
    let from: HashMap<_, K1, V1> = open_hash(pins, old)?;
    let mut to: HashMap<_, K2, V2> = open_hash(pins, new)?;
    let mut done = Copied::default();
    for entry in from.iter() {
        // An entry evicted or deleted between the key walk and its lookup is skipped.
        let Ok((key, value)) = entry else { continue };
        let Some((k, v)) = convert(&key, &value) else {
            done.dropped += 1;
            continue;
        };
        if to.get(&k, 0).is_ok() {
            done.present += 1;
            continue;
        }
        // BPF_NOEXIST: an entry the new programs wrote since the lookup wins.
        match to.insert(k, v, u64::from(aya_obj::generated::BPF_NOEXIST)) {
            Ok(()) => done.copied += 1,
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                done.present += 1
            }
            Err(source) => return Err(Error::Map { name: new, source }),
        }
    }
    Ok(done)
}

/// A pinned hash or LRU hash map, typed.
fn open_hash<K: aya::Pod, V: aya::Pod>(
    pins: &PinLayout,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>> {
    let map_err = |source| Error::Map { name, source };
    let data = MapData::from_pin(pins.map(name)).map_err(map_err)?;
    let kind = data.info().map_err(map_err)?.map_type();
    let map = match kind {
        Ok(MapType::LruHash) => Map::LruHashMap(data),
        _ => Map::HashMap(data),
    };
    HashMap::try_from(map).map_err(map_err)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const DIR: &str = "/sys/fs/bpf/kpe";

    fn marker(layout: u32, oldest_reader: u32) -> Option<Marker> {
        Some(Marker {
            layout,
            oldest_reader,
        })
    }

    #[test]
    fn verdicts_by_marker() {
        let v = |m, has_pins| verdict(Path::new(DIR), m, has_pins, 3);
        assert_eq!(v(None, false).unwrap(), Verdict::Fresh);
        assert_eq!(
            v(None, true).unwrap(),
            Verdict::Adopt {
                from: UNMARKED_LAYOUT
            },
            "pins of a release before the marker"
        );
        assert_eq!(v(marker(3, 3), true).unwrap(), Verdict::Adopt { from: 3 });
        assert_eq!(v(marker(2, 1), true).unwrap(), Verdict::Adopt { from: 2 });
        // A marker without maps (a first agent that stopped between the two): as marked.
        assert_eq!(v(marker(3, 3), false).unwrap(), Verdict::Adopt { from: 3 });
        assert_eq!(
            v(marker(4, 2), true).unwrap(),
            Verdict::AdoptNewer {
                pins: Marker {
                    layout: 4,
                    oldest_reader: 2
                }
            },
            "a newer layout that only added maps"
        );
        let err = v(marker(5, 5), true).unwrap_err();
        assert!(
            matches!(
                err,
                Error::NewerLayout {
                    found: 5,
                    oldest_reader: 5,
                    known: 3,
                    ..
                }
            ),
            "{err}"
        );
        let msg = err.to_string();
        for part in ["layout 5", "up to 3", "cleanup", DIR] {
            assert!(msg.contains(part), "{part:?} not in {msg:?}");
        }
    }

    fn nothing(_: &PinLayout) -> Result<usize> {
        Ok(0)
    }

    #[test]
    fn chains_are_consecutive_and_gaps_are_named() {
        let m = |from| Migration {
            from,
            what: "test",
            copy: nothing,
            retired: &[],
        };
        let all = [m(0), m(1), m(2)];
        let froms = |c: Vec<Migration>| c.iter().map(|m| m.from).collect::<Vec<_>>();
        assert_eq!(froms(chain(&all, 0, 3).unwrap()), [0, 1, 2]);
        assert_eq!(froms(chain(&all, 2, 3).unwrap()), [2]);
        assert!(chain(&all, 3, 3).unwrap().is_empty());
        let gap = chain(&[m(0), m(2)], 0, 3).unwrap_err().to_string();
        assert!(gap.contains("no migration from map layout 1 to 2"), "{gap}");
    }

    #[test]
    fn this_release_migrates_every_older_layout() {
        const { assert!(LAYOUT_OLDEST_READER <= LAYOUT_VERSION) };
        assert_eq!(
            chain(MIGRATIONS, UNMARKED_LAYOUT, LAYOUT_VERSION)
                .unwrap()
                .len(),
            (LAYOUT_VERSION - UNMARKED_LAYOUT) as usize
        );
    }
}

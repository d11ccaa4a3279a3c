//! Id allocation for backends and rev-NAT entries: the smallest free id ≥ 1 (0 means "none").
//!
//! The allocator holds no state across syncs: `diff` seeds it with the ids the maps already
//! use, so ids are derived from what is programmed and cannot drift from it.

use crate::pipeline::fast_hash::HashSet;

/// Hands out the smallest ids ≥ 1 not in a given used set, in increasing order.
#[derive(Clone, Debug, Default)]
pub struct IdAllocator {
    used: HashSet<u32>,
    /// Every id below `next` is used or was handed out.
    next: u32,
}

impl IdAllocator {
    /// An allocator that never returns an id in `used` (0 is ignored: it is never handed out).
    pub fn new(used: impl IntoIterator<Item = u32>) -> Self {
        Self {
            used: used.into_iter().collect(),
            next: 1,
        }
    }

    /// The smallest free id, now marked used; `None` when all of 1..=u32::MAX are taken.
    pub fn allocate(&mut self) -> Option<u32> {
        // `next` only moves forward: ids below it are used or already handed out, so the scan is
        // amortised O(used + allocated) over the allocator's life.
        while self.next != 0 && self.used.contains(&self.next) {
            self.next = self.next.wrapping_add(1);
        }
        if self.next == 0 {
            return None;
        }
        let id = self.next;
        self.used.insert(id);
        self.next = self.next.wrapping_add(1);
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_id_is_one_never_zero() {
        let mut ids = IdAllocator::new([]);
        assert_eq!(ids.allocate(), Some(1));
        assert_eq!(ids.allocate(), Some(2));
        let mut ids = IdAllocator::new([0]);
        assert_eq!(ids.allocate(), Some(1));
    }

    #[test]
    fn smallest_free_id_fills_holes_in_order() {
        let mut ids = IdAllocator::new([1, 2, 4, 7]);
        let got: Vec<_> = (0..4).map(|_| ids.allocate()).collect();
        assert_eq!(got, [Some(3), Some(5), Some(6), Some(8)]);
    }

    #[test]
    fn exhaustion_returns_none_instead_of_wrapping_to_zero() {
        let mut ids = IdAllocator::new([]);
        ids.next = u32::MAX;
        assert_eq!(ids.allocate(), Some(u32::MAX));
        assert_eq!(ids.allocate(), None);
        assert_eq!(ids.allocate(), None);
    }
}

//! The waiting room's order and bounds, without time or channels: one band
//! per priority, served highest first; within a band the flows (fairness
//! ids) take turns; within a flow, first come first served. When a bound
//! would be passed, the lowest priority gives way: the newest request of
//! the longest flow in the lowest band is shed, never a request of a
//! priority at or above the newcomer's.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// A waiting request's handle in the queue.
pub type Id = u64;

/// What may wait at once, all bands together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub requests: usize,
    pub bytes: u64,
}

/// Why a request was refused a place, or lost it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// Waiting requests reached `maxRequests`.
    Requests,
    /// Waiting bodies reached `maxBytes`.
    Bytes,
}

impl Shed {
    pub fn reason(self) -> &'static str {
        match self {
            Shed::Requests => "max_requests",
            Shed::Bytes => "max_bytes",
        }
    }
}

struct Entry<T> {
    priority: i32,
    flow: String,
    /// The rule it waits for: a newcomer of that rule queues behind it.
    rule: String,
    bytes: u64,
    payload: T,
}

/// One priority's flows, the next to be served at the front.
#[derive(Default)]
struct Band {
    flows: VecDeque<(String, VecDeque<Id>)>,
}

impl Band {
    fn flow_mut(&mut self, flow: &str) -> Option<&mut VecDeque<Id>> {
        self.flows
            .iter_mut()
            .find(|(name, _)| name == flow)
            .map(|(_, ids)| ids)
    }
}

pub struct Queue<T> {
    bands: BTreeMap<i32, Band>,
    entries: HashMap<Id, Entry<T>>,
    bytes: u64,
    /// Requests and bytes by priority, kept as entries come and go (read
    /// at every change, for `/metrics`).
    depths: BTreeMap<i32, (usize, u64)>,
    next: Id,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            bands: BTreeMap::new(),
            entries: HashMap::new(),
            bytes: 0,
            depths: BTreeMap::new(),
            next: 0,
        }
    }
}

/// Where a request waits, as the queue orders it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub priority: i32,
    /// Its flow within the priority (the fairness id).
    pub flow: String,
    /// The rule it waits for.
    pub rule: String,
    pub bytes: u64,
}

/// A request admitted, and those shed to make room for it.
pub struct Admitted<T> {
    pub id: Id,
    pub shed: Vec<(T, i32, Shed)>,
}

impl<T> Queue<T> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    #[cfg(test)]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Waiting requests and their bytes, by priority.
    pub(crate) fn depth_by_priority(&self) -> &BTreeMap<i32, (usize, u64)> {
        &self.depths
    }

    /// Whether a request of `rule` at `priority` or above is waiting: a
    /// newcomer of that rule and priority must not take room before it.
    pub(crate) fn waiting_ahead(&self, rule: &str, priority: i32) -> bool {
        self.bands
            .range(priority..)
            .flat_map(|(_, band)| band.flows.iter().flat_map(|(_, ids)| ids))
            .any(|id| self.entries.get(id).is_some_and(|e| e.rule == rule))
    }

    /// Places a request at the back of its flow, shedding lower priorities
    /// if the bounds need it; `Err` when only the newcomer itself (or an
    /// equal or higher priority) could give way.
    pub fn admit(
        &mut self,
        place: &Place,
        payload: T,
        bounds: Bounds,
    ) -> Result<Admitted<T>, (T, Shed)> {
        let (priority, flow, bytes) = (place.priority, place.flow.as_str(), place.bytes);
        let victims = match self.victims(priority, bytes, bounds) {
            Ok(v) => v,
            Err(shed) => return Err((payload, shed)),
        };
        let shed = victims
            .into_iter()
            .filter_map(|(id, why)| {
                let e = self.remove(id)?;
                Some((e.payload, e.priority, why))
            })
            .collect();
        let id = self.next;
        self.next += 1;
        let band = self.bands.entry(priority).or_default();
        match band.flow_mut(flow) {
            Some(ids) => ids.push_back(id),
            None => band
                .flows
                .push_back((flow.to_string(), VecDeque::from([id]))),
        }
        self.bytes += bytes;
        let depth = self.depths.entry(priority).or_default();
        depth.0 += 1;
        depth.1 += bytes;
        let entry = Entry {
            priority,
            flow: flow.to_string(),
            rule: place.rule.clone(),
            bytes,
            payload,
        };
        self.entries.insert(id, entry);
        Ok(Admitted { id, shed })
    }

    /// Who must leave for a newcomer of `priority` and `bytes` to fit:
    /// from the lowest band up, strictly below the newcomer.
    fn victims(&self, priority: i32, bytes: u64, bounds: Bounds) -> Result<Vec<(Id, Shed)>, Shed> {
        let over = |count: usize, total: u64| {
            if count + 1 > bounds.requests {
                Some(Shed::Requests)
            } else if total + bytes > bounds.bytes {
                Some(Shed::Bytes)
            } else {
                None
            }
        };
        let (mut count, mut total) = (self.entries.len(), self.bytes);
        if over(count, total).is_none() {
            return Ok(Vec::new());
        }
        let mut victims = Vec::new();
        for (&band_priority, band) in &self.bands {
            if band_priority >= priority {
                break;
            }
            for id in shed_order(band) {
                let Some(why) = over(count, total) else {
                    return Ok(victims);
                };
                victims.push((id, why));
                count -= 1;
                total -= self.entries[&id].bytes;
            }
        }
        match over(count, total) {
            None => Ok(victims),
            Some(why) => Err(why),
        }
    }

    /// Each flow's first request, bands highest first and flows in turn:
    /// the order in which waiting requests are offered room.
    pub(crate) fn heads(&self) -> Vec<Id> {
        self.bands
            .values()
            .rev()
            .flat_map(|band| {
                band.flows
                    .iter()
                    .filter_map(|(_, ids)| ids.front().copied())
            })
            .collect()
    }

    /// The request `id` had its turn and stays: if it heads its flow, the
    /// flow goes to the back of its band, so that every flow of a band has
    /// turns however many there are.
    pub(crate) fn passed_over(&mut self, id: Id) {
        let Some(entry) = self.entries.get(&id) else {
            return;
        };
        let Some(band) = self.bands.get_mut(&entry.priority) else {
            return;
        };
        let at = band
            .flows
            .iter()
            .position(|(name, ids)| *name == entry.flow && ids.front() == Some(&id));
        if let Some(flow) = at.and_then(|at| band.flows.remove(at)) {
            band.flows.push_back(flow);
        }
    }

    /// The rule the request `id` waits for.
    pub(crate) fn rule_of(&self, id: Id) -> Option<&str> {
        self.entries.get(&id).map(|e| e.rule.as_str())
    }

    pub(crate) fn payload(&self, id: Id) -> Option<&T> {
        self.entries.get(&id).map(|e| &e.payload)
    }

    /// A request leaves (dispatched, expired or gone). A flow whose head
    /// left goes to the back of its band: the next turn is another flow's.
    pub fn remove(&mut self, id: Id) -> Option<RemovedEntry<T>> {
        let entry = self.entries.remove(&id)?;
        self.bytes -= entry.bytes;
        if let Some(depth) = self.depths.get_mut(&entry.priority) {
            depth.0 -= 1;
            depth.1 -= entry.bytes;
            if depth.0 == 0 {
                self.depths.remove(&entry.priority);
            }
        }
        let band = self.bands.get_mut(&entry.priority)?;
        let at = band
            .flows
            .iter()
            .position(|(name, _)| *name == entry.flow)?;
        let (_, ids) = &mut band.flows[at];
        let was_head = ids.front() == Some(&id);
        ids.retain(|&other| other != id);
        if ids.is_empty() {
            band.flows.remove(at);
        } else if was_head && let Some(flow) = band.flows.remove(at) {
            band.flows.push_back(flow);
        }
        if band.flows.is_empty() {
            self.bands.remove(&entry.priority);
        }
        Some(RemovedEntry {
            priority: entry.priority,
            payload: entry.payload,
        })
    }
}

pub(crate) struct RemovedEntry<T> {
    pub priority: i32,
    pub payload: T,
}

/// A band's requests in the order they are shed: the newest of the
/// longest flow first, so one flow flooding a band pays for itself.
fn shed_order(band: &Band) -> Vec<Id> {
    let mut flows: Vec<Vec<Id>> = band
        .flows
        .iter()
        .map(|(_, ids)| ids.iter().copied().collect())
        .collect();
    let mut order = Vec::new();
    while let Some(longest) = flows
        .iter_mut()
        .filter(|ids| !ids.is_empty())
        .max_by_key(|ids| ids.len())
    {
        order.extend(longest.pop());
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOMY: Bounds = Bounds {
        requests: 100,
        bytes: 1 << 20,
    };

    fn place(priority: i32, flow: &str, bytes: u64) -> Place {
        Place {
            priority,
            flow: flow.into(),
            rule: "r".into(),
            bytes,
        }
    }

    fn admit(q: &mut Queue<&'static str>, priority: i32, flow: &str, name: &'static str) -> Id {
        q.admit(&place(priority, flow, 10), name, ROOMY)
            .ok()
            .unwrap()
            .id
    }

    fn names(q: &Queue<&'static str>) -> Vec<&'static str> {
        q.heads()
            .iter()
            .map(|id| *q.payload(*id).unwrap())
            .collect()
    }

    #[test]
    fn the_highest_priority_is_offered_room_first() {
        let mut q = Queue::default();
        admit(&mut q, 0, "a", "low");
        admit(&mut q, 10, "a", "high");
        admit(&mut q, -5, "a", "sheddable");
        assert_eq!(names(&q), ["high", "low", "sheddable"]);
    }

    #[test]
    fn flows_of_a_band_take_turns_and_each_is_first_come_first_served() {
        let mut q = Queue::default();
        let a1 = admit(&mut q, 0, "a", "a1");
        admit(&mut q, 0, "a", "a2");
        admit(&mut q, 0, "a", "a3");
        let b1 = admit(&mut q, 0, "b", "b1");
        assert_eq!(names(&q), ["a1", "b1"]);
        q.remove(a1);
        // a was served: b's turn comes first now.
        assert_eq!(names(&q), ["b1", "a2"]);
        q.remove(b1);
        assert_eq!(names(&q), ["a2"]);
    }

    #[test]
    fn a_request_leaving_from_behind_its_flows_head_keeps_the_turn_order() {
        let mut q = Queue::default();
        admit(&mut q, 0, "a", "a1");
        let a2 = admit(&mut q, 0, "a", "a2");
        admit(&mut q, 0, "b", "b1");
        q.remove(a2);
        assert_eq!(names(&q), ["a1", "b1"]);
        assert_eq!(q.len(), 2);
        assert_eq!(q.bytes(), 20);
    }

    #[test]
    fn at_the_request_bound_the_lowest_priority_is_shed_for_a_higher_one() {
        let bounds = Bounds {
            requests: 2,
            bytes: 1 << 20,
        };
        let mut q = Queue::default();
        q.admit(&place(0, "a", 1), "low-old", bounds).ok().unwrap();
        q.admit(&place(0, "a", 1), "low-new", bounds).ok().unwrap();
        let admitted = q.admit(&place(5, "a", 1), "high", bounds).ok().unwrap();
        let shed: Vec<_> = admitted
            .shed
            .iter()
            .map(|(n, p, why)| (*n, *p, *why))
            .collect();
        assert_eq!(shed, [("low-new", 0, Shed::Requests)]);
        assert_eq!(names(&q), ["high", "low-old"]);
    }

    #[test]
    fn a_newcomer_no_higher_than_the_lowest_waiting_is_itself_refused() {
        let bounds = Bounds {
            requests: 1,
            bytes: 1 << 20,
        };
        let mut q = Queue::default();
        q.admit(&place(0, "a", 1), "first", bounds).ok().unwrap();
        let refused = q.admit(&place(0, "b", 1), "same", bounds).err().unwrap();
        assert_eq!(refused, ("same", Shed::Requests));
        let refused = q.admit(&place(-1, "b", 1), "lower", bounds).err().unwrap();
        assert_eq!(refused, ("lower", Shed::Requests));
        assert_eq!(names(&q), ["first"]);
    }

    #[test]
    fn the_byte_bound_sheds_until_the_newcomer_fits_and_only_then() {
        let bounds = Bounds {
            requests: 100,
            bytes: 100,
        };
        let mut q = Queue::default();
        q.admit(&place(0, "a", 40), "a40", bounds).ok().unwrap();
        q.admit(&place(0, "b", 40), "b40", bounds).ok().unwrap();
        q.admit(&place(1, "c", 20), "c20", bounds).ok().unwrap();
        // 70 bytes at priority 1: two of priority 0 must go.
        let admitted = q.admit(&place(1, "d", 70), "d70", bounds).ok().unwrap();
        assert_eq!(admitted.shed.len(), 2);
        assert!(
            admitted
                .shed
                .iter()
                .all(|(_, p, why)| *p == 0 && *why == Shed::Bytes)
        );
        assert_eq!(q.bytes(), 90);
        // 30 more at priority 1: only equal priorities are left, so the
        // newcomer is refused and nobody is shed.
        let refused = q.admit(&place(1, "e", 30), "e30", bounds).err().unwrap();
        assert_eq!(refused, ("e30", Shed::Bytes));
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn the_longest_flow_of_the_lowest_band_pays_for_a_flood() {
        let bounds = Bounds {
            requests: 4,
            bytes: 1 << 20,
        };
        let mut q = Queue::default();
        for name in ["flood1", "flood2", "flood3"] {
            q.admit(&place(0, "flood", 1), name, bounds).ok().unwrap();
        }
        q.admit(&place(0, "quiet", 1), "quiet1", bounds)
            .ok()
            .unwrap();
        let admitted = q.admit(&place(3, "vip", 1), "vip1", bounds).ok().unwrap();
        assert_eq!(admitted.shed[0].0, "flood3");
    }

    #[test]
    fn a_flow_passed_over_goes_behind_the_others_of_its_band() {
        let mut q = Queue::default();
        let a1 = admit(&mut q, 0, "a", "a1");
        admit(&mut q, 0, "b", "b1");
        admit(&mut q, 0, "c", "c1");
        admit(&mut q, 5, "h", "h1");
        q.passed_over(a1);
        assert_eq!(names(&q), ["h1", "b1", "c1", "a1"]);
        // Only a flow's head moves its flow.
        let mut q = Queue::default();
        admit(&mut q, 0, "a", "a1");
        let a2 = admit(&mut q, 0, "a", "a2");
        admit(&mut q, 0, "b", "b1");
        q.passed_over(a2);
        assert_eq!(names(&q), ["a1", "b1"]);
    }

    #[test]
    fn a_rule_has_waiting_ahead_at_its_own_priority_and_below_a_higher_one() {
        let mut q = Queue::default();
        q.admit(&place(5, "a", 1), "x", ROOMY).ok().unwrap();
        assert!(q.waiting_ahead("r", 5));
        assert!(q.waiting_ahead("r", 0));
        assert!(!q.waiting_ahead("r", 6), "a higher priority goes first");
        assert!(!q.waiting_ahead("other-rule", 0));
    }

    #[test]
    fn depths_follow_every_admission_and_removal() {
        let mut q = Queue::default();
        let a = q.admit(&place(1, "a", 30), "a", ROOMY).ok().unwrap().id;
        q.admit(&place(1, "b", 20), "b", ROOMY).ok().unwrap();
        q.admit(&place(-1, "c", 5), "c", ROOMY).ok().unwrap();
        assert_eq!(
            q.depth_by_priority()
                .iter()
                .map(|(k, v)| (*k, *v))
                .collect::<Vec<_>>(),
            [(-1, (1, 5)), (1, (2, 50))]
        );
        q.remove(a);
        assert_eq!(q.depth_by_priority().get(&1), Some(&(1, 20)));
    }

    #[test]
    fn an_empty_queue_keeps_no_band_or_flow() {
        let mut q = Queue::default();
        let a = admit(&mut q, 7, "a", "a");
        assert!(q.remove(a).is_some());
        assert!(q.is_empty());
        assert!(q.bands.is_empty());
        assert!(q.depths.is_empty());
        assert!(q.remove(a).is_none());
    }
}

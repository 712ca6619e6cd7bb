//! The placement terms of the `PredictedTTFT` objective.
//!
//! A tier that says `minimize: PredictedTTFT` ranks local candidates by
//! their TTFT prediction plus what placing the request there costs the
//! requests that follow it: its prompt's group comes back to where it went.
//! Each such cost is a named term with its value in seconds, shown beside
//! the prediction in explain traces. Predicates (`exclude`, a tier's `if`)
//! and `maximize` read the prediction alone.

use std::fmt;

use serde::de::{Error as _, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::duration::{format_seconds, parse_duration};

/// One named term (see `docs/policy-language.md`, "The PredictedTTFT
/// objective").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlacementTerm {
    /// The prompt's new blocks would not fit beside the Pod's working set,
    /// or the Pod is loaded above its model's mean for a prompt cached
    /// nowhere: its groups would be prefilled again.
    Room,
    /// The Pod carries a hot group: another group placed there would queue
    /// behind it, leave, and pay its prefill a second time.
    HotCarrier,
    /// The Pod would become a new replica of a prefix the best-cached Pods
    /// hold with requests waiting: its prefill is shared among the
    /// requests that reuse the prefix (a negative term).
    ReplicaShare,
    /// The reused blocks a new replica would push out of the Pod's cache
    /// now, beyond what `room` already counts.
    ReplicaEvictions,
}

impl PlacementTerm {
    pub const ALL: [PlacementTerm; 4] = [
        PlacementTerm::Room,
        PlacementTerm::HotCarrier,
        PlacementTerm::ReplicaShare,
        PlacementTerm::ReplicaEvictions,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PlacementTerm::Room => "room",
            PlacementTerm::HotCarrier => "hotCarrier",
            PlacementTerm::ReplicaShare => "replicaShare",
            PlacementTerm::ReplicaEvictions => "replicaEvictions",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        PlacementTerm::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// A candidate's placement terms, in seconds, in the order they were
/// priced. Empty for a provider and wherever the EPP prices none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Placement(Vec<(PlacementTerm, f64)>);

impl Placement {
    /// Adds `term`; a zero adds nothing, so a trace shows only what counted.
    pub fn add(&mut self, term: PlacementTerm, seconds: f64) {
        if seconds != 0.0 {
            self.0.push((term, seconds));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn terms(&self) -> &[(PlacementTerm, f64)] {
        &self.0
    }

    pub fn get(&self, term: PlacementTerm) -> Option<f64> {
        self.0.iter().find(|(t, _)| *t == term).map(|(_, s)| *s)
    }

    /// Seconds the terms add to the prediction.
    pub fn total(&self) -> f64 {
        self.0.iter().map(|(_, s)| s).sum()
    }
}

/// ` - replicaShare 300ms + room 30ms`: what traces write after the
/// prediction.
impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (term, seconds) in &self.0 {
            let sign = if *seconds < 0.0 { '-' } else { '+' };
            let magnitude = format_seconds(seconds.abs());
            write!(f, " {sign} {} {magnitude}", term.name())?;
        }
        Ok(())
    }
}

/// Written as a map of term name to duration, as candidate files write
/// durations: `{ room: 30ms, replicaShare: -300ms }`.
impl Serialize for Placement {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (term, seconds) in &self.0 {
            map.serialize_entry(term.name(), &format!("{}ms", seconds * 1000.0))?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Placement {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(PlacementVisitor)
    }
}

struct PlacementVisitor;

impl<'de> Visitor<'de> for PlacementVisitor {
    type Value = Placement;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of placement term to duration, as in `{ room: 30ms }`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Placement, A::Error> {
        let mut placement = Placement::default();
        while let Some((name, text)) = map.next_entry::<String, String>()? {
            let term = PlacementTerm::parse(&name).ok_or_else(|| {
                let known: Vec<_> = PlacementTerm::ALL.iter().map(|t| t.name()).collect();
                A::Error::custom(format!(
                    "unknown placement term `{name}` (known: {})",
                    known.join(", ")
                ))
            })?;
            let seconds =
                signed_seconds(&text).map_err(|e| A::Error::custom(format!("{name}: {e}")))?;
            placement.add(term, seconds);
        }
        Ok(placement)
    }
}

/// A duration that may be negative: `-300ms`.
fn signed_seconds(text: &str) -> Result<f64, String> {
    let text = text.trim();
    let (sign, magnitude) = match text.strip_prefix('-') {
        Some(rest) => (-1.0, rest),
        None => (1.0, text),
    };
    Ok(sign * parse_duration(magnitude)?.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(terms: &[(PlacementTerm, f64)]) -> Placement {
        let mut p = Placement::default();
        for &(term, seconds) in terms {
            p.add(term, seconds);
        }
        p
    }

    #[test]
    fn terms_add_up_and_a_zero_is_not_shown() {
        let p = placement(&[
            (PlacementTerm::ReplicaShare, -0.3),
            (PlacementTerm::Room, 0.03),
            (PlacementTerm::ReplicaEvictions, 0.0),
        ]);
        assert!((p.total() - -0.27).abs() < 1e-12);
        assert_eq!(p.to_string(), " - replicaShare 300ms + room 30ms");
        assert_eq!(p.get(PlacementTerm::ReplicaEvictions), None);
        assert!(placement(&[(PlacementTerm::Room, 0.0)]).is_empty());
    }

    #[test]
    fn written_and_read_back_as_durations() {
        let p = placement(&[
            (PlacementTerm::HotCarrier, 0.25),
            (PlacementTerm::ReplicaShare, -0.5),
        ]);
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(
            json,
            serde_json::json!({ "hotCarrier": "250ms", "replicaShare": "-500ms" })
        );
        assert_eq!(serde_json::from_value::<Placement>(json).unwrap(), p);
    }

    #[test]
    fn an_unknown_term_or_a_bare_number_is_refused() {
        let unknown = serde_json::from_value::<Placement>(serde_json::json!({ "rooms": "1ms" }));
        insta::assert_snapshot!(unknown.unwrap_err().to_string(), @"unknown placement term `rooms` (known: room, hotCarrier, replicaShare, replicaEvictions)");
        let bare = serde_json::from_value::<Placement>(serde_json::json!({ "room": "30" }));
        assert!(bare.unwrap_err().to_string().starts_with("room: "));
    }
}

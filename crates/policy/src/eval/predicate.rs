//! Predicate semantics. An absent attribute fails every test, negated ones
//! included; only `exists: false` holds on absence (the seed's rule).

use super::input::{Request, Tags, Val};
use crate::attr::RequestAttr;
use crate::model::{Conjunction, Operand, Predicate, Test, Value};

/// Any entry (OR) whose predicates all hold (AND).
pub(crate) fn any_conjunction<'a, A: 'a>(
    entries: &'a [Conjunction<A>],
    lookup: impl Fn(&'a A) -> Option<Val<'a>> + Copy,
) -> bool {
    entries.iter().any(|entry| {
        entry
            .iter()
            .all(|p| test_holds(&p.test, lookup(&p.attr), None))
    })
}

/// One candidate-side entry; `{ request: attr }` operands read the request.
pub(crate) fn conjunction_holds<'a, A: 'a>(
    entry: &'a Conjunction<A>,
    lookup: impl Fn(&'a A) -> Option<Val<'a>>,
    request: &'a Request,
    tags: &'a Tags,
) -> bool {
    entry
        .iter()
        .all(|p| test_holds(&p.test, lookup(&p.attr), Some((request, tags))))
}

/// Whether an entry could hold once tags are known: every non-tag predicate holds.
pub(crate) fn holds_ignoring_tags(
    entry: &Conjunction<RequestAttr>,
    request: &Request,
    tags: &Tags,
) -> bool {
    entry
        .iter()
        .filter(|p| p.attr != RequestAttr::Tag)
        .all(|p| test_holds(&p.test, request.value(&p.attr, tags), None))
}

/// The first predicate of an entry that fails, for traces.
pub(crate) fn first_failing<'a, A>(
    entry: &'a Conjunction<A>,
    lookup: impl Fn(&'a A) -> Option<Val<'a>>,
) -> Option<&'a Predicate<A>> {
    entry
        .iter()
        .find(|p| !test_holds(&p.test, lookup(&p.attr), None))
}

pub(crate) fn test_holds(
    test: &Test,
    value: Option<Val<'_>>,
    request: Option<(&Request, &Tags)>,
) -> bool {
    let Some(value) = value else {
        return matches!(test, Test::Exists(false));
    };
    match (test, value) {
        (Test::Exists(expected), _) => *expected,
        (Test::OneOf(values), Val::Set(set)) => values.iter().any(|v| in_set(v, set)),
        (Test::OneOf(values), v) => values.iter().any(|x| equals(x, v)),
        (Test::NotIn(values), Val::Set(_)) => {
            debug_assert!(values.is_empty(), "compiler rejects notIn on sets");
            false
        }
        (Test::NotIn(values), v) => !values.iter().any(|x| equals(x, v)),
        (Test::Compare(cmp, operand), Val::Number(left)) => {
            let right = match operand {
                Operand::Const(n) => Some(*n),
                Operand::Request(attr) => request.and_then(|(r, t)| match r.value(attr, t) {
                    Some(Val::Number(n)) => Some(n),
                    _ => None,
                }),
            };
            right.is_some_and(|right| cmp.holds(left, right))
        }
        (Test::Prefix(p), Val::Text(s)) => s.starts_with(p.as_str()),
        (Test::Regex(re), Val::Text(s)) => re.is_match(s),
        (Test::ContainsAll(wanted), Val::Set(set)) => wanted.iter().all(|w| set.contains(w)),
        (Test::ContainsNone(wanted), Val::Set(set)) => !wanted.iter().any(|w| set.contains(w)),
        // Type mismatches are compile errors; treat any that slip through as false.
        _ => false,
    }
}

fn equals(expected: &Value, actual: Val<'_>) -> bool {
    match (expected, actual) {
        (Value::Text(e), Val::Text(a)) => e == a,
        (Value::Number(e), Val::Number(a)) => e == &a,
        _ => false,
    }
}

fn in_set(expected: &Value, set: &[String]) -> bool {
    match expected {
        Value::Text(e) => set.iter().any(|s| s == e),
        Value::Number(_) => false,
    }
}

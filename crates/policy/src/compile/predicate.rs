//! Predicates: `attribute: value | [values] | { operator: argument }`.

use serde_json::Value as Json;

use super::errors::Errors;
use crate::attr::{
    AttrType, CANDIDATE_ATTRIBUTES, CandidateAttr, CandidateType, REQUEST_ATTRIBUTES, RequestAttr,
};
use crate::duration::parse_duration;
use crate::model::{ClassifierSet, Comparison, Conjunction, Operand, Predicate, Test, Value};
use crate::pattern::PatternError;
use crate::spec::FreeForm;

/// What a predicate is evaluated against, and how its names resolve.
pub(crate) trait Side: Sized {
    const WHAT: &'static str;
    fn resolve(name: &str) -> Option<Self>;
    fn ty(&self) -> AttrType;
    fn known() -> &'static [&'static str];
    /// A hint when the name belongs to the other side.
    fn misplaced_hint(name: &str) -> Option<String>;
    fn allows_request_operand() -> bool;
    fn is_tag(&self) -> bool;
    fn is_candidate_type(&self) -> bool;
}

impl Side for RequestAttr {
    const WHAT: &'static str = "request";
    fn resolve(name: &str) -> Option<Self> {
        RequestAttr::parse(name)
    }
    fn ty(&self) -> AttrType {
        RequestAttr::ty(self)
    }
    fn known() -> &'static [&'static str] {
        REQUEST_ATTRIBUTES
    }
    fn misplaced_hint(name: &str) -> Option<String> {
        CandidateAttr::parse(name).map(|_| {
            format!(
                "{name} is a candidate attribute: use it in exclude[].drop or a select tier's if"
            )
        })
    }
    fn allows_request_operand() -> bool {
        false
    }
    fn is_tag(&self) -> bool {
        *self == RequestAttr::Tag
    }
    fn is_candidate_type(&self) -> bool {
        false
    }
}

impl Side for CandidateAttr {
    const WHAT: &'static str = "candidate";
    fn resolve(name: &str) -> Option<Self> {
        CandidateAttr::parse(name)
    }
    fn ty(&self) -> AttrType {
        CandidateAttr::ty(self)
    }
    fn known() -> &'static [&'static str] {
        CANDIDATE_ATTRIBUTES
    }
    fn misplaced_hint(name: &str) -> Option<String> {
        RequestAttr::parse(name)
            .map(|_| format!("{name} is a request attribute: test it in matches or exclude[].if"))
    }
    fn allows_request_operand() -> bool {
        true
    }
    fn is_tag(&self) -> bool {
        false
    }
    fn is_candidate_type(&self) -> bool {
        *self == CandidateAttr::Type
    }
}

/// Resolves tags to the classifiers that emit them.
pub(crate) struct TagIndex<'a> {
    pub classifiers: Vec<(&'a str, &'a [String])>,
}

impl TagIndex<'_> {
    fn emitters(&self, tag: &str) -> ClassifierSet {
        self.classifiers
            .iter()
            .enumerate()
            .filter(|(_, (_, tags))| tags.iter().any(|t| t == tag))
            .fold(ClassifierSet::default(), |set, (i, _)| set.with(i))
    }

    fn all(&self) -> ClassifierSet {
        (0..self.classifiers.len()).fold(ClassifierSet::default(), |s, i| s.with(i))
    }
}

pub(crate) struct PredicateCompiler<'a, 'e> {
    pub errors: &'e mut Errors,
    pub tags: &'a TagIndex<'a>,
    /// Classifiers the compiled predicates read.
    pub needs: ClassifierSet,
}

impl PredicateCompiler<'_, '_> {
    /// A single map (one AND-entry) or a list of maps (ORed).
    pub fn list<A: Side>(&mut self, path: &str, value: &FreeForm) -> Option<Vec<Conjunction<A>>> {
        let value = match value.json() {
            Ok(value) => value,
            Err(message) => {
                self.errors.add(path, message);
                return None;
            }
        };
        match value {
            Json::Object(map) => Some(vec![self.entry(path, map.iter())?]),
            Json::Array(items) if items.is_empty() => {
                self.errors.add(path, "empty lists are not allowed");
                None
            }
            Json::Array(items) => {
                let mut out = Vec::new();
                let mut ok = true;
                for (i, item) in items.iter().enumerate() {
                    let p = format!("{path}[{i}]");
                    match item {
                        Json::Object(map) => match self.entry(&p, map.iter()) {
                            Some(c) => out.push(c),
                            None => ok = false,
                        },
                        _ => {
                            self.errors.add(p, "expected a map of attribute: match");
                            ok = false;
                        }
                    }
                }
                ok.then_some(out)
            }
            _ => {
                self.errors.add(
                    path,
                    "expected a map of attribute: match, or a list of such maps",
                );
                None
            }
        }
    }

    /// One AND-entry: every `attribute: match` pair must hold.
    pub fn entry<'j, A: Side>(
        &mut self,
        path: &str,
        pairs: impl Iterator<Item = (&'j String, &'j Json)>,
    ) -> Option<Conjunction<A>> {
        let mut out = Vec::new();
        let mut ok = true;
        for (name, value) in pairs {
            match self.predicate(&format!("{path}.{name}"), name, value) {
                Some(p) => out.push(p),
                None => ok = false,
            }
        }
        if ok && out.is_empty() {
            self.errors.add(
                path,
                "an empty entry would match everything; remove it or add a predicate",
            );
            return None;
        }
        ok.then_some(out)
    }

    fn predicate<A: Side>(&mut self, path: &str, name: &str, value: &Json) -> Option<Predicate<A>> {
        let Some(attr) = A::resolve(name) else {
            let hint = A::misplaced_hint(name).unwrap_or_else(|| {
                format!("known {} attributes: {}", A::WHAT, A::known().join(", "))
            });
            self.errors.add(
                path,
                format!("unknown {} attribute {name:?} ({hint})", A::WHAT),
            );
            return None;
        };
        let test = self.test(path, &attr, value)?;
        if attr.is_tag() {
            self.needs = self.needs.union(self.tag_needs(&test));
        }
        Some(Predicate { attr, test })
    }

    fn tag_needs(&self, test: &Test) -> ClassifierSet {
        let named: &[_] = match test {
            Test::OneOf(v) | Test::NotIn(v) => {
                return v.iter().fold(ClassifierSet::default(), |s, v| match v {
                    Value::Text(t) => s.union(self.tags.emitters(t)),
                    Value::Number(_) => s,
                });
            }
            Test::ContainsAll(v) | Test::ContainsNone(v) => v,
            _ => return self.tags.all(),
        };
        named.iter().fold(ClassifierSet::default(), |s, t| {
            s.union(self.tags.emitters(t))
        })
    }

    fn test<A: Side>(&mut self, path: &str, attr: &A, value: &Json) -> Option<Test> {
        match value {
            Json::Array(items) if items.is_empty() => {
                self.errors.add(path, "empty lists are not allowed");
                None
            }
            Json::Array(items) => {
                let values = self.literals(path, attr, items)?;
                Some(Test::OneOf(values))
            }
            Json::Object(map) if map.len() != 1 => {
                let keys: Vec<_> = map.keys().map(String::as_str).collect();
                self.errors.add(
                    path,
                    format!(
                        "an operator map takes exactly one key, found {} ({}); put each test in its own entry",
                        map.len(),
                        if keys.is_empty() { "none".to_string() } else { keys.join(", ") }
                    ),
                );
                None
            }
            Json::Object(map) => {
                let (op, arg) = map.iter().next().expect("one key");
                self.operator(&format!("{path}.{op}"), attr, op, arg)
            }
            scalar => {
                let v = self.literal(path, attr, scalar)?;
                Some(Test::OneOf(vec![v]))
            }
        }
    }

    fn operator<A: Side>(&mut self, path: &str, attr: &A, op: &str, arg: &Json) -> Option<Test> {
        let ty = attr.ty();
        let comparison = match op {
            "greaterThan" => Some(Comparison::GreaterThan),
            "greaterThanOrEqual" => Some(Comparison::GreaterThanOrEqual),
            "lessThan" => Some(Comparison::LessThan),
            "lessThanOrEqual" => Some(Comparison::LessThanOrEqual),
            _ => None,
        };
        if let Some(cmp) = comparison {
            if !matches!(ty, AttrType::Numeric | AttrType::Duration) {
                return self.type_error(path, op, ty, "numeric or duration");
            }
            return Some(Test::Compare(cmp, self.operand::<A>(path, ty, arg)?));
        }
        match op {
            "notIn" => match arg {
                Json::Array(items) if !items.is_empty() => {
                    self.reject_set_negation(path, op, ty)?;
                    Some(Test::NotIn(self.literals(path, attr, items)?))
                }
                _ => {
                    self.errors.add(path, "notIn takes a non-empty list");
                    None
                }
            },
            "notEquals" => {
                self.reject_set_negation(path, op, ty)?;
                Some(Test::NotIn(vec![self.literal(path, attr, arg)?]))
            }
            "prefix" | "regex" => {
                if ty != AttrType::String {
                    return self.type_error(path, op, ty, "string");
                }
                let Json::String(s) = arg else {
                    self.errors.add(path, format!("{op} takes a string"));
                    return None;
                };
                if op == "prefix" {
                    return Some(Test::Prefix(s.clone()));
                }
                match self.errors.1.compile(s) {
                    Ok(pattern) => Some(Test::Regex(pattern)),
                    Err(PatternError::Invalid(message)) => {
                        self.errors.add(path, message);
                        None
                    }
                    Err(PatternError::BudgetSpent) => None,
                }
            }
            "containsAll" | "containsNone" => {
                if ty != AttrType::Set {
                    return self.type_error(path, op, ty, "set");
                }
                let items = match arg {
                    Json::Array(items) if !items.is_empty() => items,
                    _ => {
                        self.errors
                            .add(path, format!("{op} takes a non-empty list"));
                        return None;
                    }
                };
                let tags = self
                    .literals(path, attr, items)?
                    .into_iter()
                    .filter_map(|v| match v {
                        Value::Text(t) => Some(t),
                        Value::Number(_) => None,
                    })
                    .collect();
                Some(if op == "containsAll" {
                    Test::ContainsAll(tags)
                } else {
                    Test::ContainsNone(tags)
                })
            }
            "exists" => match arg {
                Json::Bool(b) => Some(Test::Exists(*b)),
                _ => {
                    self.errors.add(path, "exists takes true or false");
                    None
                }
            },
            "request" => {
                self.errors.add(
                    path,
                    "{ request: ... } is a comparison operand: write e.g. { greaterThan: { request: promptTokens } }",
                );
                None
            }
            _ => {
                self.errors.add(
                    path,
                    format!(
                        "unknown operator {op:?} (known: notIn, notEquals, greaterThan, greaterThanOrEqual, lessThan, lessThanOrEqual, prefix, regex, containsAll, containsNone, exists)"
                    ),
                );
                None
            }
        }
    }

    /// Sets are tested with containsNone; notIn on a set would be ambiguous.
    fn reject_set_negation(&mut self, path: &str, op: &str, ty: AttrType) -> Option<()> {
        if ty == AttrType::Set {
            self.errors.add(
                path,
                format!("{op} does not apply to a set attribute; use containsNone"),
            );
            return None;
        }
        Some(())
    }

    fn type_error<T>(&mut self, path: &str, op: &str, ty: AttrType, wants: &str) -> Option<T> {
        self.errors.add(
            path,
            format!("{op} applies to {wants} attributes, but this attribute is {ty}"),
        );
        None
    }

    fn operand<A: Side>(&mut self, path: &str, ty: AttrType, arg: &Json) -> Option<Operand> {
        if let Json::Object(map) = arg {
            let Some(Json::String(name)) = map.get("request").filter(|_| map.len() == 1) else {
                self.errors.add(
                    path,
                    "expected a number, a duration, or { request: <attribute> }",
                );
                return None;
            };
            if !A::allows_request_operand() {
                self.errors.add(
                    path,
                    "{ request: ... } compares a candidate with the request; here the subject already is the request",
                );
                return None;
            }
            return self.request_operand(path, ty, name);
        }
        match self.typed_number(path, ty, arg)? {
            Value::Number(n) => Some(Operand::Const(n)),
            Value::Text(_) => None,
        }
    }

    fn request_operand(&mut self, path: &str, ty: AttrType, name: &str) -> Option<Operand> {
        let Some(attr) = RequestAttr::parse(name) else {
            self.errors.add(
                format!("{path}.request"),
                format!(
                    "unknown request attribute {name:?} (known: {})",
                    REQUEST_ATTRIBUTES.join(", ")
                ),
            );
            return None;
        };
        if attr.ty() != ty {
            self.errors.add(
                format!("{path}.request"),
                format!(
                    "cannot compare a {ty} attribute with request attribute {name}, which is {}",
                    attr.ty()
                ),
            );
            return None;
        }
        Some(Operand::Request(attr))
    }

    fn literals<A: Side>(&mut self, path: &str, attr: &A, items: &[Json]) -> Option<Vec<Value>> {
        let mut out = Vec::with_capacity(items.len());
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            match self.literal(&format!("{path}[{i}]"), attr, item) {
                Some(v) => out.push(v),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn literal<A: Side>(&mut self, path: &str, attr: &A, value: &Json) -> Option<Value> {
        let ty = attr.ty();
        let v = match ty {
            AttrType::Numeric | AttrType::Duration => self.typed_number(path, ty, value)?,
            AttrType::String | AttrType::Set => Value::Text(self.text(path, ty, value)?),
        };
        if let Value::Text(t) = &v {
            if attr.is_candidate_type() && CandidateType::parse(t).is_none() {
                self.errors
                    .add(path, format!("type is Local or Provider, not {t:?}"));
                return None;
            }
            if attr.is_tag() && self.tags.emitters(t).is_empty() {
                self.errors.add(path, self.unknown_tag_message(t));
                return None;
            }
        }
        Some(v)
    }

    fn unknown_tag_message(&self, tag: &str) -> String {
        let kind = tag.rsplit_once('-').map_or(tag, |(k, _)| k);
        if self.tags.classifiers.is_empty() {
            return format!(
                "tag {tag:?} needs a classifier, but none is declared (add one to classifiers, e.g. {{ name: {kind}, type: {kind} }})"
            );
        }
        let declared: Vec<_> = self.tags.classifiers.iter().map(|(n, _)| *n).collect();
        format!(
            "no declared classifier emits tag {tag:?} (declared: {})",
            declared.join(", ")
        )
    }

    fn text(&mut self, path: &str, ty: AttrType, value: &Json) -> Option<String> {
        match value {
            Json::String(s) => Some(s.clone()),
            Json::Bool(b) => Some(b.to_string()),
            Json::Number(n) => Some(n.to_string()),
            _ => {
                self.errors.add(path, format!("expected a {ty} value"));
                None
            }
        }
    }

    fn typed_number(&mut self, path: &str, ty: AttrType, value: &Json) -> Option<Value> {
        match (ty, value) {
            (AttrType::Numeric, Json::Number(n)) => {
                Some(Value::Number(n.as_f64().unwrap_or(f64::NAN)))
            }
            (AttrType::Numeric, Json::String(s)) if parse_duration(s).is_ok() => {
                self.errors.add(
                    path,
                    format!("this attribute is numeric, but {s:?} is a duration"),
                );
                None
            }
            (AttrType::Numeric, _) => {
                self.errors.add(path, "expected a number");
                None
            }
            (AttrType::Duration, Json::String(s)) => match parse_duration(s) {
                Ok(d) => Some(Value::Number(d.as_secs_f64())),
                Err(e) => {
                    self.errors.add(path, format!("invalid duration: {e}"));
                    None
                }
            },
            (AttrType::Duration, Json::Number(n)) => {
                self.errors.add(
                    path,
                    format!("this attribute is a duration: write {n}ms or {n}s, not a bare number"),
                );
                None
            }
            (AttrType::Duration, _) => {
                self.errors.add(path, "expected a duration such as 200ms");
                None
            }
            (_, _) => {
                self.errors.add(path, format!("expected a {ty} value"));
                None
            }
        }
    }
}

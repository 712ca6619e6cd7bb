//! `route`: consider, exclude, select, tieBreak, onEmpty, reject.

use super::errors::Errors;
use super::predicate::{PredicateCompiler, TagIndex};
use crate::attr::{AttrType, CandidateAttr, CandidateType, Metric, OBJECTIVES, RequestAttr};
use crate::duration::parse_duration;
use crate::model::{
    BackendSelector, ClassifierSet, Consider, Exclude, ModelSelector, OnEmpty, Provider, Rank,
    Reject, Route, TieBreak, Tier, TierType, Within,
};
use crate::spec::{ConsiderSpec, ExcludeSpec, RouteClause, Scalar, TierSpec};

/// Which candidate types the consider phase can yield.
#[derive(Clone, Copy)]
struct Span {
    local: bool,
    provider: bool,
}

impl Span {
    fn has(self, ty: CandidateType) -> bool {
        match ty {
            CandidateType::Local => self.local,
            CandidateType::Provider => self.provider,
        }
    }
    fn describe(self) -> &'static str {
        match (self.local, self.provider) {
            (true, true) => "Local and Provider",
            (true, false) => "Local",
            (false, true) => "Provider",
            (false, false) => "no",
        }
    }
}

pub(super) fn compile_route(
    errors: &mut Errors,
    path: &str,
    route: &RouteClause,
    rule_name: &str,
    tags: &TagIndex<'_>,
    providers: &[Provider],
) -> Option<Route> {
    let before = errors.0.len();
    let consider = compile_consider(errors, path, route.consider.as_deref(), providers);
    let span = Span {
        local: consider.iter().any(|c| c.backends.local),
        provider: consider.iter().any(|c| c.backends.provider),
    };
    let exclude = compile_exclude(errors, path, route.exclude.as_deref(), tags);
    let select = match route.select.as_deref() {
        None => {
            errors.add(
                format!("{path}.select"),
                "select is required: list at least one tier, e.g. { minimize: QueueDepth }",
            );
            Vec::new()
        }
        Some([]) => {
            errors.add(format!("{path}.select"), "empty lists are not allowed");
            Vec::new()
        }
        Some(tiers) => tiers
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                compile_tier(
                    errors,
                    &format!("{path}.select[{i}]"),
                    t,
                    span,
                    tags,
                    providers,
                )
            })
            .collect(),
    };
    let tie_break = match route.tie_break.as_deref() {
        None => TieBreak::RankOrder,
        Some("PreferLocal") => TieBreak::PreferLocal,
        Some("Random") => TieBreak::Random,
        Some(other) => {
            errors.add(
                format!("{path}.tieBreak"),
                format!("unknown tieBreak {other:?} (PreferLocal or Random)"),
            );
            TieBreak::RankOrder
        }
    };
    let on_empty = match route.on_empty.as_deref() {
        None | Some("Reject") => OnEmpty::Reject,
        Some("FallThrough") => OnEmpty::FallThrough,
        Some("Wait") => super::flow::compile_max_wait(errors, path, route.max_wait.as_deref())
            .map_or(OnEmpty::Reject, OnEmpty::Wait),
        Some(other) => {
            errors.add(
                format!("{path}.onEmpty"),
                format!("unknown onEmpty {other:?} (Reject, FallThrough or Wait)"),
            );
            OnEmpty::Reject
        }
    };
    if route.max_wait.is_some() && route.on_empty.as_deref() != Some("Wait") {
        errors.add(
            format!("{path}.maxWait"),
            "maxWait applies only when onEmpty is Wait",
        );
    }
    let reject = compile_reject(errors, path, route, rule_name, on_empty);
    (errors.0.len() == before).then_some(Route {
        consider,
        exclude,
        select,
        tie_break,
        on_empty,
        reject,
    })
}

fn compile_reject(
    errors: &mut Errors,
    path: &str,
    route: &RouteClause,
    rule_name: &str,
    on_empty: OnEmpty,
) -> Reject {
    let spec = route.reject.clone().unwrap_or_default();
    if route.reject.is_some() && on_empty == OnEmpty::FallThrough {
        errors.add(
            format!("{path}.reject"),
            "reject applies only when onEmpty is Reject or Wait; this rule falls through",
        );
    }
    let status = spec.status.unwrap_or(503);
    if !(400..=599).contains(&status) {
        errors.add(
            format!("{path}.reject.status"),
            format!("{status} is not an error status (400..599)"),
        );
    }
    Reject {
        status,
        message: spec
            .message
            .unwrap_or_else(|| format!("no eligible endpoint (rule {rule_name})")),
    }
}

fn compile_consider(
    errors: &mut Errors,
    path: &str,
    consider: Option<&[ConsiderSpec]>,
    providers: &[Provider],
) -> Vec<Consider> {
    let Some(entries) = consider else {
        // The seed: unset means every local endpoint serving the requested model.
        return vec![Consider {
            models: ModelSelector::Requested,
            backends: BackendSelector {
                local: true,
                provider: false,
                names: None,
            },
        }];
    };
    if entries.is_empty() {
        errors.add(
            format!("{path}.consider"),
            "empty lists are not allowed; omit consider for every local endpoint of the requested model",
        );
    }
    entries
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            compile_consider_entry(errors, &format!("{path}.consider[{i}]"), entry, providers)
        })
        .collect()
}

fn compile_consider_entry(
    errors: &mut Errors,
    path: &str,
    entry: &ConsiderSpec,
    providers: &[Provider],
) -> Consider {
    if entry.models.is_none() && entry.backends.is_none() {
        errors.add(path, "an entry needs models, backends, or both");
    }
    let models = match entry.models.as_ref().and_then(|m| m.names.as_ref()) {
        None => ModelSelector::Requested,
        Some(names) if names.is_empty() => {
            errors.add(
                format!("{path}.models.names"),
                "empty lists are not allowed",
            );
            ModelSelector::Requested
        }
        Some(names) => ModelSelector::Names(names.clone()),
    };
    let backends = match &entry.backends {
        None => BackendSelector {
            local: true,
            provider: false,
            names: None,
        },
        Some(b) => {
            let (local, provider) = match b.kind.as_deref() {
                None => (true, true),
                Some("Local") => (true, false),
                Some("Provider") => (false, true),
                Some(other) => {
                    errors.add(
                        format!("{path}.backends.type"),
                        format!("unknown type {other:?} (Local or Provider)"),
                    );
                    (true, true)
                }
            };
            if let Some(names) = &b.names {
                if names.is_empty() {
                    errors.add(
                        format!("{path}.backends.names"),
                        "empty lists are not allowed",
                    );
                }
                if !local {
                    check_provider_names(
                        errors,
                        &format!("{path}.backends.names"),
                        names,
                        providers,
                    );
                }
            }
            BackendSelector {
                local,
                provider,
                names: b.names.clone(),
            }
        }
    };
    Consider { models, backends }
}

fn check_provider_names(errors: &mut Errors, path: &str, names: &[String], providers: &[Provider]) {
    for (i, name) in names.iter().enumerate() {
        if !providers.iter().any(|p| &p.name == name) {
            let known: Vec<_> = providers.iter().map(|p| p.name.as_str()).collect();
            errors.add(
                format!("{path}[{i}]"),
                format!(
                    "unknown provider {name:?} (declared: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
            );
        }
    }
}

fn compile_exclude(
    errors: &mut Errors,
    path: &str,
    exclude: Option<&[ExcludeSpec]>,
    tags: &TagIndex<'_>,
) -> Vec<Exclude> {
    let Some(items) = exclude else {
        return Vec::new();
    };
    if items.is_empty() {
        errors.add(format!("{path}.exclude"), "empty lists are not allowed");
    }
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let p = format!("{path}.exclude[{i}]");
        let mut pc = PredicateCompiler {
            errors,
            tags,
            needs: ClassifierSet::default(),
        };
        // Outer None: the `if` failed to compile; inner None: no `if` (always).
        let when = match &item.when {
            None => Some(None),
            Some(w) => pc.list::<RequestAttr>(&format!("{p}.if"), &w.0).map(Some),
        };
        let when_needs = pc.needs;
        let drop = match &item.drop {
            Some(d) => pc.list::<CandidateAttr>(&format!("{p}.drop"), &d.0),
            None => {
                pc.errors.add(
                    format!("{p}.drop"),
                    "drop is required: which candidates to remove",
                );
                None
            }
        };
        if let (Some(drop), Some(when)) = (drop, when) {
            out.push(Exclude {
                when,
                when_needs,
                drop,
            });
        }
    }
    out
}

fn compile_tier(
    errors: &mut Errors,
    path: &str,
    tier: &TierSpec,
    span: Span,
    tags: &TagIndex<'_>,
    providers: &[Provider],
) -> Option<Tier> {
    let before = errors.0.len();
    let kind = match tier.kind.as_deref() {
        None | Some("Any") => TierType::Any,
        Some("Local") => TierType::Local,
        Some("Provider") => TierType::Provider,
        Some(other) => {
            errors.add(
                format!("{path}.type"),
                format!("unknown tier type {other:?} (Local, Provider or Any)"),
            );
            TierType::Any
        }
    };
    let tier_span = Span {
        local: span.local && kind.admits(CandidateType::Local),
        provider: span.provider && kind.admits(CandidateType::Provider),
    };
    if !tier_span.local && !tier_span.provider {
        errors.add(
            format!("{path}.type"),
            format!(
                "this tier admits only {} candidates, but consider yields only {} candidates, so it can never be chosen",
                tier_type_name(kind),
                span.describe()
            ),
        );
    }
    let when = tier.when.as_ref().and_then(|w| {
        PredicateCompiler {
            errors: &mut *errors,
            tags,
            needs: ClassifierSet::default(),
        }
        .list::<CandidateAttr>(&format!("{path}.if"), &w.0)
    });
    let rank = compile_rank(errors, path, tier, tier_span, kind, providers);
    let within = compile_within(errors, path, tier.within.as_ref(), &rank);
    (errors.0.len() == before).then_some(Tier {
        kind,
        when,
        rank,
        within,
    })
}

fn tier_type_name(kind: TierType) -> &'static str {
    match kind {
        TierType::Local => "Local",
        TierType::Provider => "Provider",
        TierType::Any => "Local and Provider",
    }
}

fn compile_rank(
    errors: &mut Errors,
    path: &str,
    tier: &TierSpec,
    span: Span,
    kind: TierType,
    providers: &[Provider],
) -> Rank {
    let chosen: Vec<&str> = [
        tier.minimize.as_ref().map(|_| "minimize"),
        tier.maximize.as_ref().map(|_| "maximize"),
        tier.order.as_ref().map(|_| "order"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if chosen.len() > 1 {
        errors.add(
            path,
            format!(
                "a tier takes at most one of minimize, maximize and order, found {}",
                chosen.join(" and ")
            ),
        );
        return Rank::Unranked;
    }
    if let Some(names) = &tier.order {
        if names.is_empty() {
            errors.add(format!("{path}.order"), "empty lists are not allowed");
        }
        if kind == TierType::Provider {
            check_provider_names(errors, &format!("{path}.order"), names, providers);
        }
        return Rank::Order(names.clone());
    }
    let (field, name, minimize) = match (&tier.minimize, &tier.maximize) {
        (Some(n), _) => ("minimize", n, true),
        (_, Some(n)) => ("maximize", n, false),
        _ => return Rank::Unranked,
    };
    let Some(metric) = Metric::parse_objective(name) else {
        errors.add(
            format!("{path}.{field}"),
            format!(
                "unknown objective {name:?} (known: {})",
                OBJECTIVES.join(", ")
            ),
        );
        return Rank::Unranked;
    };
    for ty in [CandidateType::Local, CandidateType::Provider] {
        if span.has(ty) && !metric.defined_for(ty) {
            errors.add(
                path,
                format!(
                    "{} is only defined for {} candidates, but this tier spans {}",
                    metric.name(),
                    defined_types(metric),
                    span.describe()
                ),
            );
        }
    }
    if minimize {
        Rank::Minimize(metric)
    } else {
        Rank::Maximize(metric)
    }
}

fn defined_types(metric: Metric) -> &'static str {
    match (
        metric.defined_for(CandidateType::Local),
        metric.defined_for(CandidateType::Provider),
    ) {
        (true, false) => "Local",
        (false, true) => "Provider",
        _ => "Local and Provider",
    }
}

fn compile_within(
    errors: &mut Errors,
    path: &str,
    within: Option<&Scalar>,
    rank: &Rank,
) -> Option<Within> {
    let within = within?;
    let path = format!("{path}.within");
    let metric = match rank {
        Rank::Minimize(m) | Rank::Maximize(m) => *m,
        _ => {
            errors.add(&path, "within applies only to a minimize or maximize tier");
            return None;
        }
    };
    let parsed = match (within, metric.ty()) {
        (Scalar::Text(s), _) if s.trim().ends_with('%') => s
            .trim()
            .trim_end_matches('%')
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|p| p.is_finite() && *p >= 0.0)
            .map(|p| Within::Fraction(p / 100.0))
            .ok_or_else(|| format!("{s:?} is not a percentage such as 10%")),
        (Scalar::Text(s), AttrType::Duration) => parse_duration(s)
            .map(|d| Within::Absolute(d.as_secs_f64()))
            .map_err(|e| format!("invalid duration: {e}")),
        (Scalar::Text(s), _) => Err(format!(
            "{} is numeric: write a number or a percentage, not {s:?}",
            metric.name()
        )),
        (Scalar::Number(n), AttrType::Duration) => Err(format!(
            "{} is a duration: write {n}ms, {n}s or a percentage",
            metric.name()
        )),
        (Scalar::Number(n), _) if n.is_finite() && *n >= 0.0 => Ok(Within::Absolute(*n)),
        (Scalar::Number(n), _) => Err(format!("{n} must be a non-negative number")),
    };
    parsed.map_err(|e| errors.add(&path, e)).ok()
}

//! Source spec → [`CompiledPolicy`]. Walks the whole policy and reports every
//! error with its path; returns a compiled policy only when there are none.

mod errors;
mod flow;
mod predicate;
mod route;
mod session;

use std::collections::HashSet;
use std::time::Duration;

use sha2::{Digest, Sha256};

use errors::Errors;
pub(crate) use errors::join as errors_join;
pub use errors::{CompileError, CompileErrors};
pub use flow::{DEFAULT_MAX_WAIT, DEFAULT_MAX_WAITING, DEFAULT_MAX_WAITING_BYTES, MAX_MAX_WAIT};
use predicate::{PredicateCompiler, TagIndex};
pub use session::{DEFAULT_SESSION_TTL, MAX_SESSION_TTL};

use crate::attr::{CLASSIFIER_TYPES, builtin_classifier_tags};
use crate::duration::parse_duration;
use crate::model::{
    Classifier, ClassifierKind, ClassifierSet, CompiledPolicy, ModelInfo, Pool, Price, Provider,
    Rule,
};
use crate::spec::{ClassifierSpec, ModelSpec, PolicySpec, PoolSpec, ProviderSpec, RuleSpec};

pub const DEFAULT_TENANT_HEADER: &str = "x-kinference-tenant";
pub const DEFAULT_CLASSIFIER_TIMEOUT: Duration = Duration::from_millis(100);

/// Compiles a policy. Paths in errors are relative to the policy (`rules[0]...`);
/// use [`CompileErrors::prefixed`] to place them under `spec`.
pub fn compile(spec: &PolicySpec) -> Result<CompiledPolicy, CompileErrors> {
    let mut errors = Errors::default();
    let pool = spec
        .pool
        .as_ref()
        .map(|pool| compile_pool(&mut errors, pool));
    let providers = compile_providers(&mut errors, &spec.providers);
    let classifiers = compile_classifiers(&mut errors, &spec.classifiers);
    let tag_index = TagIndex {
        classifiers: classifiers
            .iter()
            .map(|c| (c.name.as_str(), c.tags.as_slice()))
            .collect(),
    };
    let rules = compile_rules(&mut errors, &spec.rules, &tag_index, &providers);
    let tenant_header = spec
        .tenant_header
        .as_deref()
        .map(str::to_ascii_lowercase)
        .unwrap_or_else(|| DEFAULT_TENANT_HEADER.to_string());
    if tenant_header.is_empty() {
        errors.add("tenantHeader", "must not be empty; omit it for the default");
    }
    let session_affinity = spec
        .session_affinity
        .as_ref()
        .and_then(|s| session::compile_session_affinity(&mut errors, s));
    let flow_control = flow::compile_flow_control(&mut errors, spec.flow_control.as_ref());
    if !errors.0.is_empty() {
        return Err(CompileErrors(errors.0));
    }
    Ok(CompiledPolicy {
        hash: policy_hash(spec),
        tenant_header,
        session_affinity,
        flow_control,
        pool,
        route: spec.route.clone().unwrap_or_default(),
        providers,
        classifiers,
        reads: crate::model::Reads::of(&rules),
        rules,
        source: spec.clone(),
    })
}

/// SHA-256 of the canonical JSON (fields in declaration order, maps sorted).
pub fn policy_hash(spec: &PolicySpec) -> String {
    let canonical = serde_json::to_vec(spec).expect("a policy spec always serializes");
    let digest = Sha256::digest(&canonical);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn compile_pool(errors: &mut Errors, pool: &PoolSpec) -> Pool {
    if pool.selector.is_empty() {
        errors.add(
            "pool.selector",
            "a pool needs a label selector for its model-server Pods, e.g. { app: vllm }",
        );
    }
    if pool.target_ports.is_empty() {
        errors.add(
            "pool.targetPorts",
            "a pool needs at least one target port, e.g. [{ number: 8000 }]",
        );
    }
    let mut seen = HashSet::new();
    for (i, port) in pool.target_ports.iter().enumerate() {
        if port.number == 0 {
            errors.add(format!("pool.targetPorts[{i}].number"), "must be 1..65535");
        } else if !seen.insert(port.number) {
            errors.add(
                format!("pool.targetPorts[{i}].number"),
                format!("port {} is listed twice", port.number),
            );
        }
    }
    Pool {
        selector: pool.selector.clone(),
        target_ports: pool.target_ports.iter().map(|p| p.number).collect(),
        models: compile_models(errors, "pool.models", &pool.models),
    }
}

fn compile_models(errors: &mut Errors, path: &str, models: &[ModelSpec]) -> Vec<ModelInfo> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, m) in models.iter().enumerate() {
        let p = format!("{path}[{i}]");
        if m.name.is_empty() {
            errors.add(format!("{p}.name"), "must not be empty");
        } else if !seen.insert(&m.name) {
            errors.add(
                format!("{p}.name"),
                format!("model {:?} is listed twice", m.name),
            );
        }
        let price = m.price.as_ref().map(|price| {
            for (field, v) in [
                ("input", Some(price.input)),
                ("cachedInput", price.cached_input),
                ("output", Some(price.output)),
            ] {
                if v.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                    errors.add(
                        format!("{p}.price.{field}"),
                        "must be a non-negative number",
                    );
                }
            }
            Price {
                input: price.input,
                cached_input: price.cached_input.unwrap_or(price.input),
                output: price.output,
            }
        });
        out.push(ModelInfo {
            name: m.name.clone(),
            target_model: m.target_model.clone().unwrap_or_else(|| m.name.clone()),
            price,
            context_window: m.context_window,
        });
    }
    out
}

fn compile_providers(errors: &mut Errors, providers: &[ProviderSpec]) -> Vec<Provider> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, p) in providers.iter().enumerate() {
        let path = format!("providers[{i}]");
        check_name(
            errors,
            &format!("{path}.name"),
            &p.name,
            "provider",
            &mut seen,
        );
        let base_url = provider_url(errors, &path, p);
        if let Some(kind) = p.kind.as_deref().filter(|k| *k != "openai") {
            errors.add(
                format!("{path}.kind"),
                format!("unsupported provider kind {kind:?} (supported: openai)"),
            );
        }
        if p.secret_ref.as_ref().is_some_and(|s| s.name.is_empty()) {
            errors.add(format!("{path}.secretRef.name"), "must not be empty");
        }
        if p.models.is_empty() {
            errors.add(
                format!("{path}.models"),
                "a provider needs at least one model it serves",
            );
        }
        out.push(Provider {
            name: p.name.clone(),
            base_url: base_url.trim_end_matches('/').to_string(),
            secret: p.secret_ref.clone(),
            models: compile_models(errors, &format!("{path}.models"), &p.models),
        });
    }
    out
}

/// The provider's base URL, from `baseURL` or its deprecated spelling
/// `baseUrl` (which lint warns about); exactly one must be set.
fn provider_url<'p>(errors: &mut Errors, path: &str, p: &'p ProviderSpec) -> &'p str {
    let (field, url) = match (&p.base_url, &p.deprecated_base_url) {
        (Some(_), Some(_)) => {
            errors.add(
                format!("{path}.baseUrl"),
                "baseUrl is the deprecated spelling of baseURL: set only baseURL",
            );
            return "";
        }
        (None, None) => {
            errors.add(format!("{path}.baseURL"), "required");
            return "";
        }
        (Some(url), None) => ("baseURL", url),
        (None, Some(url)) => ("baseUrl", url),
    };
    if !(url.starts_with("https://") || url.starts_with("http://")) {
        errors.add(
            format!("{path}.{field}"),
            format!("{url:?} is not an http(s) URL"),
        );
    }
    url
}

fn compile_classifiers(errors: &mut Errors, classifiers: &[ClassifierSpec]) -> Vec<Classifier> {
    if classifiers.len() > ClassifierSet::MAX {
        errors.add(
            "classifiers",
            format!("at most {} classifiers are supported", ClassifierSet::MAX),
        );
    }
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, c) in classifiers.iter().enumerate() {
        let path = format!("classifiers[{i}]");
        check_name(
            errors,
            &format!("{path}.name"),
            &c.name,
            "classifier",
            &mut seen,
        );
        let timeout = match c.timeout.as_deref().map(parse_duration) {
            None => DEFAULT_CLASSIFIER_TIMEOUT,
            Some(Ok(d)) if !d.is_zero() => d,
            Some(Ok(_)) => {
                errors.add(format!("{path}.timeout"), "must be greater than zero");
                DEFAULT_CLASSIFIER_TIMEOUT
            }
            Some(Err(e)) => {
                errors.add(format!("{path}.timeout"), format!("invalid duration: {e}"));
                DEFAULT_CLASSIFIER_TIMEOUT
            }
        };
        let (kind, tags) = match (c.kind.as_str(), builtin_classifier_tags(&c.kind)) {
            (kind, Some(tags)) => {
                if !c.tags.is_empty() || c.url.is_some() {
                    errors.add(
                        &path,
                        format!("built-in classifier {kind} takes no url or tags"),
                    );
                }
                (
                    ClassifierKind::Builtin(kind.to_string()),
                    tags.iter().map(|t| t.to_string()).collect(),
                )
            }
            ("http", None) => {
                let url = c.url.clone().unwrap_or_default();
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    errors.add(
                        format!("{path}.url"),
                        "an http classifier needs the http(s) URL the prompt is POSTed to",
                    );
                }
                if c.tags.is_empty() {
                    errors.add(
                        format!("{path}.tags"),
                        "an http classifier must list the tags it may return, so rules can be checked",
                    );
                }
                (ClassifierKind::Http { url }, c.tags.clone())
            }
            (other, None) => {
                errors.add(
                    format!("{path}.type"),
                    format!(
                        "unknown classifier type {other:?} (known: {})",
                        CLASSIFIER_TYPES.join(", ")
                    ),
                );
                (ClassifierKind::Builtin(other.to_string()), Vec::new())
            }
        };
        out.push(Classifier {
            name: c.name.clone(),
            kind,
            timeout,
            tags,
        });
    }
    out
}

fn check_name<'a>(
    errors: &mut Errors,
    path: &str,
    name: &'a str,
    what: &str,
    seen: &mut HashSet<&'a str>,
) {
    if name.is_empty() {
        errors.add(path, format!("a {what} needs a name"));
    } else if !seen.insert(name) {
        errors.add(path, format!("duplicate {what} name {name:?}"));
    }
}

fn compile_rules(
    errors: &mut Errors,
    rules: &[RuleSpec],
    tags: &TagIndex<'_>,
    providers: &[Provider],
) -> Vec<Rule> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, rule) in rules.iter().enumerate() {
        let path = format!("rules[{i}]");
        check_name(
            errors,
            &format!("{path}.name"),
            &rule.name,
            "rule",
            &mut seen,
        );
        if rule.matches.is_none() && i + 1 < rules.len() {
            errors.add(
                format!("{path}.matches"),
                format!(
                    "rule {:?} has no matches, so it matches every request and must be the last rule; rules after it would never run",
                    rule.name
                ),
            );
        }
        let mut predicates = PredicateCompiler {
            errors,
            tags,
            needs: ClassifierSet::default(),
        };
        let matches = match &rule.matches {
            None => None,
            Some(entries) if entries.is_empty() => {
                predicates.errors.add(
                    format!("{path}.matches"),
                    "empty lists are not allowed; omit matches to match every request",
                );
                None
            }
            Some(entries) => Some(
                entries
                    .iter()
                    .enumerate()
                    .filter_map(|(j, entry)| {
                        let p = format!("{path}.matches[{j}]");
                        let pairs: Option<Vec<_>> = entry
                            .iter()
                            .map(|(k, v)| match v.0.json() {
                                Ok(json) => Some((k, json)),
                                Err(message) => {
                                    predicates.errors.add(format!("{p}.{k}"), message);
                                    None
                                }
                            })
                            .collect();
                        predicates.entry(&p, pairs?.into_iter())
                    })
                    .collect(),
            ),
        };
        let match_needs = predicates.needs;
        let route = route::compile_route(
            errors,
            &format!("{path}.route"),
            &rule.route,
            &rule.name,
            tags,
            providers,
        );
        if let Some(route) = route {
            out.push(Rule {
                name: rule.name.clone(),
                matches,
                match_needs,
                route,
            });
        }
    }
    out
}

//! A ValidatingAdmissionPolicy that bounds what the CRD schema cannot.
//!
//! Predicate values are a union (a scalar, a list, or an operator map), which
//! a structural schema can only leave open (`x-kubernetes-preserve-unknown-fields`),
//! and CRD validation rules cannot look inside such values. So the API server
//! would store a predicate nested thousands of levels deep. Admission CEL sees
//! the object untyped, so it can check the shapes the language reads, three
//! levels at most, and refuse anything deeper before it is stored.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use serde_json::json;

/// The name of both the policy and its binding.
pub const ADMISSION_POLICY_NAME: &str = "inferencepolicies.kinference.io";

/// What a refused object is told; names the fields the rule covers.
pub const PREDICATE_SHAPE_MESSAGE: &str = "predicate values (rules[].matches, \
    exclude[].if, exclude[].drop, select[].if) are a scalar, a list of scalars, \
    or a one-key operator map over those";

/// The policy: refuses InferencePolicies whose predicates nest deeper than
/// the language reads.
pub fn admission_policy() -> ValidatingAdmissionPolicy {
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": { "name": ADMISSION_POLICY_NAME },
        "spec": {
            "failurePolicy": "Fail",
            // The API server's defaults, spelled out: the struct is atomic, so
            // a second field manager (GitOps beside kubectl) applying it
            // without them would conflict with the defaulted live object.
            "matchConstraints": {
                "matchPolicy": "Equivalent",
                "namespaceSelector": {},
                "objectSelector": {},
                "resourceRules": [{
                    "apiGroups": ["kinference.io"],
                    "apiVersions": ["*"],
                    "operations": ["CREATE", "UPDATE"],
                    "resources": ["inferencepolicies"],
                    "scope": "*",
                }],
            },
            "variables": [{
                "name": "rules",
                "expression": "has(object.spec.rules) && object.spec.rules != null ? object.spec.rules : []",
            }],
            "validations": [
                shape_check(&format!(
                    "variables.rules.all(r, !has(r.matches) || r.matches == null || r.matches.all(m, {}))",
                    entry_fits("m")
                )),
                shape_check(&format!(
                    "variables.rules.all(r, !has(r.route) || !has(r.route.exclude) || r.route.exclude == null || \
                     r.route.exclude.all(x, {} && {}))",
                    optional_list_fits("x", "if"),
                    optional_list_fits("x", "drop")
                )),
                shape_check(&format!(
                    "variables.rules.all(r, !has(r.route) || !has(r.route.select) || r.route.select == null || \
                     r.route.select.all(t, {}))",
                    optional_list_fits("t", "if")
                )),
            ],
        }
    }))
    .expect("a valid ValidatingAdmissionPolicy")
}

/// Applies [`admission_policy`] to every namespace; violations are refused.
pub fn admission_policy_binding() -> ValidatingAdmissionPolicyBinding {
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": { "name": ADMISSION_POLICY_NAME },
        "spec": {
            "policyName": ADMISSION_POLICY_NAME,
            "validationActions": ["Deny"],
        }
    }))
    .expect("a valid ValidatingAdmissionPolicyBinding")
}

/// Both objects as YAML, as committed under `crds/`.
pub fn admission_yaml() -> String {
    let policy = serde_json::to_value(admission_policy()).expect("serializes");
    let binding = serde_json::to_value(admission_policy_binding()).expect("serializes");
    kinference_policy::yaml::to_yaml(&policy) + &kinference_policy::yaml::to_yaml(&binding)
}

fn shape_check(expression: &str) -> serde_json::Value {
    json!({
        "expression": expression,
        "message": PREDICATE_SHAPE_MESSAGE,
        "reason": "Invalid",
    })
}

/// `parent[key]`, if set, is one predicate entry or a list of them.
fn optional_list_fits(parent: &str, key: &str) -> String {
    let value = format!("{parent}['{key}']");
    format!(
        "(!('{key}' in {parent}) || {value} == null || \
         (type({value}) == list ? {value} : [{value}]).all(e, {}))",
        entry_fits("e")
    )
}

/// One AND-entry: `attribute: value` pairs.
fn entry_fits(entry: &str) -> String {
    format!(
        "(type({entry}) == map && {entry}.all(a, {}))",
        value_fits(&format!("{entry}[a]"))
    )
}

/// A scalar, a list of scalars, or an operator map whose arguments are a
/// scalar, a list of scalars, or a one-key operand map of a scalar.
fn value_fits(value: &str) -> String {
    let argument = format!("{value}[o]");
    format!(
        "(type({value}) == list ? {value}.all(v, {}) : type({value}) != map || {value}.all(o, \
         type({argument}) == list ? {argument}.all(v, {}) : type({argument}) != map || \
         {argument}.all(k, {})))",
        scalar("v"),
        scalar("v"),
        scalar(&format!("{argument}[k]"))
    )
}

fn scalar(value: &str) -> String {
    format!("(type({value}) != list && type({value}) != map)")
}

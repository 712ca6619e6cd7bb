//! A policy attached to an InferencePool it does not own (Gateway API policy
//! attachment: `spec.targetRefs`). The operator then generates the EPP and
//! its compiled policy only; the pool, its route and its `endpointPickerRef`
//! stay the pool owner's, so the status says whether the pool sends its
//! requests to this policy's EPP, and what to set when it does not.
//!
//! Pure: the reconciler passes what the watches hold.

use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kinference_api::{INFERENCE_POOL_GROUP, InferencePolicy, InferencePolicySpec, InferencePool};
use kinference_policy::CompiledPolicy;
use kube::ResourceExt;

use crate::resources::EPP_GRPC_PORT;

const POOL_KIND: &str = "InferencePool";

/// What is wrong with how the policy names its pool, as `path: message`.
pub fn errors(spec: &InferencePolicySpec) -> Vec<String> {
    let declared = spec.policy.pool.is_some();
    let mut errors = Vec::new();
    match spec.target_refs.as_slice() {
        [] if !declared => errors.push(
            "spec.pool: required unless spec.targetRefs names the existing InferencePool \
             the policy serves"
                .to_string(),
        ),
        [] => {}
        [_, ..] if declared => errors.push(
            "spec.targetRefs: a policy either declares its pool (spec.pool, which the operator \
             creates) or attaches to an existing one (spec.targetRefs), not both"
                .to_string(),
        ),
        [target] => {
            if target.group != INFERENCE_POOL_GROUP || target.kind != POOL_KIND {
                errors.push(format!(
                    "spec.targetRefs[0]: {}/{} is not an InferencePool: set group \
                     {INFERENCE_POOL_GROUP} and kind {POOL_KIND}",
                    target.group, target.kind
                ));
            }
            if spec.policy.route.is_some() {
                errors.push(
                    "spec.route: an attached policy writes no route (the pool's own HTTPRoute \
                     brings its requests): remove it, or declare spec.pool instead of targetRefs"
                        .to_string(),
                );
            }
        }
        many => errors.push(format!(
            "spec.targetRefs: {} targets; a policy serves exactly one InferencePool",
            many.len()
        )),
    }
    errors
}

/// A warning for an attached policy with providers whose EPP would get no
/// NetworkPolicy: the operator admits the gateways a route names, and an
/// attached policy has no route, so without `extProcFrom` the ext_proc port,
/// which answers provider picks with their API keys, is open to every Pod.
pub fn open_ext_proc_warning(
    spec: &InferencePolicySpec,
    compiled: &CompiledPolicy,
) -> Option<String> {
    let settings = spec.network_policy();
    let open = spec.attached_pool().is_some()
        && !compiled.providers.is_empty()
        && settings.enabled
        && settings.ext_proc_from.is_none();
    open.then(|| {
        "spec.endpointPicker.networkPolicy.extProcFrom: unset on an attached policy with \
         providers, so its EPP gets no NetworkPolicy and the ext_proc port, whose answers carry \
         provider API keys, is open to every Pod (fix: name the gateway's Pods in extProcFrom)"
            .to_string()
    })
}

/// An attached policy's pool, as the watches see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attached {
    /// `namespace/name` of the pool.
    pub pool: String,
    pub state: PoolState,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolState {
    /// No such InferencePool: the EPP waits for it, with no endpoints.
    Missing,
    /// The pool's `endpointPickerRef` names another EPP; `fix` says what to
    /// set for this policy to take effect.
    Elsewhere { names: String, fix: String },
    /// The pool sends its requests to this policy's EPP.
    Served,
    /// Another policy holds the pool: it declares it, or attached first.
    Conflict { message: String },
}

/// The state of `policy`'s attachment, or None when it declares its pool.
/// `pool` is the InferencePool it names (if it exists), `policies` every
/// policy of its namespace, and `epp_service` the name of its EPP Service.
pub fn observe(
    policy: &InferencePolicy,
    pool: Option<&InferencePool>,
    policies: &[Arc<InferencePolicy>],
    epp_service: &str,
) -> Option<Attached> {
    let name = policy.spec.attached_pool()?;
    let ns = policy.namespace().unwrap_or_default();
    let shown = format!("{ns}/{name}");
    let state = match pool {
        None => PoolState::Missing,
        Some(pool) => match conflict(policy, pool, policies) {
            Some(message) => PoolState::Conflict { message },
            None if names_epp(pool, epp_service) => PoolState::Served,
            None => PoolState::Elsewhere {
                names: pool.spec.endpoint_picker_ref.name.clone(),
                fix: format!(
                    "set its spec.endpointPickerRef to {{name: {epp_service}, port: {{number: {EPP_GRPC_PORT}}}}}"
                ),
            },
        },
    };
    Some(Attached { pool: shown, state })
}

/// Whether the pool's `endpointPickerRef` is the EPP Service's gRPC port
/// (kind and port left to the schema's defaults count as that).
fn names_epp(pool: &InferencePool, epp_service: &str) -> bool {
    let r = &pool.spec.endpoint_picker_ref;
    r.name == epp_service
        && r.group.as_deref().unwrap_or_default().is_empty()
        && r.kind.as_deref().unwrap_or("Service") == "Service"
        && r.port.as_ref().is_none_or(|p| p.number == EPP_GRPC_PORT)
}

/// Why `policy` may not serve `pool`: the pool is another policy's own, or
/// another live policy attached to it earlier (older, or as old with a
/// smaller name, as Gateway API orders conflicting policies).
fn conflict(
    policy: &InferencePolicy,
    pool: &InferencePool,
    policies: &[Arc<InferencePolicy>],
) -> Option<String> {
    let me = policy.name_any();
    let shown = format!(
        "{}/{}",
        pool.namespace().unwrap_or_default(),
        pool.name_any()
    );
    let owner = pool
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "InferencePolicy" && o.name != me);
    if let Some(owner) = owner {
        return Some(format!(
            "InferencePool {shown} is InferencePolicy {}'s own (it declares the pool); \
             attach to another pool or change that policy",
            owner.name
        ));
    }
    let rank = |p: &InferencePolicy| {
        let created = p.metadata.creation_timestamp.as_ref().map(|t| t.0);
        (created.unwrap_or(Timestamp::MAX), p.name_any())
    };
    let mine = rank(policy);
    policies
        .iter()
        .filter(|p| p.name_any() != me && p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.namespace() == policy.namespace())
        .filter(|p| p.spec.attached_pool() == Some(pool.name_any().as_str()))
        .map(|p| rank(p))
        .filter(|other| *other < mine)
        .min()
        .map(|(_, first)| {
            format!(
                "InferencePolicy {first} attached to InferencePool {shown} first; \
                 one pool has one policy"
            )
        })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
    use kinference_api::{EndpointPickerRef, PortNumber};

    use super::*;

    fn attached(name: &str, pool: &str, created_second: i64) -> InferencePolicy {
        let spec: InferencePolicySpec = serde_json::from_value(serde_json::json!({
            "targetRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}],
            "rules": [{"name": "r", "route": {"select": [{"minimize": "QueueDepth"}]}}]
        }))
        .unwrap();
        let mut policy = InferencePolicy::new(name, spec);
        policy.metadata.namespace = Some("team-a".into());
        policy.metadata.creation_timestamp =
            Some(Time(Timestamp::from_second(created_second).unwrap()));
        policy
    }

    fn pool(epp: &str, port: Option<i32>) -> InferencePool {
        let mut pool = InferencePool::new("shared", Default::default());
        pool.metadata.namespace = Some("team-a".into());
        pool.spec.endpoint_picker_ref = EndpointPickerRef {
            name: epp.into(),
            port: port.map(|number| PortNumber { number }),
            ..Default::default()
        };
        pool
    }

    fn state(
        policy: &InferencePolicy,
        pool: Option<&InferencePool>,
        all: &[InferencePolicy],
    ) -> PoolState {
        let all: Vec<Arc<InferencePolicy>> = all.iter().cloned().map(Arc::new).collect();
        let epp = format!("{}-epp", policy.name_any());
        observe(policy, pool, &all, &epp).unwrap().state
    }

    #[test]
    fn exactly_one_of_pool_and_target_refs_and_the_target_is_an_inference_pool() {
        let spec = |value: serde_json::Value| -> InferencePolicySpec {
            let mut value = value;
            value["rules"] = serde_json::json!([{"name": "r", "route": {"select": [{"minimize": "QueueDepth"}]}}]);
            serde_json::from_value(value).unwrap()
        };
        let target = |group: &str, kind: &str| serde_json::json!([{"group": group, "kind": kind, "name": "shared"}]);
        let pool = serde_json::json!({"selector": {"app": "v"}, "targetPorts": [{"number": 8000}]});
        let route = serde_json::json!({"parentRefs": [{"name": "gw"}]});
        let pool_ref = target("inference.networking.k8s.io", "InferencePool");
        let cases = [
            spec(serde_json::json!({})),
            spec(serde_json::json!({"pool": pool, "targetRefs": pool_ref})),
            spec(
                serde_json::json!({"targetRefs": target("gateway.networking.k8s.io", "HTTPRoute")}),
            ),
            spec(serde_json::json!({"targetRefs": pool_ref, "route": route})),
            spec(serde_json::json!({"targetRefs": [pool_ref[0], pool_ref[0]]})),
        ];
        let refused: Vec<Vec<String>> = cases.iter().map(errors).collect();
        insta::assert_yaml_snapshot!(refused);
        assert!(errors(&spec(serde_json::json!({"targetRefs": pool_ref}))).is_empty());
        assert!(errors(&spec(serde_json::json!({"pool": pool}))).is_empty());
    }

    #[test]
    fn a_declared_pool_is_no_attachment() {
        let mut policy = attached("chat", "shared", 10);
        policy.spec.target_refs.clear();
        assert_eq!(observe(&policy, None, &[], "chat-epp"), None);
    }

    #[test]
    fn the_pool_is_served_only_when_its_endpoint_picker_ref_names_this_epp() {
        let chat = attached("chat", "shared", 10);
        assert_eq!(state(&chat, None, &[]), PoolState::Missing);
        assert_eq!(
            state(&chat, Some(&pool("chat-epp", Some(9002))), &[]),
            PoolState::Served
        );
        // The schema's defaults for kind and port count as ours.
        assert_eq!(
            state(&chat, Some(&pool("chat-epp", None)), &[]),
            PoolState::Served
        );
        let PoolState::Elsewhere { names, fix } =
            state(&chat, Some(&pool("vllm-epp", Some(9002))), &[])
        else {
            panic!("another EPP's pool read as served");
        };
        assert_eq!(names, "vllm-epp");
        assert_eq!(
            fix,
            "set its spec.endpointPickerRef to {name: chat-epp, port: {number: 9002}}"
        );
        // Our Service on its health port is not our EPP.
        assert!(matches!(
            state(&chat, Some(&pool("chat-epp", Some(9003))), &[]),
            PoolState::Elsewhere { .. }
        ));
    }

    #[test]
    fn the_later_of_two_policies_on_one_pool_conflicts() {
        let first = attached("zeta", "shared", 10);
        let later = attached("alpha", "shared", 20);
        let elsewhere = attached("other", "another-pool", 1);
        let all = [first.clone(), later.clone(), elsewhere];
        let pool = pool("zeta-epp", Some(9002));
        assert_eq!(state(&first, Some(&pool), &all), PoolState::Served);
        let PoolState::Conflict { message } = state(&later, Some(&pool), &all) else {
            panic!("the later policy was not refused");
        };
        assert_eq!(
            message,
            "InferencePolicy zeta attached to InferencePool team-a/shared first; one pool has one policy"
        );
        // As old: the smaller name wins.
        let twin = attached("beta", "shared", 10);
        let all = [first.clone(), twin.clone()];
        assert!(matches!(
            state(&first, Some(&pool), &all),
            PoolState::Conflict { .. }
        ));
        assert!(!matches!(
            state(&twin, Some(&pool), &all),
            PoolState::Conflict { .. }
        ));
        // One being deleted holds nothing.
        let mut going = attached("aaa", "shared", 1);
        going.metadata.deletion_timestamp = Some(Time(Timestamp::from_second(30).unwrap()));
        assert_eq!(
            state(&first, Some(&pool), &[first.clone(), going]),
            PoolState::Served
        );
    }

    #[test]
    fn a_pool_another_policy_declares_is_not_for_attaching() {
        let chat = attached("chat", "shared", 10);
        let mut owned = pool("chat-epp", Some(9002));
        let owner = |name: &str| OwnerReference {
            api_version: "kinference.io/v1alpha1".into(),
            kind: "InferencePolicy".into(),
            name: name.into(),
            uid: "u".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        owned.metadata.owner_references = Some(vec![owner("shared")]);
        let PoolState::Conflict { message } = state(&chat, Some(&owned), &[]) else {
            panic!("another policy's pool was taken");
        };
        assert!(
            message.contains("InferencePolicy shared's own"),
            "{message}"
        );
        // Its own pool (declared before, now attached to) is no conflict.
        owned.metadata.owner_references = Some(vec![owner("chat")]);
        assert_eq!(state(&chat, Some(&owned), &[]), PoolState::Served);
    }
}

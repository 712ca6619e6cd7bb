#![forbid(unsafe_code)]

pub mod cluster;
pub mod helm;
pub mod kstatus;
pub mod kubelet;
pub mod node;
pub mod scale;
pub mod tools;

/// The field managers that have written `meta`'s object: who touched it.
pub fn field_managers(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Vec<String> {
    meta.managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.clone())
        .collect()
}

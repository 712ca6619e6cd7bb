//! The Kubernetes API of Kinference: the `InferencePolicy` custom resource
//! (`kinference.io/v1alpha1`). Its spec is the policy language's own
//! [`PolicySpec`], so what `kinference lint` checks is exactly what the
//! operator compiles.
#![forbid(unsafe_code)]

mod admission;
mod crd;
mod epp_status;
mod inference_objective;
mod inference_pool;
mod labels;

pub use admission::{
    ADMISSION_POLICY_NAME, PREDICATE_SHAPE_MESSAGE, admission_policy, admission_policy_binding,
    admission_yaml,
};
pub use crd::{
    ClientCaRef, DEFAULT_KV_EVENTS_PORT, DecisionLogSpec, EndpointPickerSpec, EppLogFormat,
    EppLogLevel, EppNetworkPolicySpec, FailureMode, INFERENCE_POOL_GROUP, InferencePolicy,
    InferencePolicySpec, InferencePolicyStatus, MAX_DATA_PARALLEL_SIZE, MAX_EPP_REPLICAS,
    PolicyTargetReference, PrecisePrefixSpec, PublisherMode, TokenizerSource, crd, crd_yaml,
};
pub use epp_status::{EppPodStatus, SecretKeyStatus, epp_field_manager};
pub use inference_objective::{InferenceObjective, InferenceObjectiveSpec, ObjectivePoolRef};
pub use inference_pool::{
    EndpointPickerRef, InferencePool, InferencePoolSpec, PoolSelector, PortNumber,
};
pub use kinference_policy::PolicySpec;
pub use labels::*;

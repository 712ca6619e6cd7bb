//! What each EPP Pod reports to the operator, in its policy's status
//! ConfigMap (`<policy>-epp-status`): one data key per Pod, named after the
//! Pod, holding an [`EppPodStatus`] as JSON. Each Pod merge-patches only its
//! own key; the operator applies the ConfigMap without `data`, so its
//! server-side apply never owns or removes a Pod's key, and it deletes the
//! keys of Pods that no longer exist.

use serde::{Deserialize, Serialize};

/// One EPP Pod's report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EppPodStatus {
    /// Hash of the policy this Pod has loaded and serves.
    pub loaded_hash: String,
    /// Every provider Secret key the loaded policy reads, and whether this
    /// Pod has a non-empty value for it. Absent when the Pod does not read
    /// its keys from mounted Secrets (then it cannot tell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_keys: Option<Vec<SecretKeyStatus>>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyStatus {
    pub secret: String,
    pub key: String,
    pub found: bool,
}

/// The field manager of one EPP Pod's writes, so `managedFields` shows which
/// Pod owns which key (at most 128 characters, as the API requires).
pub fn epp_field_manager(pod: &str) -> String {
    let mut manager = format!("kinference-epp/{pod}");
    manager.truncate(128);
    manager
}

impl EppPodStatus {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a Pod status always serializes")
    }

    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_managers_fit_the_api_limit() {
        assert_eq!(
            epp_field_manager("chat-epp-7d9f8-x2x4q"),
            "kinference-epp/chat-epp-7d9f8-x2x4q"
        );
        assert_eq!(epp_field_manager(&"p".repeat(253)).len(), 128);
    }

    #[test]
    fn round_trips_in_camel_case() {
        let status = EppPodStatus {
            loaded_hash: "abc".into(),
            secret_keys: Some(vec![SecretKeyStatus {
                secret: "openai-key".into(),
                key: "apiKey".into(),
                found: false,
            }]),
        };
        let json = status.to_json();
        assert_eq!(
            json,
            r#"{"loadedHash":"abc","secretKeys":[{"secret":"openai-key","key":"apiKey","found":false}]}"#
        );
        assert_eq!(EppPodStatus::from_json(&json).unwrap(), status);
        let bare = EppPodStatus::from_json(r#"{"loadedHash":"abc"}"#).unwrap();
        assert_eq!(bare.secret_keys, None);
    }
}

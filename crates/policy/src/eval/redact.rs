//! Request values as explain traces may show them. A client controls the
//! headers, the tenant and the path; they may carry credentials or personal
//! data, so a trace shows a digest (equal values still look equal) and
//! never a credential, not even digested.

use sha2::{Digest, Sha256};

use super::input::Request;
use crate::attr::RequestAttr;

/// Header names with any of these parts are credentials.
const CREDENTIAL_PARTS: &[&str] = &["auth", "cookie", "key", "token", "secret", "password"];

/// Shown instead of a credential.
pub const REDACTED: &str = "<redacted>";

fn is_credential(header: &str) -> bool {
    let header = header.to_ascii_lowercase();
    CREDENTIAL_PARTS.iter().any(|part| header.contains(part))
}

/// `sha256:` and the first 12 hex digits of the value's digest.
pub fn digest(value: &str) -> String {
    let hash = Sha256::digest(value.as_bytes());
    let hex: String = hash.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A request value as a trace shows it.
pub fn shown_value(attr: &RequestAttr, value: &str) -> String {
    match attr {
        RequestAttr::Header(h) if is_credential(h) => REDACTED.to_string(),
        RequestAttr::Header(_) | RequestAttr::Tenant | RequestAttr::Lora => digest(value),
        RequestAttr::Path => path_only(value).to_string(),
        _ => value.to_string(),
    }
}

/// The path without its query string, which often carries keys.
pub fn path_only(path: &str) -> &str {
    path.split(['?', '#']).next().unwrap_or_default()
}

impl Request {
    /// This request with every client-supplied value as [`shown_value`]
    /// shows it.
    pub fn redacted(&self) -> Request {
        let mut out = self.clone();
        out.path = shown_value(&RequestAttr::Path, &self.path);
        out.tenant = self
            .tenant
            .as_deref()
            .map(|t| shown_value(&RequestAttr::Tenant, t));
        out.lora = self
            .lora
            .as_deref()
            .map(|l| shown_value(&RequestAttr::Lora, l));
        for (name, value) in &mut out.headers {
            *value = shown_value(&RequestAttr::Header(name.clone()), value);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_never_shown_and_other_values_are_digested() {
        let request = Request {
            model: "qwen".into(),
            tenant: Some("acme".into()),
            path: "/v1/chat/completions?api_key=sk-1&email=a@b.c".into(),
            headers: [
                ("authorization".to_string(), "Bearer sk-secret".to_string()),
                ("x-api-key".to_string(), "sk-other".to_string()),
                ("x-team".to_string(), "blue".to_string()),
            ]
            .into(),
            ..Request::default()
        };
        let shown = request.redacted();
        assert_eq!(shown.model, "qwen");
        assert_eq!(shown.path, "/v1/chat/completions");
        assert_eq!(shown.headers["authorization"], "<redacted>");
        assert_eq!(shown.headers["x-api-key"], "<redacted>");
        assert_eq!(shown.headers["x-team"], digest("blue"));
        assert_eq!(shown.tenant.as_deref(), Some(digest("acme").as_str()));
        assert_ne!(digest("blue"), digest("red"));
        assert!(digest("blue").starts_with("sha256:") && digest("blue").len() == 19);
    }
}

//! Reconcile errors. Each names the object it concerns, so a log line or an
//! Event is enough to find it.

use std::fmt;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API request failed.
    #[error("{verb} {kind} {object}: {source}")]
    Kube {
        verb: Verb,
        kind: String,
        /// `namespace/name` (or `namespace` for lists).
        object: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    TooLarge(#[from] TooLarge),
    /// An object with a generated name exists and is not the policy's.
    #[error(
        "{0} already exists and is not controlled by this policy; it is left untouched: delete or rename it, or rename the policy"
    )]
    Conflict(String),
    /// The InferencePool an attached policy names is another policy's.
    #[error("{0}")]
    PoolTaken(String),
    /// The policy object lacks what only the API server sets.
    #[error("InferencePolicy {0} has no namespace or uid; it must come from the API server")]
    Incomplete(String),
}

/// A generated object would exceed what the API server stores.
#[derive(Debug, thiserror::Error)]
#[error(
    "{kind} {object} would hold {bytes} bytes, over the API server's limit of {limit} bytes for one object; make the policy smaller"
)]
pub struct TooLarge {
    pub kind: String,
    pub object: String,
    pub bytes: usize,
    pub limit: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    Get,
    List,
    Apply,
    Patch,
    Delete,
    PatchStatus,
}

impl fmt::Display for Verb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Apply => "apply",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::PatchStatus => "patch status of",
        })
    }
}

impl Error {
    pub fn kube(
        verb: Verb,
        kind: impl Into<String>,
        object: impl Into<String>,
        source: kube::Error,
    ) -> Self {
        Error::Kube {
            verb,
            kind: kind.into(),
            object: object.into(),
            source,
        }
    }

    /// Every value [`Error::metric_label`] takes.
    pub const METRIC_LABELS: [&'static str; 9] = [
        "get",
        "list",
        "apply",
        "patch",
        "delete",
        "status",
        "too_large",
        "conflict",
        "incomplete_object",
    ];

    /// Low-cardinality label for the errors metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { verb, .. } => match verb {
                Verb::Get => "get",
                Verb::List => "list",
                Verb::Apply => "apply",
                Verb::Patch => "patch",
                Verb::Delete => "delete",
                Verb::PatchStatus => "status",
            },
            Error::TooLarge(_) => "too_large",
            Error::Conflict(_) | Error::PoolTaken(_) => "conflict",
            Error::Incomplete(_) => "incomplete_object",
        }
    }
}

/// The HTTP status of an API error, if the server answered.
pub fn api_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_object() {
        let e = Error::kube(
            Verb::Apply,
            "HTTPRoute",
            "team-a/chat",
            kube::Error::Api(Box::new(
                kube::core::Status::failure("boom", "Invalid").with_code(422),
            )),
        );
        assert!(
            e.to_string().starts_with("apply HTTPRoute team-a/chat: "),
            "{e}"
        );
        assert_eq!(e.metric_label(), "apply");
    }
}

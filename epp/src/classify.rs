//! Runs the classifiers a reached rule needs: concurrently, each within its
//! timeout. A classifier that fails or times out emits no tags.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_classifiers::{BuiltinKind, classify};
use kinference_policy::model::{Classifier, ClassifierKind, ClassifierSet};
use serde::Deserialize;

/// Prompts up to this size are classified on the calling task.
const INLINE_PROMPT_BYTES: usize = 16 * 1024;

/// What one classifier run produced.
#[derive(Debug)]
pub struct ClassifierRun {
    pub index: usize,
    pub tags: Vec<String>,
    pub elapsed: Duration,
    /// Why it emitted no tags, if it failed.
    pub error: Option<ClassifierError>,
}

/// Why a classifier run failed (`kind` in the metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassifierError {
    /// It did not answer within its timeout.
    Timeout,
    /// An HTTP classifier could not be reached (connect, TLS, reset).
    Unreachable,
    /// An HTTP classifier answered with a non-2xx status.
    Status,
    /// An HTTP classifier's answer was not `{"tags": [...]}`.
    BadAnswer,
    /// A built-in classifier could not run (unknown kind, worker panicked).
    Internal,
}

impl ClassifierError {
    pub fn as_str(self) -> &'static str {
        match self {
            ClassifierError::Timeout => "timeout",
            ClassifierError::Unreachable => "unreachable",
            ClassifierError::Status => "status",
            ClassifierError::BadAnswer => "bad_answer",
            ClassifierError::Internal => "internal",
        }
    }

    fn of_http(error: &reqwest::Error) -> Self {
        if error.is_status() {
            ClassifierError::Status
        } else if error.is_decode() {
            ClassifierError::BadAnswer
        } else if error.is_timeout() {
            ClassifierError::Timeout
        } else {
            ClassifierError::Unreachable
        }
    }
}

#[derive(Clone)]
pub struct ClassifierRunner {
    http: reqwest::Client,
}

impl Default for ClassifierRunner {
    fn default() -> Self {
        ClassifierRunner {
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("a plain HTTP client builds"),
        }
    }
}

#[derive(Deserialize)]
struct HttpAnswer {
    #[serde(default)]
    tags: Vec<String>,
}

impl ClassifierRunner {
    /// Runs `needed` over the prompt and returns each run.
    pub async fn run(
        &self,
        classifiers: &[Classifier],
        needed: ClassifierSet,
        prompt: &Arc<str>,
    ) -> Vec<ClassifierRun> {
        let runs = needed
            .iter()
            .filter(|&i| i < classifiers.len())
            .map(|i| self.run_one(i, &classifiers[i], prompt.clone()));
        futures::future::join_all(runs).await
    }

    async fn run_one(&self, index: usize, c: &Classifier, prompt: Arc<str>) -> ClassifierRun {
        let started = Instant::now();
        let work = async {
            match &c.kind {
                ClassifierKind::Builtin(kind) => {
                    let kind = BuiltinKind::parse(kind).ok_or(ClassifierError::Internal)?;
                    if prompt.len() <= INLINE_PROMPT_BYTES {
                        // Microseconds of work: a thread hop would cost more.
                        return Ok(classify(kind, &prompt));
                    }
                    // Milliseconds on large prompts: keep them off the async workers.
                    tokio::task::spawn_blocking(move || classify(kind, &prompt))
                        .await
                        .map_err(|_| ClassifierError::Internal)
                }
                ClassifierKind::Http { url } => {
                    let answer = self
                        .http
                        .post(url)
                        .json(&serde_json::json!({ "prompt": &*prompt }))
                        .send()
                        .await
                        .and_then(|r| r.error_for_status())
                        .map_err(|e| ClassifierError::of_http(&e))?;
                    let body: HttpAnswer = answer
                        .json()
                        .await
                        .map_err(|e| ClassifierError::of_http(&e))?;
                    // Only tags the classifier declared: the policy was checked against them.
                    Ok(body
                        .tags
                        .into_iter()
                        .filter(|t| c.tags.contains(t))
                        .collect())
                }
            }
        };
        let (tags, error) = match tokio::time::timeout(c.timeout, work).await {
            Ok(Ok(tags)) => (tags, None),
            Ok(Err(error)) => (Vec::new(), Some(error)),
            Err(_) => (Vec::new(), Some(ClassifierError::Timeout)),
        };
        if let Some(error) = error {
            // The classifier's name only: never the prompt.
            tracing::debug!(classifier = %c.name, kind = error.as_str(), "classifier emitted no tags");
        }
        ClassifierRun {
            index,
            tags,
            elapsed: started.elapsed(),
            error,
        }
    }
}

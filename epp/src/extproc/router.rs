//! What the ext_proc session needs from the decision side, declared here by
//! its consumer: two calls per request, and two optional. `route` decides
//! where the request goes and hands back a ticket; `complete` reports what
//! the response headers showed; `first_token`, when a streamed answer's
//! first token came; `usage`, the token counts the answer reported, when the
//! router wants them. The session keeps the ticket until the stream ends (dropping it
//! ends the request's time in flight), so it never sees how decisions are
//! made or what is learnt from them.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use super::body::{Api, ParsedBody};
pub use super::usage::Usage;

/// What the HTTP request carries, as the ext_proc stream saw it.
pub struct Incoming<'a> {
    /// Lower-cased names, pseudo-headers included (`:path`).
    pub headers: &'a BTreeMap<String, String>,
    pub path: &'a str,
    pub api: Api,
    pub body: &'a ParsedBody,
    /// The request body's size in bytes, as it arrived.
    pub body_bytes: usize,
    /// Restricts local endpoints to these `ip:port` (or bare IPs); `None`: all.
    pub subset: Option<&'a [String]>,
}

/// The decision, as the session turns it into an Envoy reply
/// ([`super::reply::answer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Local(LocalRoute),
    Provider(ProviderRoute),
    Reject {
        rule: Option<String>,
        status: u16,
        message: String,
        /// The decision detail (`--decision-detail`), compact JSON.
        detail: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRoute {
    pub rule: String,
    pub model: String,
    /// The selected endpoint first, then the fallbacks (all `ip:port`).
    pub addresses: Vec<String>,
    /// Set when the body's model must change.
    pub rewrite_model: Option<String>,
    /// The decision detail (`--decision-detail`), compact JSON.
    pub detail: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderRoute {
    pub rule: String,
    pub provider: String,
    pub model: String,
    /// The provider's name for the model, when it differs from the request's.
    pub rewrite_model: Option<String>,
    /// `Bearer` key to send; `None` when the provider needs none. A provider
    /// that needs a key the EPP does not hold is a [`Route::Reject`].
    pub api_key: Option<String>,
    /// The decision detail (`--decision-detail`), compact JSON.
    pub detail: Option<String>,
}

/// What the response path showed, reported once per routed request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseFacts {
    /// `None`: the stream ended without response headers (the gateway skips
    /// them, or the client went away), so the outcome is unknown.
    pub status: Option<u16>,
    /// The host that answered, when reported: `envoy.lb`
    /// `x-gateway-destination-endpoint-served` metadata, or else Envoy's
    /// `upstream.address` attribute.
    pub served: Option<String>,
    /// A TTFT the gateway or server measured itself, if reported.
    pub reported_ttft: Option<Duration>,
    /// [`Router::first_token`] will be called when the answer's first token
    /// reaches the EPP: a successful streamed answer (`text/event-stream`)
    /// whose body the gateway sends as it comes. The headers' own arrival
    /// says nothing of the TTFT: vLLM's and SGLang's servers send a streamed
    /// answer's headers at admission, before its prefill, and a whole
    /// answer's with its last token.
    pub first_token_follows: bool,
}

pub trait Router: Send + Sync + 'static {
    /// Held by the session from `route` to the end of the stream.
    type Ticket: Send + Sync + 'static;

    /// Decides one request. A routed request comes with a ticket.
    fn route(
        &self,
        request: &Incoming<'_>,
    ) -> impl Future<Output = (Route, Option<Self::Ticket>)> + Send;

    /// The response path of a routed request: called once, when response
    /// headers arrive or, without them, when the stream ends.
    fn complete(&self, ticket: &mut Self::Ticket, facts: ResponseFacts);

    /// A streamed answer's first token reached the EPP at `at`: called at
    /// most once, after [`Router::complete`] said it would follow.
    fn first_token(&self, _ticket: &mut Self::Ticket, _at: Instant) {}

    /// Whether [`Router::usage`] wants this request's answer read.
    fn wants_usage(&self, _ticket: &Self::Ticket) -> bool {
        false
    }

    /// The token counts a successful answer reported, once its body ended
    /// (not called when the body did not end, or reported none).
    fn usage(&self, _ticket: &mut Self::Ticket, _usage: Usage) {}
}

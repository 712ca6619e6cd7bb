//! Envoy External Processing (`envoy.service.ext_proc.v3`): one bidirectional
//! stream per HTTP request, spoken as the Gateway API Inference Extension's
//! Endpoint Picker Protocol expects.

pub mod body;
mod decoding;
pub mod limits;
pub mod reply;
pub mod router;
mod session;
pub mod usage;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::metrics::Metrics;
use decoding::{DecodeMeter, Metered};
use futures::StreamExt as _;
use limits::BodyBudget;
pub use router::Router;

/// GIE protocol names.
pub const DESTINATION_ENDPOINT: &str = "x-gateway-destination-endpoint";
pub const DESTINATION_SUBSET: &str = "x-gateway-destination-endpoint-subset";
pub const SERVED_ENDPOINT: &str = "x-gateway-destination-endpoint-served";
pub const LB_NAMESPACE: &str = "envoy.lb";
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Envoy's attributes for the ext_proc filter, keyed by the filter's name,
/// and the one read: the address of the host that answered.
pub(crate) const EXT_PROC_ATTRIBUTES: &str = "envoy.filters.http.ext_proc";
pub(crate) const UPSTREAM_ADDRESS: &str = "upstream.address";
/// Headers the EPP adds for observability.
pub const RULE_HEADER: &str = "x-kinference-rule";
/// `--decision-detail`: why the request went where it went. An `envoy.lb`
/// metadata key on a routed request, a response header on a reject.
pub(crate) const DECISION_DETAIL: &str = "x-kinference-decision-detail";
pub(crate) const MODEL_HEADER: &str = "x-kinference-model";
/// A TTFT a gateway or the model server measured, reported on the response;
/// without it the EPP times from its decision to the response headers.
pub const OBSERVED_TTFT_HEADER: &str = "x-kinference-observed-ttft-ms";
/// Conformance-suite hooks (off unless enabled).
pub(crate) const TEST_SELECTION_HEADER: &str = "test-epp-endpoint-selection";
pub(crate) const TEST_SERVED_HEADER: &str = "x-conformance-test-served-endpoint";

#[derive(Debug, Clone)]
pub struct ExtProcConfig {
    /// Larger bodies get 413.
    pub max_body_bytes: usize,
    /// Honour the upstream conformance suite's test header and echo the
    /// served endpoint. Off by default: it lets a client pick endpoints.
    pub conformance_hooks: bool,
    /// How many fallback endpoints follow the primary in the `envoy.lb`
    /// metadata list. 0 makes the metadata equal the header (one endpoint).
    pub fallbacks: usize,
    /// A stream that sends nothing for this long before its request is
    /// decided is answered 408 and closed.
    pub idle_timeout: Duration,
    /// Request-body bytes buffered across all streams; a body that would
    /// take more is answered 503 at once.
    pub body_budget_bytes: usize,
}

impl Default for ExtProcConfig {
    fn default() -> Self {
        ExtProcConfig {
            max_body_bytes: 16 * 1024 * 1024,
            conformance_hooks: false,
            fallbacks: 3,
            idle_timeout: Duration::from_secs(30),
            body_budget_bytes: 256 * 1024 * 1024,
        }
    }
}

/// The ext_proc gRPC service: one [`session`] per stream, over `router`.
pub struct ExtProcService<R> {
    router: Arc<R>,
    metrics: Arc<Metrics>,
    config: Arc<ExtProcConfig>,
    budget: Arc<BodyBudget>,
}

impl<R> Clone for ExtProcService<R> {
    fn clone(&self) -> Self {
        ExtProcService {
            router: Arc::clone(&self.router),
            metrics: Arc::clone(&self.metrics),
            config: Arc::clone(&self.config),
            budget: Arc::clone(&self.budget),
        }
    }
}

impl<R: Router> ExtProcService<R> {
    pub fn new(router: Arc<R>, metrics: Arc<Metrics>, config: ExtProcConfig) -> Self {
        let budget = BodyBudget::new(config.body_budget_bytes, metrics.buffered_body_bytes());
        ExtProcService {
            router,
            metrics,
            config: Arc::new(config),
            budget,
        }
    }

    /// The gRPC service, its messages' bytes charged to the body budget
    /// while they are decoded (see [`decoding`]).
    pub fn into_server(self) -> Metered<ExternalProcessorServer<Self>> {
        let largest = max_message_bytes(self.config.max_body_bytes);
        let budget = Arc::clone(&self.budget);
        let server = ExternalProcessorServer::new(self)
            .max_decoding_message_size(largest)
            .max_encoding_message_size(64 * 1024 * 1024);
        Metered::new(server, budget)
    }
}

/// The largest ext_proc message a stream may send: a whole body (BUFFERED
/// mode sends it in one) and its framing. Refused by its length prefix,
/// before its bytes are read.
pub(crate) fn max_message_bytes(max_body_bytes: usize) -> usize {
    max_body_bytes.saturating_add(64 * 1024)
}

#[tonic::async_trait]
impl<R: Router> ExternalProcessor for ExtProcService<R> {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let meter = request.extensions().get::<DecodeMeter>().cloned();
        let inbound = request.into_inner().inspect(move |_| {
            if let Some(meter) = &meter {
                meter.delivered();
            }
        });
        Ok(Response::new(self.open(inbound)))
    }
}

impl<R: Router> ExtProcService<R> {
    /// Starts one session over `inbound` and returns its replies: what
    /// [`ExternalProcessor::process`] does for a gRPC stream, callable
    /// without one (fuzzing, in-process drivers).
    pub fn open(
        &self,
        inbound: impl Stream<Item = Result<ProcessingRequest, Status>> + Send + Unpin + 'static,
    ) -> ReceiverStream<Result<ProcessingResponse, Status>> {
        let (tx, rx) = mpsc::channel(32);
        // Each stream is its own task: a slow or broken one never holds up others.
        let session = session::Session::new(
            self.router.clone(),
            self.metrics.clone(),
            self.config.clone(),
            self.budget.hold(),
            tx,
        );
        tokio::spawn(session.run(inbound));
        ReceiverStream::new(rx)
    }
}

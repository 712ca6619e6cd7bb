//! The bytes the gRPC decoder holds before a session sees them, charged to
//! the body budget.
//!
//! tonic assembles each ext_proc message whole before handing it over, so
//! every open stream could make the EPP hold up to one message (a whole
//! body, 16 MiB by default) that no budget saw: 40 streams sending 1 MiB
//! messages slowly held 40 MiB beyond the budget, a thousand sending 16 MiB
//! ones would hold 16 GiB. Each stream's request body is therefore metered
//! as it arrives: every DATA frame is charged to the [`BodyBudget`] before
//! the decoder may buffer it, and the charge is given back when the message
//! is delivered (the session then charges what it keeps) or the stream
//! ends. A frame the budget cannot pay for ends the stream's requests with
//! `RESOURCE_EXHAUSTED`, which the session answers with a 503, as it does
//! when a body it buffers runs out of budget.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Bytes, Service, http};
use tonic::server::NamedService;

use super::limits::{BodyBudget, BodyHold};
use kinference_runtime::sync::lock;

/// What a stream's decoder holds, on the budget. Shared by the stream's
/// body (which charges) and its session's inbound messages (which give
/// back), through the request's extensions.
#[derive(Clone, Debug)]
pub(crate) struct DecodeMeter(Arc<Mutex<BodyHold>>);

impl DecodeMeter {
    fn new(budget: &Arc<BodyBudget>) -> Self {
        DecodeMeter(Arc::new(Mutex::new(budget.hold())))
    }

    /// Charges `n` bytes received, or nothing if the budget cannot spare
    /// them.
    fn charge(&self, n: usize) -> bool {
        lock(&self.0).grow(n)
    }

    /// A message was delivered: what the decoder held for it is the
    /// session's to charge now. The start of the next message, read in the
    /// same frame, goes uncharged: at most a frame (16 KiB by default).
    pub(crate) fn delivered(&self) {
        lock(&self.0).release();
    }
}

/// The gRPC service `S`, with each stream's request body metered.
#[derive(Clone, Debug)]
pub struct Metered<S> {
    inner: S,
    budget: Arc<BodyBudget>,
}

impl<S> Metered<S> {
    pub fn new(inner: S, budget: Arc<BodyBudget>) -> Self {
        Metered { inner, budget }
    }
}

impl<S: NamedService> NamedService for Metered<S> {
    const NAME: &'static str = S::NAME;
}

impl<S: Service<http::Request<Body>>> Service<http::Request<Body>> for Metered<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let meter = DecodeMeter::new(&self.budget);
        request.extensions_mut().insert(meter.clone());
        let request = request.map(|inner| Body::new(MeteredBody { inner, meter }));
        self.inner.call(request)
    }
}

/// A request body whose DATA frames are charged to its stream's meter.
struct MeteredBody {
    inner: Body,
    meter: DecodeMeter,
}

/// Why a stream's requests ended before a message was whole.
pub(crate) const DECODE_REFUSED: &str = "the body budget cannot hold this stream's next message";

impl HttpBody for MeteredBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(frame)) = &frame
            && let Some(data) = frame.data_ref()
            && !self.meter.charge(data.len())
        {
            return Poll::Ready(Some(Err(Status::resource_exhausted(DECODE_REFUSED))));
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use prometheus_client::metrics::gauge::Gauge;

    fn frames(sizes: &[usize]) -> Body {
        let chunks: Vec<Result<Frame<Bytes>, Status>> = sizes
            .iter()
            .map(|&n| Ok(Frame::data(Bytes::from(vec![0u8; n]))))
            .collect();
        Body::new(http_body_util::StreamBody::new(futures::stream::iter(
            chunks,
        )))
    }

    /// A body of frames of `sizes` bytes, metered on a budget of `limit`,
    /// the budget's gauge and the meter.
    fn metered(sizes: &[usize], limit: usize) -> (MeteredBody, Gauge, DecodeMeter) {
        let used = Gauge::default();
        let meter = DecodeMeter::new(&BodyBudget::new(limit, used.clone()));
        let body = MeteredBody {
            inner: frames(sizes),
            meter: meter.clone(),
        };
        (body, used, meter)
    }

    #[tokio::test]
    async fn frames_are_charged_until_delivered_and_refused_past_the_budget() {
        let (mut body, used, meter) = metered(&[40, 50, 20], 100);
        for expected in [40, 50] {
            let frame = body.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap().len(), expected);
        }
        assert_eq!(used.get(), 90, "held by the decoder");
        let refused = body.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(used.get(), 90, "the refused frame is not charged");
        meter.delivered();
        assert_eq!(used.get(), 0, "the session's to charge now");
    }

    #[tokio::test]
    async fn a_streams_charge_is_given_back_when_it_ends() {
        let (mut body, used, meter) = metered(&[30], 1000);
        body.frame().await.unwrap().unwrap();
        assert_eq!(used.get(), 30);
        drop((body, meter));
        assert_eq!(used.get(), 0);
    }
}

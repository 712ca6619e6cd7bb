//! Local endpoints: who they are (Kubernetes Pod discovery, or a standalone
//! list) and how loaded they are (Prometheus scraping), kept in one shared
//! [`EndpointRegistry`] that the request path snapshots per request.

pub mod discovery;
pub mod prom;
pub mod registry;
pub mod scrape;
pub mod standalone;

pub use discovery::run_pod_discovery;
pub use registry::EndpointView;
pub(crate) use registry::default_staleness;
pub use registry::{Endpoint, EndpointRegistry, ScrapedMetrics};
pub(crate) use scrape::{DEFAULT_SCRAPE_INTERVAL, DEFAULT_SCRAPE_TIMEOUT};
pub use scrape::{ScrapeStats, spawn_scraper, spawn_scraper_with_stats};
pub use standalone::{EndpointSpec, endpoints_from_specs, load_endpoints_file};

//! Log setup: one flag, `--log-format json|text` (env
//! `KINFERENCE_LOG_FORMAT`, default `json`), and the usual `RUST_LOG` filter
//! (default `info`).

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line, event fields at the top level.
    #[default]
    Json,
    /// Human-readable text.
    Text,
}

/// The logging flags, for `#[command(flatten)]` into a binary's arguments.
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogArgs {
    /// Log format. The filter comes from RUST_LOG (default: info).
    #[arg(
        long,
        value_enum,
        env = "KINFERENCE_LOG_FORMAT",
        default_value_t = LogFormat::Json
    )]
    pub log_format: LogFormat,
}

/// The filter used when `RUST_LOG` is unset (or invalid).
pub const DEFAULT_FILTER: &str = "info";

/// Installs the global subscriber: `format`, filtered by `RUST_LOG`. An
/// invalid `RUST_LOG` falls back to [`DEFAULT_FILTER`] and says so; a
/// subscriber already installed (a test harness) is left in place.
pub fn init(format: LogFormat) {
    let (filter, bad_filter) = filter_from(std::env::var(EnvFilter::DEFAULT_ENV).ok());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init(),
    };
    if let Err(error) = installed {
        tracing::debug!(%error, "a log subscriber is already installed");
    }
    if let Some((value, error)) = bad_filter {
        tracing::warn!(
            rust_log = %value,
            %error,
            "RUST_LOG is invalid; logging at {DEFAULT_FILTER}"
        );
    }
}

/// The filter for a `RUST_LOG` value, and the value with its error if it
/// had to be replaced by the default.
fn filter_from(value: Option<String>) -> (EnvFilter, Option<(String, String)>) {
    match value.filter(|v| !v.trim().is_empty()) {
        None => (EnvFilter::new(DEFAULT_FILTER), None),
        Some(value) => match EnvFilter::try_new(&value) {
            Ok(filter) => (filter, None),
            Err(error) => (
                EnvFilter::new(DEFAULT_FILTER),
                Some((value, error.to_string())),
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        logs: LogArgs,
    }

    fn parse(args: &[&str]) -> Result<LogFormat, clap::Error> {
        Cli::try_parse_from(std::iter::once("bin").chain(args.iter().copied()))
            .map(|c| c.logs.log_format)
    }

    #[test]
    fn log_format_defaults_to_json_and_takes_text() {
        // Assumes KINFERENCE_LOG_FORMAT is unset, as in CI.
        assert_eq!(parse(&[]).unwrap(), LogFormat::Json);
        assert_eq!(parse(&["--log-format", "text"]).unwrap(), LogFormat::Text);
        assert_eq!(parse(&["--log-format=json"]).unwrap(), LogFormat::Json);
        assert!(parse(&["--log-format", "yaml"]).is_err());
        assert!(parse(&["--log-format"]).is_err());
    }

    #[test]
    fn filter_falls_back_on_missing_or_invalid_rust_log() {
        let (f, bad) = filter_from(None);
        assert_eq!(f.to_string(), "info");
        assert!(bad.is_none());
        let (f, bad) = filter_from(Some("  ".into()));
        assert_eq!(f.to_string(), "info");
        assert!(bad.is_none());
        let (f, bad) = filter_from(Some("kinference_epp=debug,warn".into()));
        assert!(bad.is_none());
        assert!(f.to_string().contains("kinference_epp=debug"), "{f}");
        let (f, bad) = filter_from(Some("foo=notalevel".into()));
        assert_eq!(f.to_string(), "info");
        assert_eq!(bad.unwrap().0, "foo=notalevel");
    }
}

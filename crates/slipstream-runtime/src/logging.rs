//! The node's log: `tracing` events, written to stderr as human-readable
//! lines (`slipstream: listening on http://127.0.0.1:8000`, warnings
//! marked) or, with `--log-format json`, one JSON object per line with the
//! event's fields (a replica event's pipeline, stage, replica and kind).
//! `SLIPSTREAM_LOG` filters them (`warn`, `slipstream::events=off`,
//! `info,slipstream_cluster=debug`: a level, and levels per module path;
//! default `info`). Directives are parsed by `tracing-subscriber`'s
//! `Targets`, not its `EnvFilter`: no span or field filters, but no regex
//! engine compiled into the node for them either (a third of a minute of
//! every build from nothing on two cores).

use crate::app::LogFormat;
use std::fmt;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// Lines as people read them: `slipstream: <message>`.
struct Text;

impl<S, N> FormatEvent<S, N> for Text
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, _: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mark = match *event.metadata().level() {
            Level::ERROR => "error: ",
            Level::WARN => "warning: ",
            _ => "",
        };
        let mut message = Message(String::new());
        event.record(&mut message);
        writeln!(w, "slipstream: {mark}{}", message.0)
    }
}

/// The event's message field.
struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_string();
        }
    }
}

/// Install the process's log (once; later calls keep the first).
pub(crate) fn init(format: LogFormat) {
    let (filter, bad) = filter(std::env::var("SLIPSTREAM_LOG").ok().as_deref());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    let _ = match format {
        LogFormat::Off => return,
        LogFormat::Text => registry.with(fmt.event_format(Text)).try_init(),
        LogFormat::Json => registry.with(fmt.json().flatten_event(true)).try_init(),
    };
    if let Some(bad) = bad {
        tracing::warn!("{bad}");
    }
}

/// The filter `SLIPSTREAM_LOG` names (`info` when unset or empty), and why
/// it was not used when it does not parse (then `info`).
fn filter(var: Option<&str>) -> (Targets, Option<String>) {
    let info = || Targets::new().with_default(tracing::Level::INFO);
    match var.map(str::trim).filter(|v| !v.is_empty()) {
        None => (info(), None),
        Some(v) => match v.parse::<Targets>() {
            Ok(t) => (t, None),
            Err(e) => (info(), Some(format!("SLIPSTREAM_LOG={v:?} is not a log filter ({e}); logging at info"))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::filter;
    use tracing::Level;

    #[test]
    fn log_filters_parse_levels_and_module_paths_and_name_a_bad_one() {
        let (t, bad) = filter(None);
        assert!(bad.is_none() && t.would_enable("slipstream", &Level::INFO) && !t.would_enable("x", &Level::DEBUG));
        let (t, _) = filter(Some("warn"));
        assert!(!t.would_enable("slipstream", &Level::INFO) && t.would_enable("slipstream", &Level::WARN));
        let (t, _) = filter(Some("info,slipstream::events=off,slipstream_cluster=debug"));
        assert!(!t.would_enable("slipstream::events", &Level::ERROR));
        assert!(t.would_enable("slipstream_cluster::agent", &Level::DEBUG));
        assert!(t.would_enable("slipstream_core", &Level::INFO) && !t.would_enable("slipstream_core", &Level::DEBUG));
        let (t, bad) = filter(Some("info,=nonsense=="));
        assert!(bad.unwrap().contains("not a log filter") && t.would_enable("a", &Level::INFO));
    }
}

//! The node's log: `tracing` events, written to stderr as human-readable
//! lines (`slipstream: listening on http://127.0.0.1:8000`, warnings
//! marked) or, with `--log-format json`, one JSON object per line with the
//! event's fields (a replica event's pipeline, stage, replica and kind).
//! `SLIPSTREAM_LOG` filters them (`warn`, `slipstream::events=off`, ...;
//! default `info`).

use crate::app::LogFormat;
use std::fmt;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

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
    let filter = || EnvFilter::try_from_env("SLIPSTREAM_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter());
    let _ = match format {
        LogFormat::Off => return,
        LogFormat::Text => builder.event_format(Text).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

//! Prometheus text exposition (format 0.0.4), written family by family.
//!
//! `/metrics` is assembled by the node and every feature that reports
//! there; each adds samples to one [`PromText`], which keeps them grouped
//! under their family's single `# HELP` and `# TYPE` however the callers
//! interleave them (see [`PromText`]).

use crate::metrics::{le_label, Hist};
use std::collections::HashMap;
use std::fmt::Write;

/// Prometheus text exposition (format 0.0.4). Samples are collected per
/// metric family and written family by family, each after its one `# HELP`
/// and `# TYPE`, as the format requires: callers loop over pipelines and
/// stages and would otherwise interleave families. Families are written in
/// the order they were first named.
#[derive(Default)]
pub struct PromText {
    families: Vec<Family>,
    index: HashMap<String, usize>,
}

struct Family {
    name: String,
    kind: &'static str,
    help: String,
    samples: String,
}

impl PromText {
    /// Declare a family (its HELP and TYPE are written even if it gets no
    /// samples, so the set of exported names does not depend on traffic);
    /// returns its sample buffer.
    pub fn declare(&mut self, name: &str, kind: &'static str, help: &str) -> &mut String {
        let i = *self.index.entry(name.to_string()).or_insert_with(|| {
            self.families.push(Family { name: name.to_string(), kind, help: help.to_string(), samples: String::new() });
            self.families.len() - 1
        });
        let f = &mut self.families[i];
        debug_assert_eq!(f.kind, kind, "metric family {name} declared with two types");
        &mut f.samples
    }

    /// A counter sample.
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: u64) {
        let out = self.declare(name, "counter", help);
        let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels));
    }

    /// A gauge sample.
    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        let out = self.declare(name, "gauge", help);
        let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels));
    }

    /// A histogram from `h`'s cumulative buckets, bounds and sum divided by
    /// `scale` (1e6 for µs -> s, 1.0 for plain counts).
    pub fn histogram(&mut self, name: &str, help: &str, labels: &[(&str, &str)], h: &Hist, scale: f64) {
        let b = h.buckets();
        let out = self.declare(name, "histogram", help);
        let les = b.bounds.iter().map(|&x| le_label(x, scale)).chain(std::iter::once("+Inf".to_string()));
        for (le, n) in les.zip(&b.cumulative) {
            let mut l = labels.to_vec();
            l.push(("le", &le));
            let _ = writeln!(out, "{name}_bucket{} {n}", fmt_labels(&l));
        }
        let count = b.cumulative.last().copied().unwrap_or(0);
        let _ = writeln!(out, "{name}_sum{} {}", fmt_labels(labels), b.sum as f64 / scale);
        let _ = writeln!(out, "{name}_count{} {count}", fmt_labels(labels));
    }

    /// The text, family by family.
    pub fn finish(self) -> String {
        let mut out = String::new();
        for f in self.families {
            let help = f.help.replace('\\', "\\\\").replace('\n', "\\n");
            let _ = writeln!(out, "# HELP {} {help}\n# TYPE {} {}", f.name, f.name, f.kind);
            out.push_str(&f.samples);
        }
        out
    }
}

fn fmt_labels(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")))
        .collect();
    format!("{{{}}}", parts.join(","))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::metrics::LATENCY_BOUNDS_US;
    use std::collections::{BTreeMap, HashSet};

    #[test]
    fn prometheus_text_declares_once() {
        let mut p = PromText::default();
        p.counter("x_total", "things", &[("stage", "a")], 3);
        p.counter("x_total", "things", &[("stage", "b\"q")], 4);
        let t = p.finish();
        assert_eq!(t.matches("# TYPE x_total counter").count(), 1);
        assert!(t.contains("x_total{stage=\"a\"} 3"));
        assert!(t.contains("x_total{stage=\"b\\\"q\"} 4"));
    }

    /// Check `text` the way a strict exposition-format parser does, and
    /// return the histogram series found (family -> label sets). Panics on:
    /// a sample before its family's TYPE, a family declared twice or whose
    /// samples are not contiguous, a sample name that does not belong to
    /// its family, a malformed line, histogram buckets out of order or not
    /// cumulative, no `+Inf` bucket, `+Inf` != `_count`, a missing `_sum`.
    pub(crate) fn check_exposition(text: &str) -> BTreeMap<String, Vec<String>> {
        let mut declared: HashSet<String> = HashSet::new();
        // (family, type) of the family being read.
        let mut current: Option<(String, String)> = None;
        // (family, labels without le) -> (buckets [(le, n)], sum, count).
        type Series = (Vec<(f64, f64)>, Option<f64>, Option<f64>);
        let mut hist: BTreeMap<(String, String), Series> = BTreeMap::new();
        let mut pending_help: Option<String> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap().to_string();
                assert!(pending_help.is_none(), "HELP without TYPE before {line}");
                pending_help = Some(name);
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut it = rest.split(' ');
                let (name, kind) = (it.next().unwrap().to_string(), it.next().unwrap().to_string());
                assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind.as_str()), "{line}");
                assert_eq!(pending_help.take().as_deref(), Some(name.as_str()), "HELP and TYPE name differ: {line}");
                assert!(declared.insert(name.clone()), "family {name} declared twice");
                current = Some((name, kind));
                continue;
            }
            assert!(!line.starts_with('#') && !line.is_empty(), "unexpected line {line:?}");
            let (series, value) = line.rsplit_once(' ').expect("sample has a value");
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
            };
            let (name, labels) = match series.find('{') {
                Some(i) => {
                    assert!(series.ends_with('}'), "{line}");
                    (&series[..i], &series[i + 1..series.len() - 1])
                }
                None => (series, ""),
            };
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'), "{line}");
            let pairs = parse_labels(labels).unwrap_or_else(|| panic!("bad labels in {line}"));
            let (family, kind) = current.clone().unwrap_or_else(|| panic!("sample before any TYPE: {line}"));
            if kind == "histogram" {
                let suffix = name.strip_prefix(family.as_str()).unwrap_or_else(|| panic!("{name} not in {family}"));
                let rest: Vec<String> =
                    pairs.iter().filter(|(k, _)| k != "le").map(|(k, v)| format!("{k}={v}")).collect();
                let e = hist.entry((family.clone(), rest.join(","))).or_default();
                match suffix {
                    "_bucket" => {
                        let le = pairs.iter().find(|(k, _)| k == "le").expect("bucket has le").1.clone();
                        let le = if le == "+Inf" { f64::INFINITY } else { le.parse().expect("numeric le") };
                        assert!(e.1.is_none() && e.2.is_none(), "bucket after _sum/_count: {line}");
                        e.0.push((le, value));
                    }
                    "_sum" => e.1 = Some(value),
                    "_count" => e.2 = Some(value),
                    _ => panic!("{name} is not a histogram sample of {family}"),
                }
            } else {
                assert_eq!(name, family, "sample {name} inside family {family}");
            }
        }
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for ((family, labels), (buckets, sum, count)) in hist {
            assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0), "{family}{{{labels}}}: le not increasing");
            assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{family}{{{labels}}}: buckets not cumulative");
            let last = buckets.last().unwrap_or_else(|| panic!("{family}{{{labels}}}: no buckets"));
            assert!(last.0.is_infinite(), "{family}{{{labels}}}: no +Inf bucket");
            assert_eq!(Some(last.1), count, "{family}{{{labels}}}: +Inf != _count");
            assert!(sum.is_some(), "{family}{{{labels}}}: no _sum");
            out.entry(family).or_default().push(labels);
        }
        out
    }

    /// `k="v",k2="v2"` with escapes, or None when malformed.
    fn parse_labels(s: &str) -> Option<Vec<(String, String)>> {
        let mut out = Vec::new();
        let mut chars = s.chars().peekable();
        while chars.peek().is_some() {
            let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
            if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return None;
            }
            if chars.next()? != '"' {
                return None;
            }
            let mut v = String::new();
            loop {
                match chars.next()? {
                    '\\' => match chars.next()? {
                        'n' => v.push('\n'),
                        c @ ('\\' | '"') => v.push(c),
                        _ => return None,
                    },
                    '"' => break,
                    c => v.push(c),
                }
            }
            out.push((key, v));
            match chars.next() {
                None => break,
                Some(',') => continue,
                Some(_) => return None,
            }
        }
        Some(out)
    }

    #[test]
    fn families_are_grouped_and_histograms_well_formed() {
        let hists: Vec<Hist> = (0..2).map(|_| Hist::new(LATENCY_BOUNDS_US, [37_000])).collect();
        for (i, h) in hists.iter().enumerate() {
            for v in [0, 90, 37_000, 37_001, 2_000_000, 20_000_000] {
                h.record(v * (i as u64 + 1));
            }
        }
        let mut p = PromText::default();
        p.declare("never_seen_total", "counter", "Declared without samples.");
        // Interleaved as report.rs loops: per pipeline, a counter then a histogram then a gauge.
        for (i, h) in hists.iter().enumerate() {
            let name = format!("p{i}");
            let l = [("pipeline", name.as_str())];
            p.counter("ok_total", "ok", &l, i as u64);
            p.histogram("latency_seconds", "lat", &l, h, 1e6);
            p.gauge("ready", "ready", &l, 1.0);
        }
        let text = p.finish();
        let hist = check_exposition(&text);
        assert_eq!(hist["latency_seconds"].len(), 2);
        assert!(text.contains("latency_seconds_bucket{pipeline=\"p0\",le=\"0.037\"} 3\n"), "{text}");
        assert!(text.contains("latency_seconds_bucket{pipeline=\"p0\",le=\"+Inf\"} 6\n"), "{text}");
        assert!(text.contains("latency_seconds_count{pipeline=\"p1\"} 6\n"), "{text}");
        assert!(text.contains("latency_seconds_sum{pipeline=\"p0\"} 22.074091\n"), "{text}");
        assert!(text.starts_with(
            "# HELP never_seen_total Declared without samples.\n# TYPE never_seen_total counter\n# HELP ok_total"
        ));
    }

    #[test]
    #[should_panic(expected = "declared twice")]
    fn the_checker_rejects_interleaved_families() {
        check_exposition(
            "# HELP a a\n# TYPE a counter\na 1\n# HELP b b\n# TYPE b gauge\nb 1\n# HELP a a\n# TYPE a counter\na 2\n",
        );
    }

    #[test]
    #[should_panic(expected = "not cumulative")]
    fn the_checker_rejects_decreasing_buckets() {
        check_exposition(
            "# HELP h h\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"2\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n",
        );
    }
}

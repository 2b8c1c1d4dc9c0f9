//! Bounded fuzzing of the request decoders: the pipeline API's JSON, and
//! KServe v2 as JSON and with binary tensors.
//!
//! Mutation-based and seeded from the corpus kept in the repo
//! (`crates/slipstream-core/fuzz/corpus/`): each round takes a seed,
//! applies a few byte-level and JSON-aware mutations (bit flips, inserted,
//! deleted or duplicated ranges, numbers swapped for edge values such as
//! 2^62 or u64::MAX, names swapped, splices of two seeds), splits the body
//! into random chunks as a socket would, and decodes it against several
//! declared input sets. Stable Rust, no sanitizer runtime: it runs in
//! `cargo test` (3 s by default) and `make test` runs it for half a minute
//! (`SLIPSTREAM_FUZZ_SECS=30`; `make test FUZZ_SECS=600` for longer). Debug
//! builds keep overflow checks on, so unchecked arithmetic on a
//! client-stated size panics here.
//!
//! The oracle, for every input:
//! - no panic;
//! - an error is a client error (4xx), or 503 when the arena is full;
//! - a success is a request a worker can run: only declared names, each
//!   once; dtypes as declared; shapes the spec accepts; at least one row and
//!   the same rows for every input; a fixed-size tensor's bytes equal its
//!   shape's size (checked arithmetic); a variable-size tensor holds exactly
//!   as many well-formed elements as its shape;
//! - nothing stays allocated in the arena once the decoded tensors are dropped.
//!
//! `SLIPSTREAM_FUZZ_SAVE=1` adds inputs with a new outcome to the corpus.

use bytes::Bytes;
use slipstream_core::arena::{Arena, Tensors};
use slipstream_core::codec::{decode_v1, decode_v2, BodyParts};
use slipstream_types::{checked_nbytes, checked_numel, DType, TensorSpec};
use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// xorshift64*: deterministic for a seed, no crate needed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "4",
    "255",
    "256",
    "65536",
    "2147483648",
    "4294967295",
    "4294967296",
    "4611686018427387904",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "1e309",
    "-0",
    "0.5",
    "1e-400",
    "null",
    "true",
    "\"1\"",
    "[]",
    "{}",
];

const WORDS: &[&str] = &[
    "x",
    "text",
    "blob",
    "ids",
    "emb",
    "flag",
    "",
    "inputs",
    "outputs",
    "name",
    "shape",
    "datatype",
    "data",
    "parameters",
    "binary_data_size",
    "binary_data",
    "binary_data_output",
    "FP32",
    "FP16",
    "FP64",
    "BYTES",
    "INT64",
    "INT8",
    "UINT8",
    "BOOL",
    "COMPLEX",
    "aGk=",
    "!!",
    "\u{fffd}",
];

/// The declared inputs a body is decoded against.
fn declarations() -> Vec<BTreeMap<String, TensorSpec>> {
    let spec = |d: DType, s: &[i64]| TensorSpec { dtype: d, shape: s.to_vec() };
    vec![
        BTreeMap::from([("x".into(), spec(DType::Float32, &[-1, 2]))]),
        BTreeMap::from([("x".into(), spec(DType::Float32, &[-1, 4]))]),
        BTreeMap::from([("text".into(), spec(DType::String, &[-1])), ("blob".into(), spec(DType::Bytes, &[-1]))]),
        BTreeMap::from([("blob".into(), spec(DType::Bytes, &[-1]))]),
        BTreeMap::from([
            ("ids".into(), spec(DType::Int64, &[-1])),
            ("emb".into(), spec(DType::Float16, &[-1, 4])),
            ("flag".into(), spec(DType::Bool, &[-1, -1])),
        ]),
        BTreeMap::from([("x".into(), spec(DType::Uint8, &[-1, 2, 2]))]),
    ]
}

/// A corpus entry: a body, and for binary v2 the JSON header's length.
#[derive(Clone)]
struct Input {
    body: Vec<u8>,
    header_len: Option<usize>,
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").join("corpus")
}

/// Binary seeds are stored as `<header length>\n<body>`.
fn load_corpus() -> Vec<Input> {
    let mut out = Vec::new();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("the fuzz corpus is in the repo")
        .map(|e| e.expect("corpus entry").path())
        .collect();
    paths.sort();
    for p in paths {
        let raw = std::fs::read(&p).expect("read corpus entry");
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("bin-") {
            let nl = raw.iter().position(|&b| b == b'\n').expect("binary seed starts with its header length");
            let n: usize = std::str::from_utf8(&raw[..nl]).unwrap().trim().parse().unwrap();
            out.push(Input { body: raw[nl + 1..].to_vec(), header_len: Some(n) });
        } else {
            out.push(Input { body: raw, header_len: None });
        }
    }
    assert!(out.len() >= 10, "the corpus has {} entries", out.len());
    out
}

/// Byte ranges `[start, end)` of a body.
type Spans = Vec<(usize, usize)>;

/// Spans of JSON number-ish tokens and of string contents.
fn tokens(body: &[u8]) -> (Spans, Spans) {
    let (mut nums, mut strs) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => {
                let start = i + 1;
                i += 1;
                while i < body.len() && body[i] != b'"' {
                    i += if body[i] == b'\\' { 2 } else { 1 };
                }
                strs.push((start, i.min(body.len())));
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < body.len() && matches!(body[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
                    i += 1;
                }
                nums.push((start, i));
            }
            _ => i += 1,
        }
    }
    (nums, strs)
}

fn mutate(rng: &mut Rng, input: &Input, corpus: &[Input]) -> Input {
    let mut b = input.body.clone();
    let mut header_len = input.header_len;
    for _ in 0..1 + rng.below(4) {
        let (nums, strs) = tokens(&b);
        match rng.below(10) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = *rng.pick(b"{}[]\",:0-9 \\\x00\xff");
            }
            2 => {
                let at = rng.below(b.len() + 1);
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                b.splice(at..at, bytes);
            }
            3 if !b.is_empty() => {
                let at = rng.below(b.len());
                let end = (at + 1 + rng.below(16)).min(b.len());
                b.drain(at..end);
            }
            4 if !b.is_empty() => {
                // Duplicate a range (a repeated key, input or tensor).
                let at = rng.below(b.len());
                let end = (at + 1 + rng.below(64)).min(b.len());
                let piece = b[at..end].to_vec();
                let to = rng.below(b.len() + 1);
                b.splice(to..to, piece);
            }
            5 | 6 if !nums.is_empty() => {
                let (s, e) = *rng.pick(&nums);
                b.splice(s..e, rng.pick(NUMBERS).bytes());
            }
            7 if !strs.is_empty() => {
                let (s, e) = *rng.pick(&strs);
                b.splice(s..e, rng.pick(WORDS).bytes());
            }
            8 => {
                let other = &rng.pick(corpus).body;
                let (cut, from) = (rng.below(b.len() + 1), rng.below(other.len() + 1));
                b.truncate(cut);
                b.extend_from_slice(&other[from..]);
            }
            _ => {
                // The binary header length: shifted, or a wild value.
                header_len = match rng.below(4) {
                    0 => None,
                    1 => Some(rng.below(b.len() + 2)),
                    2 => header_len.map(|h| h.saturating_add(rng.below(5)).saturating_sub(2)),
                    _ => Some(*rng.pick(&[0, usize::MAX, b.len(), b.len() + 1])),
                };
            }
        }
    }
    Input { body: b, header_len }
}

/// Split into chunks as a socket might deliver them.
fn chunks(rng: &mut Rng, body: &[u8]) -> BodyParts {
    let mut parts = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let n = if rng.below(3) == 0 { 1 + rng.below(body.len() - at) } else { body.len() - at };
        parts.push(Bytes::copy_from_slice(&body[at..at + n]));
        at += n;
    }
    BodyParts::new(parts)
}

/// Why a decoded request could not be handed to a worker, if it could not.
fn impossible(t: &Tensors, declared: &BTreeMap<String, TensorSpec>) -> Option<String> {
    let names: BTreeSet<&str> = t.iter().map(|(n, _)| n.as_str()).collect();
    if names.len() != t.len() || names.len() != declared.len() || !names.iter().all(|n| declared.contains_key(*n)) {
        return Some(format!("names {names:?} are not the declared ones"));
    }
    let mut rows = None;
    for (name, x) in t {
        let spec = &declared[name];
        if x.dtype != spec.dtype || !spec.accepts_shape(&x.shape) {
            return Some(format!("{name}: {} {:?} against {:?}", x.dtype, x.shape, spec));
        }
        let r = *x.shape.first()?;
        if r == 0 || rows.is_some_and(|r0| r0 != r) {
            return Some(format!("{name}: rows {r} (others {rows:?})"));
        }
        rows = Some(r);
        if x.bytes().len() as u64 != x.nbytes {
            return Some(format!("{name}: view of {} bytes for {}", x.bytes().len(), x.nbytes));
        }
        if x.dtype.is_variable() {
            let n = slipstream_types::var::scan(x.bytes(), |_| true);
            if n != checked_numel(&x.shape) {
                return Some(format!("{name}: {n:?} elements for shape {:?}", x.shape));
            }
        } else if checked_nbytes(x.dtype, &x.shape) != Some(x.nbytes) {
            return Some(format!("{name}: {} bytes for {} {:?}", x.nbytes, x.dtype, x.shape));
        }
    }
    None
}

/// An outcome, coarsely: what makes an input "new" for the corpus (the
/// error's kind and the start of its message without quoted parts or
/// numbers, or the names and dtypes decoded).
fn signature(r: &Result<Tensors, slipstream_core::NodeError>) -> String {
    match r {
        Ok(t) => format!("ok {}", t.iter().map(|(n, x)| format!("{n}:{}", x.dtype)).collect::<Vec<_>>().join(",")),
        Err(e) => {
            let mut quoted = false;
            let text: String = e
                .to_string()
                .chars()
                .filter(|&c| {
                    quoted ^= c == '\'' || c == '`';
                    !quoted && c.is_ascii_alphabetic() || c == ' '
                })
                .collect();
            format!("{} {}", e.kind(), text.split_whitespace().take(5).collect::<Vec<_>>().join(" "))
        }
    }
}

/// New corpus entries one run may save, and their largest size.
const SAVE_AT_MOST: usize = 40;
const SAVE_BYTES: usize = 2048;

#[test]
fn decoders_survive_mutated_requests() {
    let secs: f64 = std::env::var("SLIPSTREAM_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let save = std::env::var("SLIPSTREAM_FUZZ_SAVE").is_ok_and(|v| v == "1");
    let seed: u64 = std::env::var("SLIPSTREAM_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
    let dir = std::env::temp_dir().join(format!("ss-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let arena = Arena::new(dir.clone(), 8 << 20).unwrap();
    let corpus = load_corpus();
    let decls = declarations();
    let mut rng = Rng(seed | 1);
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let (mut runs, mut decodes, mut ok, mut by_status) = (0u64, 0u64, 0u64, BTreeMap::<u16, u64>::new());
    let mut failures: Vec<String> = Vec::new();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut saved = 0;
    // Panics are the finding; keep their backtraces out of the output.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    while Instant::now() < end && failures.len() < 10 {
        let input = if runs < corpus.len() as u64 {
            corpus[runs as usize].clone()
        } else {
            let i = rng.below(corpus.len());
            mutate(&mut rng, &corpus[i], &corpus)
        };
        runs += 1;
        for declared in &decls {
            for v2 in [false, true] {
                let body = chunks(&mut rng, &input.body);
                let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    if v2 {
                        decode_v2(&body, input.header_len, declared, &arena).map(|(t, _)| t)
                    } else {
                        decode_v1(&body, declared, &arena)
                    }
                }));
                decodes += 1;
                let verdict = match &decoded {
                    Err(p) => {
                        let msg =
                            p.downcast_ref::<String>().cloned().or(p.downcast_ref::<&str>().map(|s| s.to_string()));
                        Some(format!("panicked: {}", msg.unwrap_or_default()))
                    }
                    Ok(Ok(t)) => {
                        ok += 1;
                        *by_status.entry(200).or_default() += 1;
                        impossible(t, declared).map(|why| format!("decoded an impossible request: {why}"))
                    }
                    Ok(Err(e)) => {
                        let s = e.http_status();
                        *by_status.entry(s).or_default() += 1;
                        (s >= 500 && e.kind() != "arena_full").then(|| format!("answered {s} {}: {e}", e.kind()))
                    }
                };
                if let Ok(r) = &decoded {
                    let novel = seen.insert(format!("{v2}{}", signature(r)));
                    if save
                        && novel
                        && runs > corpus.len() as u64
                        && saved < SAVE_AT_MOST
                        && input.body.len() <= SAVE_BYTES
                    {
                        let name = match input.header_len {
                            Some(_) => format!("bin-found-{seed:x}-{runs}"),
                            None => format!("found-{seed:x}-{runs}.json"),
                        };
                        let mut raw = input.header_len.map_or(Vec::new(), |h| format!("{h}\n").into_bytes());
                        raw.extend_from_slice(&input.body);
                        std::fs::write(corpus_dir().join(name), raw).unwrap();
                        saved += 1;
                    }
                }
                drop(decoded);
                if arena.ingress().used_pages() != 0 {
                    failures.push(format!("{} pages stay allocated after decoding", arena.ingress().used_pages()));
                }
                if let Some(why) = verdict {
                    let path = dir.join(format!("failure-{}", failures.len()));
                    std::fs::write(&path, &input.body).unwrap();
                    failures.push(format!(
                        "{why}\n  v2={v2} header_len={:?} declared={:?}\n  input saved to {}\n  body: {}",
                        input.header_len,
                        declared.keys().collect::<Vec<_>>(),
                        path.display(),
                        String::from_utf8_lossy(&input.body[..input.body.len().min(300)])
                    ));
                }
            }
        }
    }
    std::panic::set_hook(hook);
    println!(
        "fuzz: {runs} inputs ({decodes} decodes) in {secs} s, seed {seed:#x}: {ok} decoded, outcomes by status {by_status:?}, {} failures{}",
        failures.len(),
        if save { format!(", {saved} new corpus entries") } else { String::new() }
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

use super::*;
use std::time::Duration;

fn open(dir: &Path) -> Store {
    let mut o = StoreOptions::new(dir);
    o.inline_max = 1024;
    o.pools = vec![
        Pool::new("/docs/", 3, None, Some(r"^/docs/([^/]+)/")).unwrap(),
        Pool::new("/tmp/", 100, Some(0.2), None).unwrap(),
    ];
    o.gc_every = Duration::from_secs(3600);
    o.pin_for = Duration::from_millis(200);
    Store::open(o).unwrap()
}

fn bytes(s: &Store, key: &str, sel: Select) -> Vec<u8> {
    s.get(key, sel).unwrap().1.as_ref().to_vec()
}

#[test]
fn versions_and_reads() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    let a = s.put("/m/x", b"one", "text/plain", None).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let big = vec![7u8; 5000];
    let b = s.put("/m/x", &big, "application/octet-stream", None).unwrap();
    assert_eq!((a.meta.version, b.meta.version), (1, 2));
    assert!(b.meta.timestamp > a.meta.timestamp);
    assert!(a.meta.path.is_none() && b.meta.path.is_some(), "small inline, large in a blob");
    assert_eq!(bytes(&s, "/m/x", Select::Latest), big);
    assert_eq!(bytes(&s, "/m/x", Select::Version(1)), b"one");
    let between = ((a.meta.timestamp + b.meta.timestamp) / 2.0 * 1e6) as u64;
    assert_eq!(bytes(&s, "/m/x", Select::AsOf(between)), b"one");
    assert!(matches!(s.get("/m/x", Select::AsOf(1)), Err(StoreError::NotFound(_))));
    assert!(matches!(s.get("/m/x", Select::Version(3)), Err(StoreError::NotFound(_))));
    assert_eq!(s.versions("/m/x").unwrap().len(), 2);
    // A tombstone is a version; older ones stay readable.
    let del = s.delete("/m/x", None).unwrap();
    assert!(del.meta.deleted && del.meta.version == 3);
    assert!(matches!(s.get("/m/x", Select::Latest), Err(StoreError::NotFound(_))));
    assert_eq!(bytes(&s, "/m/x", Select::Version(2)), big);
    assert!(matches!(s.delete("/m/x", None), Err(StoreError::NotFound(_))));
    let again = s.put("/m/x", b"back", "text/plain", None).unwrap();
    assert_eq!(again.meta.version, 4);
}

#[test]
fn prefix_listing_skips_deleted_and_other_prefixes() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    for k in ["/docs/a/1", "/docs/a/2", "/docs/b/1", "/docsx", "/models/m"] {
        s.put(k, k.as_bytes(), "text/plain", None).unwrap();
    }
    s.delete("/docs/a/2", None).unwrap();
    let (keys, more) = s.keys("/docs/", 10).unwrap();
    let names: Vec<&str> = keys.iter().map(|m| m.key.as_str()).collect();
    assert_eq!(names, ["/docs/a/1", "/docs/b/1"]);
    assert!(!more);
    let (keys, more) = s.keys("/", 2).unwrap();
    assert_eq!(keys.len(), 2);
    assert!(more);
    let pools = &s.options().pools;
    assert_eq!(affinity_of(pools, "/docs/a/1"), Some(("/docs/".into(), "a".into())));
    assert_eq!(affinity_of(pools, "/models/m"), None);
}

#[test]
fn conditional_puts_under_concurrent_writers() {
    let d = tempfile::tempdir().unwrap();
    let s = Arc::new(open(d.path()));
    s.put("/c", b"0", "text/plain", Some(0)).unwrap();
    assert!(matches!(s.put("/c", b"x", "text/plain", Some(0)), Err(StoreError::Conflict { current: 1, .. })));
    // 8 writers each try 30 increments with compare-and-swap; every
    // success must be a distinct version, and the final value the count.
    let wins = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let (s, wins) = (s.clone(), wins.clone());
            std::thread::spawn(move || {
                for _ in 0..30 {
                    loop {
                        let (m, body) = s.get("/c", Select::Latest).unwrap();
                        let n: u64 = std::str::from_utf8(body.as_ref()).unwrap().parse().unwrap();
                        match s.put("/c", (n + 1).to_string().as_bytes(), "text/plain", Some(m.version)) {
                            Ok(_) => {
                                wins.fetch_add(1, Relaxed);
                                break;
                            }
                            Err(StoreError::Conflict { .. }) => continue,
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(wins.load(Relaxed), 240);
    assert_eq!(bytes(&s, "/c", Select::Latest), b"240");
    assert_eq!(s.meta("/c", Select::Latest, false).unwrap().version, 241);
}

#[test]
fn retention_by_count_and_age_and_pins() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    let big = vec![1u8; 4096];
    for i in 0..5u8 {
        let mut v = big.clone();
        v[0] = i;
        s.put("/docs/a/x", &v, "application/octet-stream", None).unwrap();
    }
    let kept: Vec<u64> = s.versions("/docs/a/x").unwrap().iter().map(|m| m.version).collect();
    assert_eq!(kept, [3, 4, 5], "the /docs/ pool keeps 3");
    assert_eq!(std::fs::read_dir(d.path().join("blobs")).unwrap().count(), 3, "removed versions' files are gone");
    assert!(matches!(s.get("/docs/a/x", Select::Version(1)), Err(StoreError::NotFound(_))));
    // A reader that asked for a file's path pins it against collection.
    let m = s.meta("/docs/a/x", Select::Version(3), true).unwrap();
    let path = m.path.unwrap();
    s.put("/docs/a/x", &big, "application/octet-stream", None).unwrap();
    assert!(path.exists(), "pinned file kept");
    assert_eq!(s.blobs_held(), 1);
    std::thread::sleep(Duration::from_millis(250));
    s.collect().unwrap();
    assert!(!path.exists(), "unlinked once the pin lapsed");
    // A mapped value outlives its collection.
    let (_, body) = s.get("/docs/a/x", Select::Version(4)).unwrap();
    for _ in 0..3 {
        s.put("/docs/a/x", &big, "application/octet-stream", None).unwrap();
    }
    assert_eq!(body.as_ref()[0], 3, "version 4 holds i = 3");
    // Age: /tmp/ keeps 0.2 s, but always the latest live version.
    s.put("/tmp/t", b"1", "text/plain", None).unwrap();
    s.put("/tmp/t", b"2", "text/plain", None).unwrap();
    s.put("/tmp/gone", b"1", "text/plain", None).unwrap();
    s.delete("/tmp/gone", None).unwrap();
    std::thread::sleep(Duration::from_millis(250));
    assert_eq!(s.collect().unwrap(), 3);
    assert_eq!(s.versions("/tmp/t").unwrap().len(), 1);
    assert!(s.versions("/tmp/gone").is_err());
    // Numbers are never reused after every version is gone.
    assert_eq!(s.put("/tmp/gone", b"x", "text/plain", None).unwrap().meta.version, 3);
}

#[test]
fn reopen_keeps_everything_and_sweeps_orphans() {
    let d = tempfile::tempdir().unwrap();
    {
        let s = open(d.path());
        s.put("/a", &vec![3u8; 3000], "application/octet-stream", None).unwrap();
        s.put("/b", b"small", "text/plain", None).unwrap();
        // A staged blob never committed (as if the process died first).
        let staged = s.stage(&[vec![9u8; 5000]]).unwrap();
        std::mem::forget(staged);
    }
    assert_eq!(std::fs::read_dir(d.path().join("blobs")).unwrap().count(), 2);
    let s = open(d.path());
    assert_eq!(std::fs::read_dir(d.path().join("blobs")).unwrap().count(), 1, "orphan swept");
    assert_eq!(bytes(&s, "/a", Select::Latest), vec![3u8; 3000]);
    assert_eq!(bytes(&s, "/b", Select::Latest), b"small");
    assert_eq!(s.seq(), 2);
    let c = s.put("/c", &vec![1u8; 2000], "application/octet-stream", None).unwrap();
    assert_eq!(c.seq, 3);
    assert!(Store::open(StoreOptions::new(d.path())).is_err_and(|e| matches!(e, StoreError::InUse(_))));
}

#[test]
fn change_feed() {
    let d = tempfile::tempdir().unwrap();
    let mut o = StoreOptions::new(d.path());
    o.feed_keep = 5;
    let s = Store::open(o).unwrap();
    let mut rx = s.subscribe();
    s.put("/w/a", b"1", "text/plain", None).unwrap();
    s.put("/x/a", b"1", "text/plain", None).unwrap();
    s.delete("/w/a", None).unwrap();
    assert!(rx.has_changed().unwrap());
    rx.mark_unchanged();
    let (ch, seq) = s.changes("/w/", 0, 100).unwrap();
    assert_eq!(seq, 3);
    assert_eq!(ch.iter().map(|c| (c.seq, c.deleted)).collect::<Vec<_>>(), [(1, false), (3, true)]);
    let (ch, seq) = s.changes("/w/", 3, 100).unwrap();
    assert!(ch.is_empty() && seq == 3);
    for i in 0..10 {
        s.put("/w/b", format!("{i}").as_bytes(), "text/plain", None).unwrap();
    }
    assert!(matches!(s.changes("/", 0, 100), Err(StoreError::Gone { .. })));
    let (ch, _) = s.changes("/", 8, 2).unwrap();
    assert_eq!(ch.len(), 2);
}

#[test]
fn bad_input_changes_nothing() {
    let d = tempfile::tempdir().unwrap();
    let mut o = StoreOptions::new(d.path());
    o.max_value = 100;
    let s = Store::open(o).unwrap();
    assert!(matches!(s.put("bad", b"x", "text/plain", None), Err(StoreError::BadRequest(_))));
    assert!(matches!(s.put("/x", &[0u8; 101], "text/plain", None), Err(StoreError::TooLarge { .. })));
    assert!(matches!(s.put("/x", b"SSTNjunk", TENSORS_CONTENT_TYPE, None), Err(StoreError::BadRequest(_))));
    assert_eq!(s.seq(), 0);
    assert!(s.keys("/", 10).unwrap().0.is_empty());
}

#[test]
fn reads_racing_retention_are_whole_or_not_found() {
    let d = tempfile::tempdir().unwrap();
    let mut o = StoreOptions::new(d.path());
    o.inline_max = 1024;
    o.pools = vec![Pool::new("/one/", 1, None, None).unwrap()];
    let s = Arc::new(Store::open(o).unwrap());
    s.put("/one/small", &[1u8; 100], "x", None).unwrap();
    s.put("/one/big", &[1u8; 4096], "x", None).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = ["/one/small", "/one/big"]
        .into_iter()
        .map(|key| {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Relaxed) {
                    let (m, body) = s.get(key, Select::Latest).unwrap();
                    assert_eq!(body.as_ref().len() as u64, m.size, "{key} v{}: a partial value", m.version);
                    assert!(body.as_ref().iter().all(|&b| b == body.as_ref()[0]), "{key}: a torn value");
                    let m = s.meta(key, Select::Latest, true).unwrap();
                    assert!(m.path.is_none_or(|p| p.exists()), "{key}: a path to a collected file");
                    n += 1;
                }
                n
            })
        })
        .collect();
    for i in 0..300u32 {
        let b = (i % 250) as u8;
        s.put("/one/small", &[b; 100], "x", None).unwrap();
        s.put("/one/big", &[b; 4096], "x", None).unwrap();
    }
    stop.store(true, Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
}

#[test]
fn blob_ids_are_not_reused_after_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let mut o = StoreOptions::new(d.path());
    o.inline_max = 10;
    o.pools = vec![Pool::new("/one/", 1, None, None).unwrap()];
    let first = {
        let s = Store::open(o.clone()).unwrap();
        let a = s.put("/one/a", &[1u8; 100], "x", None).unwrap().meta.path.unwrap();
        s.put("/one/a", &[2u8; 100], "x", None).unwrap(); // collects a's first file, the newest id is now 2
        s.put("/one/b", &[3u8; 100], "x", None).unwrap();
        s.delete("/one/b", None).unwrap();
        s.put("/one/b", &[4u8; 10], "x", None).unwrap(); // inline: b's file (the newest id) is gone
        a
    };
    let s = Store::open(o).unwrap();
    let next = s.put("/one/c", &[5u8; 100], "x", None).unwrap().meta.path.unwrap();
    assert!(next > first);
    let name = |p: &Path| u64::from_str_radix(p.file_name().unwrap().to_str().unwrap(), 16).unwrap();
    assert_eq!(name(&next), 4, "ids 1-3 were handed out before the restart");
}

fn rep(version: u64, ts_us: u64, size: u64, digest: &str) -> Replicated {
    Replicated {
        version,
        ts_us,
        size,
        digest: digest.into(),
        holders: vec!["a".into(), "b".into()],
        deleted: false,
        rev: 0,
    }
}

fn apply(s: &Store, key: &str, r: Replicated, value: Option<&[u8]>) -> Committed {
    let value = value.map(|v| s.stage(&[v]).unwrap());
    s.write(Write { key: key.into(), value, content_type: "text/plain".into(), if_version: None, replicated: Some(r) })
        .unwrap()
}

#[test]
fn replicated_versions_keep_the_clusters_numbers_and_fill_in_when_fetched() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    // Held first (small and large), then named by the commit: the value is here.
    s.hold("/m/x", 4, "d4", s.stage(&[b"four"]).unwrap()).unwrap();
    let big = vec![9u8; 5000];
    s.hold("/m/y", 1, "dy", s.stage(&[&big]).unwrap()).unwrap();
    assert_eq!(s.value_of("/m/x", 4, "d4").unwrap().unwrap().as_ref(), b"four", "a held value serves peers");
    assert!(s.value_of("/m/x", 4, "other").unwrap().is_none());
    let c = apply(&s, "/m/x", rep(4, 1_000_000, 4, "d4"), None);
    assert_eq!((c.meta.version, c.meta.timestamp, c.meta.local), (4, 1.0, true));
    assert_eq!(bytes(&s, "/m/x", Select::Latest), b"four");
    apply(&s, "/m/y", rep(1, 5, 5000, "dy"), None);
    assert_eq!(bytes(&s, "/m/y", Select::Latest), big);
    // Named without bytes here: the record says where they are until filled.
    apply(&s, "/m/x", rep(6, 2_000_000, 3, "d6"), None);
    match s.get("/m/x", Select::Latest) {
        Err(StoreError::Elsewhere { version: 6, digest, holders, .. }) => {
            assert_eq!((digest.as_str(), holders.len()), ("d6", 2))
        }
        other => panic!("expected Elsewhere, got {:?}", other.map(|(m, _)| m)),
    }
    assert!(!s.meta("/m/x", Select::Latest, false).unwrap().local);
    // A replay changes nothing; bytes with the wrong digest fill nothing.
    apply(&s, "/m/x", rep(4, 1_000_000, 4, "d4"), Some(b"FOUR"));
    assert_eq!(bytes(&s, "/m/x", Select::Version(4)), b"four");
    apply(&s, "/m/x", rep(6, 2_000_000, 3, "zz"), Some(b"bad"));
    assert!(matches!(s.get("/m/x", Select::Latest), Err(StoreError::Elsewhere { .. })));
    apply(&s, "/m/x", rep(6, 2_000_000, 3, "d6"), Some(b"six"));
    assert_eq!(bytes(&s, "/m/x", Select::Latest), b"six");
    // The feed saw each version once, in order.
    let (changes, _) = s.changes("/m/", 0, 100).unwrap();
    let seen: Vec<(String, u64)> = changes.iter().map(|c| (c.key.clone(), c.version)).collect();
    assert_eq!(seen, vec![("/m/x".into(), 4), ("/m/y".into(), 1), ("/m/x".into(), 6)]);
    // Bytes held for a put that lost its commit go when a later version lands.
    s.hold("/m/x", 7, "loser", s.stage(&[&big]).unwrap()).unwrap();
    s.hold("/m/x", 8, "late", s.stage(&[b"8"]).unwrap()).unwrap();
    apply(&s, "/m/x", rep(8, 3_000_000, 1, "late"), None);
    assert!(s.value_of("/m/x", 7, "loser").unwrap().is_none());
    assert_eq!(bytes(&s, "/m/x", Select::Latest), b"8");
    // A hold that arrives after its version was applied without bytes fills it.
    apply(&s, "/m/z", rep(2, 4_000_000, 3, "dz"), None);
    s.hold("/m/z", 2, "dz", s.stage(&[b"zed"]).unwrap()).unwrap();
    assert_eq!(bytes(&s, "/m/z", Select::Latest), b"zed");
}

#[test]
fn held_bytes_survive_a_reopen() {
    let d = tempfile::tempdir().unwrap();
    let big = vec![3u8; 5000];
    {
        let s = open(d.path());
        s.hold("/m/x", 1, "d1", s.stage(&[&big]).unwrap()).unwrap();
    }
    let s = open(d.path());
    assert_eq!(s.value_of("/m/x", 1, "d1").unwrap().unwrap().as_ref(), big.as_slice());
    apply(&s, "/m/x", rep(1, 5, 5000, "d1"), None);
    assert_eq!(bytes(&s, "/m/x", Select::Latest), big);
}

#[test]
fn held_bytes_are_listed_and_dropped_with_their_file() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    let big = vec![4u8; 5000];
    s.hold("/m/x", 1, "d1", s.stage(&[&big]).unwrap()).unwrap();
    s.hold("/m/y", 2, "d2", s.stage(&[b"small"]).unwrap()).unwrap();
    let held = s.held().unwrap();
    let names: Vec<(&str, u64, &str)> = held.iter().map(|h| (h.key.as_str(), h.version, h.digest.as_str())).collect();
    assert_eq!(names, vec![("/m/x", 1, "d1"), ("/m/y", 2, "d2")]);
    assert!(held.iter().all(|h| h.age < Duration::from_secs(60)));
    let files = || std::fs::read_dir(d.path().join("blobs")).unwrap().count();
    let blobs = files();
    assert!(blobs >= 1);
    assert!(s.drop_held("/m/x", 1, "d1").unwrap());
    assert!(!s.drop_held("/m/x", 1, "d1").unwrap(), "already gone");
    assert!(s.drop_held("/m/y", 2, "d2").unwrap());
    assert_eq!(s.held().unwrap(), vec![]);
    assert_eq!(s.value_of("/m/x", 1, "d1").unwrap().map(|b| b.as_ref().to_vec()), None);
    assert_eq!(files(), blobs - 1, "the held blob's file is unlinked");
    // A version committed later finds nothing held: it is applied absent (fetched from a holder).
    apply(&s, "/m/x", rep(1, 5, 5000, "d1"), None);
    assert!(matches!(s.get("/m/x", Select::Latest), Err(StoreError::Elsewhere { .. })));
}

//! The client against real etcd processes (see `common`): keys, leases,
//! compare-and-swap, watches across restarts and compaction, fail-over in a
//! three-member cluster.

mod common;

use common::{EtcdCluster, EtcdServer};
use slipstream_etcd::{Etcd, EtcdError, Kv, WatchEvent};
use std::time::Duration;
use tokio::sync::mpsc::Receiver;
use tokio::time::{sleep, timeout, Instant};

/// The next watch event, failing the test after 10 s.
async fn next_event(rx: &mut Receiver<WatchEvent>) -> WatchEvent {
    match timeout(Duration::from_secs(10), rx.recv()).await {
        Ok(Some(ev)) => ev,
        Ok(None) => panic!("the watch ended"),
        Err(_) => panic!("no watch event in 10 s"),
    }
}

/// Fails if an event arrives within `d`.
async fn assert_quiet(rx: &mut Receiver<WatchEvent>, d: Duration) {
    if let Ok(ev) = timeout(d, rx.recv()).await {
        panic!("unexpected watch event {ev:?}");
    }
}

fn put_of(ev: WatchEvent) -> Kv {
    match ev {
        WatchEvent::Put(kv) => kv,
        other => panic!("expected a put, got {other:?}"),
    }
}

/// Polls `get(key)` until it is absent; how long that took.
async fn wait_gone(etcd: &Etcd, key: &str, within: Duration) -> Duration {
    let start = Instant::now();
    while etcd.get(key).await.unwrap().is_some() {
        assert!(start.elapsed() < within, "{key} still there after {within:?}");
        sleep(Duration::from_millis(100)).await;
    }
    start.elapsed()
}

#[tokio::test]
async fn put_get_prefix_delete() {
    let server = EtcdServer::start();
    let etcd = Etcd::new(&server.url()).unwrap();

    assert_eq!(etcd.get("app/missing").await.unwrap(), None);
    let r1 = etcd.put("app/a", b"one", None).await.unwrap();
    let r2 = etcd.put("app/b", &[0, 255, 10, 13], None).await.unwrap();
    let r3 = etcd.put("app/a", b"", None).await.unwrap();
    etcd.put("app0", b"sibling", None).await.unwrap();
    etcd.put("ap", b"shorter", None).await.unwrap();
    assert!(r1 < r2 && r2 < r3, "{r1} {r2} {r3}");

    let a = etcd.get("app/a").await.unwrap().unwrap();
    assert_eq!(
        a,
        Kv { key: "app/a".into(), value: vec![], create_revision: r1, mod_revision: r3, version: 2, lease: 0 }
    );
    assert_eq!(etcd.get("app/b").await.unwrap().unwrap().value, vec![0, 255, 10, 13]);

    let (kvs, rev) = etcd.get_prefix("app/").await.unwrap();
    let keys: Vec<&str> = kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["app/a", "app/b"]);
    assert!(rev >= r3 + 2, "{rev}");
    let (all, _) = etcd.get_prefix("").await.unwrap();
    assert_eq!(all.len(), 4);
    let (none, _) = etcd.get_prefix("zzz/").await.unwrap();
    assert!(none.is_empty());

    etcd.delete("app/a").await.unwrap();
    etcd.delete("app/a").await.unwrap(); // already gone: fine
    assert_eq!(etcd.get("app/a").await.unwrap(), None);
    let (kvs, _) = etcd.get_prefix("app/").await.unwrap();
    assert_eq!(kvs.len(), 1);

    // The gateway's own errors come back as Server errors.
    let e = etcd.put("", b"x", None).await.unwrap_err();
    assert!(matches!(e, EtcdError::Server { status: 400, .. }), "{e}");
}

#[tokio::test]
async fn leases_expire_unless_kept_alive() {
    let server = EtcdServer::start();
    let etcd = Etcd::new(&server.url()).unwrap();

    let short = etcd.grant(1).await.unwrap();
    let kept = etcd.grant(1).await.unwrap();
    assert_ne!(short, kept);
    etcd.put("lease/short", b"1", Some(short)).await.unwrap();
    etcd.put("lease/kept", b"2", Some(kept)).await.unwrap();
    assert_eq!(etcd.get("lease/kept").await.unwrap().unwrap().lease, kept);

    // Keep one alive for 3 s (three times its TTL) while the other expires.
    let keeper = {
        let etcd = etcd.clone();
        tokio::spawn(async move {
            let until = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until {
                let ttl = etcd.keep_alive(kept).await.unwrap();
                assert!(ttl >= 1, "{ttl}");
                sleep(Duration::from_millis(250)).await;
            }
        })
    };
    wait_gone(&etcd, "lease/short", Duration::from_secs(4)).await;
    keeper.await.unwrap();
    assert!(etcd.get("lease/kept").await.unwrap().is_some(), "a kept-alive lease expired");

    // The expired lease: no keep-alive, no put.
    match etcd.keep_alive(short).await {
        Err(EtcdError::LeaseExpired(l)) => assert_eq!(l, short),
        other => panic!("{other:?}"),
    }
    assert!(matches!(etcd.put("lease/again", b"x", Some(short)).await, Err(EtcdError::LeaseExpired(_))));
    assert!(matches!(etcd.put_if("lease/again", b"x", 0, Some(short)).await, Err(EtcdError::LeaseExpired(_))));

    // Without keep-alives the other one goes too.
    wait_gone(&etcd, "lease/kept", Duration::from_secs(4)).await;

    // Revoking deletes the keys at once; revoking twice is fine.
    let l = etcd.grant(30).await.unwrap();
    assert!(etcd.keep_alive(l).await.unwrap() > 20);
    etcd.put("lease/revoked", b"3", Some(l)).await.unwrap();
    etcd.revoke(l).await.unwrap();
    assert_eq!(etcd.get("lease/revoked").await.unwrap(), None);
    etcd.revoke(l).await.unwrap();
    assert!(matches!(etcd.keep_alive(l).await, Err(EtcdError::LeaseExpired(_))));
}

#[tokio::test]
async fn compare_and_swap() {
    let server = EtcdServer::start();
    let etcd = Etcd::new(&server.url()).unwrap();

    // 0: only if absent.
    let r1 = etcd.put_if("cas/k", b"v1", 0, None).await.unwrap().unwrap();
    let current = etcd.put_if("cas/k", b"v2", 0, None).await.unwrap().unwrap_err().unwrap();
    assert_eq!((current.value.as_slice(), current.mod_revision), (&b"v1"[..], r1));
    // The right revision wins, a stale one loses and sees the current value.
    let r2 = etcd.put_if("cas/k", b"v2", r1, None).await.unwrap().unwrap();
    assert!(r2 > r1);
    let current = etcd.put_if("cas/k", b"v3", r1, None).await.unwrap().unwrap_err().unwrap();
    assert_eq!(current.mod_revision, r2);
    // Against a key that is not there: the failure carries None.
    assert_eq!(etcd.put_if("cas/absent", b"x", 5, None).await.unwrap(), Err(None));
    // Deleted keys can be created again with 0; with a lease it is attached.
    etcd.delete("cas/k").await.unwrap();
    let l = etcd.grant(30).await.unwrap();
    let r3 = etcd.put_if("cas/k", b"again", 0, Some(l)).await.unwrap().unwrap();
    let kv = etcd.get("cas/k").await.unwrap().unwrap();
    assert_eq!((kv.mod_revision, kv.create_revision, kv.version, kv.lease), (r3, r3, 1, l));

    // Two writers on the same revision, at the same time: exactly one wins.
    let other = Etcd::new(&server.url()).unwrap();
    for round in 0..10 {
        let base = etcd.get("cas/k").await.unwrap().unwrap().mod_revision;
        let (va, vb) = (format!("a{round}"), format!("b{round}"));
        let (a, b) = tokio::join!(
            etcd.put_if("cas/k", va.as_bytes(), base, None),
            other.put_if("cas/k", vb.as_bytes(), base, None),
        );
        let (won, lost, winner) = match (a.unwrap(), b.unwrap()) {
            (Ok(rev), Err(cur)) => (rev, cur, va),
            (Err(cur), Ok(rev)) => (rev, cur, vb),
            other => panic!("round {round}: {other:?}"),
        };
        let cur = lost.expect("the loser sees the key");
        assert_eq!((cur.mod_revision, cur.value), (won, winner.into_bytes()));
    }
}

#[tokio::test]
async fn watch_delivers_in_order() {
    let server = EtcdServer::start();
    let etcd = Etcd::new(&server.url()).unwrap();

    let r1 = etcd.put("w/a", b"1", None).await.unwrap();
    // From a past revision: history first.
    let mut rx = etcd.watch_prefix("w/", r1);
    let r2 = etcd.put("w/b", b"2", None).await.unwrap();
    etcd.put("x/outside", b"-", None).await.unwrap();
    etcd.put("w", b"not under w/", None).await.unwrap();
    etcd.delete("w/a").await.unwrap();
    let r3 = etcd.put("w/a", b"3", None).await.unwrap();

    let a = put_of(next_event(&mut rx).await);
    assert_eq!((a.key.as_str(), a.value.as_slice(), a.mod_revision), ("w/a", &b"1"[..], r1));
    let b = put_of(next_event(&mut rx).await);
    assert_eq!((b.key.as_str(), b.mod_revision), ("w/b", r2));
    match next_event(&mut rx).await {
        WatchEvent::Delete { key, mod_revision } => {
            assert_eq!(key, "w/a");
            assert!(mod_revision > r2 && mod_revision < r3);
        }
        other => panic!("{other:?}"),
    }
    let a = put_of(next_event(&mut rx).await);
    assert_eq!((a.value.as_slice(), a.mod_revision, a.version), (&b"3"[..], r3, 1));
    assert_quiet(&mut rx, Duration::from_millis(300)).await;

    // From now (0): only what comes after.
    let mut now = etcd.watch_prefix("w/", 0);
    sleep(Duration::from_millis(300)).await;
    let r4 = etcd.put("w/c", b"4", None).await.unwrap();
    assert_eq!(put_of(next_event(&mut now).await).mod_revision, r4);
    assert_eq!(put_of(next_event(&mut rx).await).mod_revision, r4);
    assert_quiet(&mut now, Duration::from_millis(200)).await;
}

#[tokio::test]
async fn watch_resyncs_after_compaction() {
    let server = EtcdServer::start();
    let etcd = Etcd::new(&server.url()).unwrap();

    let first = etcd.put("c/a", b"1", None).await.unwrap();
    etcd.put("c/a", b"2", None).await.unwrap();
    let last = etcd.put("c/a", b"3", None).await.unwrap();
    let answer = server.member.post("/v3/kv/compaction", &format!(r#"{{"revision":"{last}","physical":true}}"#));
    assert!(answer.contains("header"), "{answer}");

    let mut rx = etcd.watch_prefix("c/", first);
    assert_eq!(next_event(&mut rx).await, WatchEvent::Resync);
    let r = etcd.put("c/b", b"after", None).await.unwrap();
    let b = put_of(next_event(&mut rx).await);
    assert_eq!((b.key.as_str(), b.mod_revision), ("c/b", r));
    assert_quiet(&mut rx, Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_survives_an_etcd_restart() {
    let mut server = EtcdServer::start();
    let etcd = Etcd::new(&server.url()).unwrap().with_timeout(Duration::from_millis(500));

    let start = etcd.put("r/0", b"0", None).await.unwrap();
    let mut rx = etcd.watch_prefix("r/", start + 1);
    let r1 = etcd.put("r/1", b"1", None).await.unwrap();
    let r2 = etcd.put("r/2", b"2", None).await.unwrap();
    assert_eq!(put_of(next_event(&mut rx).await).mod_revision, r1);
    assert_eq!(put_of(next_event(&mut rx).await).mod_revision, r2);

    server.member.kill();
    assert!(matches!(etcd.put("r/down", b"-", None).await, Err(EtcdError::Unreachable(_))));
    // Long enough for the watch to fail a few reconnections.
    sleep(Duration::from_millis(1500)).await;
    server.member.restart();

    let r3 = etcd.put("r/3", b"3", None).await.unwrap();
    let r4 = etcd.put("r/4", b"4", None).await.unwrap();
    let kv = put_of(next_event(&mut rx).await);
    assert_eq!((kv.key.as_str(), kv.mod_revision), ("r/3", r3));
    assert_eq!(put_of(next_event(&mut rx).await).mod_revision, r4);
    assert_quiet(&mut rx, Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_fails_over_to_another_member() {
    let mut cluster = EtcdCluster::start();
    // The client starts on the leader: losing it is the harder case (the
    // others must elect a new one before they can write).
    let leader = cluster.leader();
    let etcd = Etcd::new(&cluster.url_from(leader)).unwrap();
    assert_eq!(etcd.endpoints().len(), 3);

    let r1 = etcd.put("m/1", b"1", None).await.unwrap();
    assert_eq!(etcd.get("m/1").await.unwrap().unwrap().mod_revision, r1);
    let mut rx = etcd.watch_prefix("m/", r1 + 1);
    let lease = etcd.grant(30).await.unwrap();

    let used = etcd.current_endpoint().to_string();
    assert_eq!(used, cluster.members[leader].endpoint());
    cluster.member_at(&used).kill();
    let killed_at = Instant::now();

    let r2 = etcd.put("m/2", b"2", Some(lease)).await.unwrap();
    eprintln!("the first put after the leader died took {:?}", killed_at.elapsed());
    assert!(r2 > r1);
    assert_eq!(etcd.get("m/2").await.unwrap().unwrap().value, b"2");
    assert_ne!(etcd.current_endpoint(), used);
    assert!(etcd.keep_alive(lease).await.unwrap() > 0);
    let (kvs, _) = etcd.get_prefix("m/").await.unwrap();
    assert_eq!(kvs.len(), 2);

    // The watch moved too, and misses nothing.
    let kv = put_of(next_event(&mut rx).await);
    assert_eq!((kv.key.as_str(), kv.mod_revision), ("m/2", r2));
    assert_quiet(&mut rx, Duration::from_millis(300)).await;
}

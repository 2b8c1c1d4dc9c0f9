//! The data plane over real TCP on loopback.

use bytes::Bytes;
use rand::{rngs::StdRng, Rng, SeedableRng};
use slipstream_peer::frame::{decode_head, encode, HeadDecoder, Limits};
use slipstream_peer::{
    measure_costs, serve, serve_with_config, Allocator, ClusterKey, Kind, OutTensor, Outgoing, PeerConfig, PeerError,
    Peers, ServerHandle, VecAlloc,
};
use slipstream_types::DType;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LONG: Duration = Duration::from_secs(20);

fn key() -> ClusterKey {
    ClusterKey::from_token("test-cluster-token")
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed.wrapping_mul(131)) as u8).collect()
}

fn bytes_tensor(name: &str, n: usize, seed: u64) -> OutTensor {
    OutTensor { name: name.into(), dtype: DType::Uint8, shape: vec![n as u64], data: Bytes::from(pattern(seed, n)) }
}

fn f32_tensor(name: &str, elems: usize, seed: u64) -> OutTensor {
    OutTensor {
        name: name.into(),
        dtype: DType::Float32,
        shape: vec![elems as u64],
        data: Bytes::from(pattern(seed, elems * 4)),
    }
}

async fn echo_server(threshold: usize) -> (ServerHandle, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let h = serve(l, key(), "server".into(), Arc::new(VecAlloc), threshold, |_peer, call, _| async move {
        if let Some(t) = call.tensors.iter().find(|t| t.offset % 64 != 0) {
            return Outgoing::error(format!("{} arrived at offset {}", t.name, t.offset));
        }
        Outgoing::echo(call)
    });
    (h, addr)
}

async fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_merges_small_tensors_and_sends_large_ones_without_a_copy() {
    let (server, addr) = echo_server(1024).await;
    let peers = Peers::new(key(), "client".into(), Arc::new(VecAlloc), 1024);
    // Recsys-style: many 64-byte features around two large tensors.
    let mut tensors = Vec::new();
    for i in 0..100 {
        tensors.push(f32_tensor(&format!("feat{i}"), 16, i));
    }
    tensors.push(bytes_tensor("embedding", 1 << 20, 1000));
    for i in 100..200 {
        tensors.push(f32_tensor(&format!("feat{i}"), 16, i));
    }
    tensors.push(f32_tensor("dense", 1_600_000, 2000)); // 6.4 MB
    let msg = Outgoing::call(b"{\"stage\":2}".to_vec(), tensors.clone());

    let mut reply = peers.call(addr, msg.clone(), LONG).await.unwrap();
    assert_eq!(reply.kind, Kind::Reply);
    assert_eq!(reply.meta, b"{\"stage\":2}");
    assert_eq!(reply.tensors.len(), 202);
    for (i, want) in tensors.iter().enumerate() {
        let got = reply.tensors[i].clone();
        assert_eq!(got.offset % 64, 0);
        assert_eq!((&got.name, got.dtype, &got.shape), (&want.name, want.dtype, &want.shape));
        assert!(reply.tensor_data(i).unwrap() == &want.data[..], "tensor {} differs", want.name);
    }
    let c = peers.counters();
    assert_eq!((c.frames_sent, c.tensors_sent), (1, 202));
    assert_eq!(c.merged_tensors, 200, "every small tensor copied once");
    assert_eq!(c.merge_copied_bytes, 200 * 64);
    assert_eq!(c.merged_runs, 2, "one run before the embedding, one after");
    assert_eq!(c.zero_copy_tensors, 2, "the large ones went from their own memory");
    assert!(c.bytes_sent > (1 << 20) + 6_400_000);
    assert_eq!(c.frames_received, 1);
    // The server counts its reply once its write returns, which may be
    // after the reply arrived here.
    eventually("the server's counters", || server.counters().frames_sent == 1).await;
    let s = server.counters();
    assert_eq!((s.merged_tensors, s.zero_copy_tensors, s.frames_received), (200, 2, 1));

    peers.set_merge_threshold(0);
    server.set_merge_threshold(0);
    let mut reply = peers.call(addr, msg, LONG).await.unwrap();
    for (i, want) in tensors.iter().enumerate() {
        assert!(reply.tensor_data(i).unwrap() == &want.data[..]);
    }
    let d = peers.counters();
    assert_eq!(d.merge_copied_bytes, c.merge_copied_bytes, "threshold 0: no merge copy");
    assert_eq!(d.merged_runs, c.merged_runs);
    assert_eq!(d.zero_copy_tensors - c.zero_copy_tensors, 202);
    assert_eq!(d.bytes_sent - c.bytes_sent, c.bytes_sent, "same frame bytes either way");
    assert_eq!(peers.connections(), 1);
    assert_eq!(peers.peer_id(addr).as_deref(), Some("server"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_share_one_connection_and_get_their_own_replies() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = serve(l, key(), "server".into(), Arc::new(VecAlloc), 256, |peer, call, _| async move {
        let delay = rand::random_range(0..5_000u64);
        tokio::time::sleep(Duration::from_micros(delay)).await;
        assert_eq!(peer, "client");
        let mut meta = b"re:".to_vec();
        meta.extend_from_slice(&call.meta);
        let mut data = call.payload[call.tensors[0].range()].to_vec();
        data.reverse();
        Outgoing::reply(
            meta,
            vec![OutTensor {
                name: "out".into(),
                dtype: DType::Uint8,
                shape: vec![data.len() as u64],
                data: data.into(),
            }],
        )
    });
    let peers = Peers::new(key(), "client".into(), Arc::new(VecAlloc), 256);
    let mut tasks = Vec::new();
    for task in 0..8u64 {
        let peers = peers.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..64u64 {
                let n = ((task * 64 + i) * 37 % 3000 + 1) as usize;
                let sent = pattern(task * 1000 + i, n);
                let msg = Outgoing::call(
                    format!("{task}-{i}").into_bytes(),
                    vec![OutTensor {
                        name: "in".into(),
                        dtype: DType::Uint8,
                        shape: vec![n as u64],
                        data: Bytes::from(sent.clone()),
                    }],
                );
                let mut reply = peers.call(addr, msg, LONG).await.unwrap();
                assert_eq!(reply.meta, format!("re:{task}-{i}").into_bytes());
                let mut want = sent;
                want.reverse();
                assert_eq!(reply.tensor_data(0).unwrap(), &want[..]);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(peers.connections(), 1);
    assert_eq!(server.connections(), 1, "all 512 calls on one connection");
    assert_eq!(peers.counters().frames_received, 512);
    eventually("the server's counters", || server.counters().frames_sent == 512).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_and_the_server_keeps_serving() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let count = handled.clone();
    let config = PeerConfig { handshake_timeout: Duration::from_millis(300), ..PeerConfig::default() };
    let server = serve_with_config(l, key(), "server".into(), Arc::new(VecAlloc), config, move |_, call, _| {
        count.fetch_add(1, SeqCst);
        async move { Outgoing::echo(call) }
    });

    // Another token: refused on both sides, no handler runs.
    let stranger = Peers::new(ClusterKey::from_token("wrong"), "intruder".into(), Arc::new(VecAlloc), 1024);
    let msg = Outgoing::call(b"hi".to_vec(), vec![bytes_tensor("x", 10, 1)]);
    let err = stranger.call(addr, msg.clone(), LONG).await.unwrap_err();
    assert!(matches!(err, PeerError::Refused), "{err:?}");
    eventually("the refusal to be counted", || server.refused() == 1).await;
    assert_eq!(stranger.connections(), 0);

    // Garbage instead of a hello: disconnected.
    let mut raw = TcpStream::connect(addr).await.unwrap();
    let junk: Vec<u8> = (0..200).map(|i| (i * 7) as u8).collect();
    raw.write_all(&junk).await.unwrap();
    let mut sink = [0u8; 512];
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match raw.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // the server's hello
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the server did not close a connection that sent garbage");
    eventually("the garbage to be counted", || server.refused() == 2).await;

    // Silence: closed when the handshake times out.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let start = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        while matches!(silent.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
    assert!(closed.is_ok() && start.elapsed() >= Duration::from_millis(250));
    eventually("the silent one to be counted", || server.refused() == 3).await;

    assert_eq!(handled.load(SeqCst), 0, "no handler ran for a stranger");
    let friend = Peers::new(key(), "friend".into(), Arc::new(VecAlloc), 1024);
    let mut reply = friend.call(addr, msg, LONG).await.unwrap();
    assert_eq!(reply.tensor_data(0).unwrap(), &pattern(1, 10)[..]);
    assert_eq!(handled.load(SeqCst), 1);
    assert_eq!(server.connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_fail_fast_when_the_server_dies_and_the_next_call_reconnects() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = serve(l, key(), "server".into(), Arc::new(VecAlloc), 1024, |_, call, _| async move {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Outgoing::echo(call)
    });
    let peers = Peers::new(key(), "client".into(), Arc::new(VecAlloc), 1024);
    let mut calls = Vec::new();
    for i in 0..20 {
        let peers = peers.clone();
        calls.push(tokio::spawn(async move {
            let msg = Outgoing::call(vec![], vec![bytes_tensor("x", 100 * i + 1, i as u64)]);
            peers.call(addr, msg, LONG).await
        }));
    }
    eventually("the calls to reach the server", || server.counters().frames_received == 20).await;
    let killed = Instant::now();
    server.shutdown().await;
    for c in calls {
        let err = c.await.unwrap().unwrap_err();
        assert!(matches!(err, PeerError::Disconnected(_)), "{err:?}");
    }
    assert!(killed.elapsed() < Duration::from_secs(2), "took {:?}", killed.elapsed());
    assert_eq!(peers.connections(), 0);

    // A new server on the same port: the next call reconnects.
    let l = TcpListener::bind(addr).await.unwrap();
    let _server =
        serve(l, key(), "server2".into(), Arc::new(VecAlloc), 1024, |_, call, _| async move { Outgoing::echo(call) });
    let msg = Outgoing::call(b"again".to_vec(), vec![bytes_tensor("x", 5000, 9)]);
    let mut reply = peers.call(addr, msg, LONG).await.unwrap();
    assert_eq!(reply.meta, b"again");
    assert_eq!(reply.tensor_data(0).unwrap(), &pattern(9, 5000)[..]);
    assert_eq!(peers.peer_id(addr).as_deref(), Some("server2"));
}

/// Fails while `fail` is set.
#[derive(Default)]
struct Flaky {
    fail: AtomicBool,
}

impl Allocator for Flaky {
    type Buf = Vec<u8>;
    fn alloc(&self, n: usize) -> Result<Vec<u8>, String> {
        if self.fail.load(SeqCst) {
            return Err(format!("arena full ({n} bytes wanted)"));
        }
        Ok(vec![0; n])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_failure_fails_one_call_not_the_connection() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server_alloc = Arc::new(Flaky::default());
    let handled = Arc::new(AtomicUsize::new(0));
    let count = handled.clone();
    let server = serve(l, key(), "server".into(), server_alloc.clone(), 1024, move |_, call, _| {
        count.fetch_add(1, SeqCst);
        async move { Outgoing::echo(call) }
    });
    let client_alloc = Arc::new(Flaky::default());
    let peers = Peers::new(key(), "client".into(), client_alloc.clone(), 1024);
    // Payloads larger than the read buffer, so that skipping one reads the socket.
    let msg = Outgoing::call(b"m".to_vec(), vec![bytes_tensor("a", 64, 1), bytes_tensor("b", 300_000, 2)]);

    let mut ok = peers.call(addr, msg.clone(), LONG).await.unwrap();
    assert_eq!(ok.tensor_data(1).unwrap(), &pattern(2, 300_000)[..]);

    server_alloc.fail.store(true, SeqCst);
    let err = peers.call(addr, msg.clone(), LONG).await.unwrap_err();
    match err {
        PeerError::Remote(why) => assert!(why.contains("arena full"), "{why}"),
        other => panic!("expected Remote, got {other:?}"),
    }
    assert_eq!(handled.load(SeqCst), 1, "no handler for a call that could not be received");
    server_alloc.fail.store(false, SeqCst);
    let mut ok = peers.call(addr, msg.clone(), LONG).await.unwrap();
    assert_eq!(ok.tensor_data(1).unwrap(), &pattern(2, 300_000)[..]);

    client_alloc.fail.store(true, SeqCst);
    let err = peers.call(addr, msg.clone(), LONG).await.unwrap_err();
    assert!(matches!(&err, PeerError::Alloc(why) if why.contains("arena full")), "{err:?}");
    client_alloc.fail.store(false, SeqCst);
    let mut ok = peers.call(addr, msg, LONG).await.unwrap();
    assert_eq!(ok.tensor_data(1).unwrap(), &pattern(2, 300_000)[..]);

    assert_eq!(server.connections(), 1, "the same connection throughout");
    assert_eq!(server.counters().alloc_failures, 1);
    assert_eq!(peers.counters().alloc_failures, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_call_leaves_the_connection_usable() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = serve(l, key(), "server".into(), Arc::new(VecAlloc), 1024, |_, call, _| async move {
        if call.meta == b"slow" {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Outgoing::echo(call)
    });
    let peers = Peers::new(key(), "client".into(), Arc::new(VecAlloc), 1024);
    let big = vec![bytes_tensor("x", 1 << 20, 3)];
    let start = Instant::now();
    let err = peers.call(addr, Outgoing::call(b"slow".to_vec(), big.clone()), Duration::from_millis(100)).await;
    assert!(matches!(err, Err(PeerError::Timeout)), "{err:?}");
    assert!(start.elapsed() < Duration::from_millis(250));
    let mut quick = peers.call(addr, Outgoing::call(b"quick".to_vec(), big.clone()), LONG).await.unwrap();
    assert_eq!(quick.meta, b"quick");
    // The late reply arrives, is read, and is dropped.
    eventually("the late reply", || peers.counters().frames_received == 2).await;
    let mut again = peers.call(addr, Outgoing::call(b"quick".to_vec(), big), LONG).await.unwrap();
    assert_eq!(again.tensor_data(0).unwrap(), &pattern(3, 1 << 20)[..]);
    assert_eq!(quick.tensor_data(0).unwrap(), &pattern(3, 1 << 20)[..]);
    assert_eq!(server.connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_closes_and_the_next_call_reconnects() {
    let (server, addr) = echo_server(1024).await;
    let peers = Peers::new(key(), "client".into(), Arc::new(VecAlloc), 1024);
    let msg = Outgoing::call(vec![], vec![bytes_tensor("x", 3, 3)]);
    peers.call(addr, msg.clone(), LONG).await.unwrap();
    assert_eq!(peers.connections(), 1);
    peers.forget(addr);
    assert_eq!(peers.connections(), 0);
    eventually("the server to see the close", || server.connections() == 0).await;
    peers.call(addr, msg.clone(), LONG).await.unwrap();
    assert_eq!(server.connections(), 1);
    drop(peers);
    eventually("the server to see the drop", || server.connections() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_is_an_io_error() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let peers = Peers::new(key(), "client".into(), Arc::new(VecAlloc), 1024);
    let err = peers.call(addr, Outgoing::call(vec![], vec![]), LONG).await.unwrap_err();
    assert!(matches!(err, PeerError::Io(_)), "{err:?}");
    // An outgoing message that breaks a limit is refused before sending.
    let bad = Outgoing::call(
        vec![],
        vec![OutTensor { name: "x".into(), dtype: DType::Float32, shape: vec![3], data: Bytes::from_static(b"12") }],
    );
    let err = peers.call(addr, bad, LONG).await.unwrap_err();
    assert!(matches!(&err, PeerError::BadFrame(m) if m.starts_with("not sent")), "{err:?}");
}

/// Random and mutated frames through the public decoder, whole and in
/// random pieces: never a panic, and both ways agree.
#[test]
fn decoder_fuzz_whole_and_incremental_agree() {
    let mut rng = StdRng::seed_from_u64(42);
    let limits = Limits { max_payload: 1 << 20 };
    let mut accepted = 0;
    for case in 0..3000 {
        let n = rng.random_range(0..4);
        let tensors: Vec<OutTensor> =
            (0..n).map(|i| bytes_tensor(&format!("t{i}"), rng.random_range(0..200), i)).collect();
        let msg = Outgoing { kind: Kind::Call, id: case, meta: vec![b'x'; rng.random_range(0..30)], tensors };
        let enc = encode(&msg, 100, &limits).unwrap();
        let mut f: Vec<u8> = enc.segments.iter().flat_map(|s| s.iter().copied()).collect();
        if case % 5 != 0 {
            for _ in 0..rng.random_range(1..5) {
                let i = rng.random_range(0..f.len());
                f[i] = if rng.random_bool(0.5) { rng.random() } else { 0xff };
            }
        }
        let whole = decode_head(&f, &limits);
        // The same bytes arriving in random pieces.
        let mut dec = HeadDecoder::new(limits);
        let (mut pos, mut upto) = (0, 0);
        let incremental = loop {
            if dec.is_done() {
                break Ok(dec.finish());
            }
            if upto == f.len() {
                break Ok(None);
            }
            upto = (upto + rng.random_range(1..64)).min(f.len());
            match dec.feed(&f[pos..upto]) {
                Ok(used) => pos += used,
                Err(e) => break Err(e),
            }
        };
        assert_eq!(whole, incremental, "case {case}");
        if let Ok(Some(h)) = whole {
            accepted += 1;
            assert!(h.payload_len <= limits.max_payload);
            assert!(h.tensors.iter().all(|t| t.offset % 64 == 0 && t.offset + t.nbytes <= h.payload_len));
        }
    }
    assert!(accepted >= 600, "{accepted}");
}

#[test]
fn measured_costs_are_sane() {
    let start = Instant::now();
    let c = measure_costs();
    let took = start.elapsed();
    println!("measure_costs() = {c:?} in {took:?}");
    assert!(c.per_segment_ns.is_finite() && c.per_segment_ns > 0.0);
    assert!(c.per_byte_ns.is_finite() && c.per_byte_ns > 0.0);
    assert!((64..=65536).contains(&c.merge_threshold));
    assert!(took < Duration::from_secs(1), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_answers_with_an_error() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let _server = serve(l, key(), "server".into(), Arc::new(VecAlloc), 1024, |_, call, _| async move {
        if call.meta == b"boom" {
            panic!("handler bug (expected by the test)");
        }
        Outgoing::echo(call)
    });
    let peers = Peers::new(key(), "client".into(), Arc::new(VecAlloc), 1024);
    let start = Instant::now();
    let err = peers.call(addr, Outgoing::call(b"boom".to_vec(), vec![]), LONG).await.unwrap_err();
    assert!(matches!(&err, PeerError::Remote(m) if m.contains("panicked")), "{err:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
    let reply = peers.call(addr, Outgoing::call(b"fine".to_vec(), vec![]), LONG).await.unwrap();
    assert_eq!(reply.meta, b"fine");
}

/// A call answered in parts: every part reaches the caller, in order and
/// intact, before the reply; a caller that asked for no parts gets only
/// the reply, and the connection stays in step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_answered_in_parts_gets_every_part_before_its_reply() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let _server = serve(l, key(), "server".into(), Arc::new(VecAlloc), 1024, |_, call, parts| async move {
        for i in 0..5u64 {
            // Small and large tensors: merged, and sent from their own memory.
            let sent = parts.send(vec![b'0' + i as u8], vec![bytes_tensor("p", 40 + 30_000 * i as usize, i)]).await;
            assert!(sent);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Outgoing::echo(call)
    });
    let peers = Peers::new(key(), "client".into(), Arc::new(VecAlloc), 1024);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let call = peers.call_with_parts(addr, Outgoing::call(b"whole".to_vec(), vec![]), LONG, tx);
    tokio::pin!(call);
    // The first part arrives while the handler still works on the rest.
    let first = tokio::select! {
        p = rx.recv() => p.unwrap(),
        _ = &mut call => panic!("the reply came before the first part"),
    };
    assert_eq!((first.kind, first.meta.as_slice()), (Kind::Part, b"0".as_slice()));
    let reply = call.await.unwrap();
    assert_eq!(reply.meta, b"whole");
    let mut got = vec![first];
    while let Ok(p) = rx.try_recv() {
        got.push(p);
    }
    assert_eq!(got.len(), 5, "every part is in before the reply returns");
    for (i, mut p) in got.into_iter().enumerate() {
        assert_eq!(p.meta, vec![b'0' + i as u8]);
        assert_eq!(p.tensor_data(0).unwrap(), pattern(i as u64, 40 + 30_000 * i).as_slice());
    }
    // Without asking for parts: only the reply, and the next call is fine.
    let reply = peers.call(addr, Outgoing::call(b"plain".to_vec(), vec![]), LONG).await.unwrap();
    assert_eq!(reply.meta, b"plain");
    let reply = peers.call(addr, Outgoing::call(b"again".to_vec(), vec![]), LONG).await.unwrap();
    assert_eq!(reply.meta, b"again");
}

//! Real etcd processes for the tests: one member ([`EtcdServer`]) or a
//! cluster of three ([`EtcdCluster`]), on free loopback ports with their data
//! in a temporary directory, killed when dropped. They need the `etcd`
//! binary on the PATH (Debian: `apt-get install etcd-server`).
//!
//! Members run with short heartbeats and elections (50 ms / 500 ms), so a
//! cluster elects a new leader quickly and leases can be as short as 1 s.

#![allow(dead_code)] // each test binary uses its own part

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a member may take to answer `/health` after it starts.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A loopback port nobody listens on (as of now).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("local address").port()
}

/// One etcd process: its name, ports and data directory stay the same
/// across [`Member::kill`] and [`Member::restart`].
pub struct Member {
    pub name: String,
    pub client_port: u16,
    pub peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    /// `name=http://127.0.0.1:peer,...` of the whole cluster.
    initial_cluster: String,
    token: String,
    child: Option<Child>,
}

impl Member {
    fn new(name: &str, root: &Path, client_port: u16, peer_port: u16, initial_cluster: String, token: &str) -> Member {
        Member {
            name: name.to_string(),
            client_port,
            peer_port,
            data_dir: root.join(format!("{name}.etcd")),
            log: root.join(format!("{name}.log")),
            initial_cluster,
            token: token.to_string(),
            child: None,
        }
    }

    /// `http://127.0.0.1:port`, for [`slipstream_etcd::Etcd::new`].
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// `127.0.0.1:port`, as [`slipstream_etcd::Etcd::endpoints`] names it.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "{} is running", self.name);
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open the etcd log");
        let log2 = log.try_clone().expect("clone the log file");
        let child = Command::new("etcd")
            .args(["--name", &self.name])
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster, "--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn();
        match child {
            Ok(c) => self.child = Some(c),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                panic!("etcd not found: apt-get install etcd-server")
            }
            Err(e) => panic!("cannot start etcd: {e}"),
        }
    }

    /// Waits until the member says it is healthy (it has a leader).
    pub fn wait_healthy(&mut self) {
        let until = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(body) = http(self.client_port, "GET", "/health", "") {
                if body.contains(r#""health":"true""#) {
                    return;
                }
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("etcd {} exited ({status}):\n{}", self.name, self.log_tail());
            }
            if Instant::now() > until {
                panic!("etcd {} not healthy after {START_TIMEOUT:?}:\n{}", self.name, self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same data directory and ports; returns when healthy.
    pub fn restart(&mut self) {
        self.spawn();
        self.wait_healthy();
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// A raw POST to the member's gateway (for what the client does not
    /// offer, such as compaction); the answer's body.
    pub fn post(&self, path: &str, json: &str) -> String {
        http(self.client_port, "POST", path, json).unwrap_or_else(|| panic!("POST {path} to {} failed", self.name))
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A single-member etcd.
pub struct EtcdServer {
    pub member: Member,
    _dir: tempfile::TempDir,
}

impl EtcdServer {
    pub fn start() -> EtcdServer {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (client, peer) = (free_port(), free_port());
        let cluster = format!("solo=http://127.0.0.1:{peer}");
        let mut member = Member::new("solo", dir.path(), client, peer, cluster, &format!("t{client}"));
        member.spawn();
        member.wait_healthy();
        EtcdServer { member, _dir: dir }
    }

    pub fn url(&self) -> String {
        self.member.url()
    }
}

/// A three-member etcd cluster (members `a`, `b`, `c`).
pub struct EtcdCluster {
    pub members: Vec<Member>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    pub fn start() -> EtcdCluster {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let names = ["a", "b", "c"];
        let cluster = names
            .iter()
            .zip(&ports)
            .map(|(n, (_, p))| format!("{n}=http://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let token = format!("t{}", ports[0].0);
        let mut members: Vec<Member> = names
            .iter()
            .zip(&ports)
            .map(|(n, &(c, p))| Member::new(n, dir.path(), c, p, cluster.clone(), &token))
            .collect();
        // All must be up before any can elect a leader.
        for m in &mut members {
            m.spawn();
        }
        for m in &mut members {
            m.wait_healthy();
        }
        EtcdCluster { members, _dir: dir }
    }

    /// `etcd://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3`.
    pub fn url(&self) -> String {
        let eps: Vec<String> = self.members.iter().map(Member::endpoint).collect();
        format!("etcd://{}", eps.join(","))
    }

    /// The index of the member that is the raft leader now.
    pub fn leader(&self) -> usize {
        #[derive(serde::Deserialize)]
        struct Status {
            header: Header,
            leader: String,
        }
        #[derive(serde::Deserialize)]
        struct Header {
            member_id: String,
        }
        let mut ids = Vec::new();
        let mut leader = None;
        for m in self.members.iter().filter(|m| m.is_running()) {
            let status: Status = serde_json::from_str(&m.post("/v3/maintenance/status", "{}")).expect("a status");
            ids.push(status.header.member_id);
            leader = Some(status.leader);
        }
        let leader = leader.expect("a running member");
        self.members
            .iter()
            .filter(|m| m.is_running())
            .zip(&ids)
            .find(|(_, id)| **id == leader)
            .and_then(|(m, _)| self.members.iter().position(|x| x.name == m.name))
            .expect("the leader is a member")
    }

    /// `etcd://...` with the member at `first` first (the client uses it first).
    pub fn url_from(&self, first: usize) -> String {
        let mut eps: Vec<String> = self.members.iter().map(Member::endpoint).collect();
        eps.rotate_left(first);
        format!("etcd://{}", eps.join(","))
    }

    /// The member serving at `endpoint` (`host:port`).
    pub fn member_at(&mut self, endpoint: &str) -> &mut Member {
        self.members.iter_mut().find(|m| m.endpoint() == endpoint).unwrap_or_else(|| panic!("no member at {endpoint}"))
    }
}

/// A plain HTTP/1.0 exchange with 127.0.0.1:port; the body, or None when
/// the member cannot be reached.
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    answer.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
}

//! Test support (feature `test-support`): a `redis-server` of the test's own.
//!
//! [`redis_for`] gives a test a server: its own `redis-server`, started on a free
//! loopback port with persistence off (`--save "" --appendonly no`) when the binary is on
//! `PATH`, or the server at `REDIS_URL`. When neither works the test is skipped, loudly
//! on stderr; with `REQUIRE_REDIS=1` a skip is a failure (a panic), which is how CI makes
//! sure the Redis tests really ran. A server started here is killed when its
//! [`RedisServer`] is dropped, and its directory removed.
//!
//! Tests that stop, restart or put the server to sleep need a server of their own:
//! [`own_redis_for`]. [`cluster_for`] builds a Redis Cluster of loopback servers.
//!
//! Everything here blocks (starting a process, waiting for it to answer `PING`, at most
//! a few seconds); call it before the test's runtime starts or from a blocking context.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long a server may take to answer `PING` after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A `redis-server` process of this test, on a loopback port; killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

/// The server a test talks to: its own, or the one at `REDIS_URL`.
#[derive(Debug)]
pub enum TestRedis {
    /// A server this test started (and kills when dropped).
    Own(RedisServer),
    /// The server at `REDIS_URL`, shared with other tests: use a namespace of your own.
    External(String),
}

impl TestRedis {
    /// The URL to connect to.
    #[must_use]
    pub fn url(&self) -> String {
        match self {
            TestRedis::Own(s) => s.url(),
            TestRedis::External(url) => url.clone(),
        }
    }
}

fn major_version() -> Option<u32> {
    static VERSION: OnceLock<Option<u32>> = OnceLock::new();
    *VERSION.get_or_init(|| {
        let out = Command::new("redis-server").arg("--version").output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let v = text.split_whitespace().find_map(|w| w.strip_prefix("v="))?;
        v.split('.').next()?.parse().ok()
    })
}

/// Whether a `redis-server` binary is on `PATH`.
#[must_use]
pub fn has_redis_server() -> bool {
    major_version().is_some()
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn unique_dir(port: u16) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "tower-limits-redis-{}-{port}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

impl RedisServer {
    /// Starts a standalone server on a free loopback port.
    ///
    /// # Errors
    /// No `redis-server` on `PATH`, or it did not answer `PING` in time.
    pub fn start() -> io::Result<Self> {
        Self::start_with(&[])
    }

    /// Starts a server with extra command-line arguments (`["--cluster-enabled", "yes"]`).
    ///
    /// # Errors
    /// As [`RedisServer::start`].
    pub fn start_with(extra: &[&str]) -> io::Result<Self> {
        let Some(_) = major_version() else {
            return Err(io::Error::new(io::ErrorKind::NotFound, "redis-server is not on PATH"));
        };
        let mut last = None;
        for _ in 0..5 {
            let port = free_port()?;
            let mut server = RedisServer {
                child: None,
                port,
                dir: unique_dir(port),
                extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("redis-server did not start")))
    }

    fn spawn(&mut self) -> io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--daemonize", "no", "--loglevel", "warning", "--protected-mode", "no"]);
        if major_version().is_some_and(|v| v >= 7) {
            cmd.args(["--enable-debug-command", "yes"]);
        }
        cmd.args(&self.extra).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        let mut child = cmd.spawn()?;
        let deadline = std::time::Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(reply) = command(self.port, &["PING"]) {
                if reply == "PONG" {
                    self.child = Some(child);
                    return Ok(());
                }
            }
            if let Some(status) = child.try_wait()? {
                return Err(io::Error::other(format!("redis-server exited with {status}")));
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::new(io::ErrorKind::TimedOut, "redis-server did not answer PING"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The port it listens on.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (as a crash would: nothing is saved).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port, empty.
    ///
    /// # Errors
    /// It did not answer in time.
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        self.spawn()
    }

    /// Sends one command on a fresh connection and returns the reply as text (arrays
    /// joined by newlines; errors as `Err`).
    ///
    /// # Errors
    /// The connection failed or the server answered an error.
    pub fn command(&self, args: &[&str]) -> io::Result<String> {
        command(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends one command to the server on `port` and reads its reply.
fn command(port: u16, args: &[&str]) -> io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut out = format!("*{}\r\n", args.len());
    for a in args {
        out.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    stream.write_all(out.as_bytes())?;
    read_reply(&mut BufReader::new(stream))
}

fn read_reply(r: &mut BufReader<TcpStream>) -> io::Result<String> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let line = line.trim_end_matches(['\r', '\n']);
    let (kind, rest) = line.split_at(line.len().min(1));
    match kind {
        "+" | ":" => Ok(rest.to_owned()),
        "-" => Err(io::Error::other(rest.to_owned())),
        "$" => {
            let len: i64 = rest.parse().map_err(io::Error::other)?;
            if len < 0 {
                return Ok(String::new());
            }
            let mut buf = vec![0; usize::try_from(len).unwrap_or(0) + 2];
            r.read_exact(&mut buf)?;
            buf.truncate(buf.len() - 2);
            Ok(String::from_utf8_lossy(&buf).into_owned())
        }
        "*" => {
            let n: i64 = rest.parse().map_err(io::Error::other)?;
            let items: io::Result<Vec<String>> = (0..n.max(0)).map(|_| read_reply(r)).collect();
            Ok(items?.join("\n"))
        }
        _ => Err(io::Error::other(format!("unexpected reply {line:?}"))),
    }
}

fn skip<T>(test: &str, why: &str) -> Option<T> {
    if std::env::var("REQUIRE_REDIS").is_ok_and(|v| v == "1") {
        panic!("{test}: REQUIRE_REDIS=1, but {why}");
    }
    // Straight to the process's stderr: the test harness captures `eprintln!` of passing
    // tests, and a skip must be seen.
    let _ = writeln!(
        io::stderr(),
        "\n!!!!!!!! SKIPPED {test}: {why}.\n!!!!!!!! Install redis-server or set REDIS_URL; \
         REQUIRE_REDIS=1 turns this skip into a failure.\n"
    );
    None
}

/// A server for `test`: `REDIS_URL` if set, else a `redis-server` of its own; `None`
/// (after saying so loudly) when neither is possible.
///
/// # Panics
/// Instead of skipping, when `REQUIRE_REDIS=1`.
#[must_use]
pub fn redis_for(test: &str) -> Option<TestRedis> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        if !url.is_empty() {
            return Some(TestRedis::External(url));
        }
    }
    match RedisServer::start() {
        Ok(server) => Some(TestRedis::Own(server)),
        Err(e) => skip(test, &format!("no redis-server could be started ({e}) and REDIS_URL is not set")),
    }
}

/// A `redis-server` of the test's own (for tests that stop it, restart it or put it to
/// sleep); `None` (after saying so loudly) when it cannot be started.
///
/// # Panics
/// Instead of skipping, when `REQUIRE_REDIS=1`.
#[must_use]
pub fn own_redis_for(test: &str) -> Option<RedisServer> {
    match RedisServer::start() {
        Ok(server) => Some(server),
        Err(e) => skip(test, &format!("this test needs a redis-server of its own, which could not be started ({e})")),
    }
}

/// A Redis Cluster of loopback servers, each a master owning an equal range of slots.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` servers in cluster mode, gives each a range of the 16384 slots,
    /// joins them, and waits until the cluster is up.
    ///
    /// # Errors
    /// A server did not start, or the cluster did not come up in time (for example, a
    /// `redis-server` built without cluster support).
    pub fn start(masters: usize) -> io::Result<Self> {
        let nodes = (0..masters.max(1))
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ])
            })
            .collect::<io::Result<Vec<_>>>()?;
        let per = 16384 / nodes.len();
        for (i, node) in nodes.iter().enumerate() {
            let end = if i + 1 == nodes.len() { 16384 } else { (i + 1) * per };
            let slots: Vec<String> = (i * per..end).map(|s| s.to_string()).collect();
            let mut args = vec!["CLUSTER", "ADDSLOTS"];
            args.extend(slots.iter().map(String::as_str));
            node.command(&args)?;
        }
        for node in &nodes[1..] {
            nodes[0].command(&["CLUSTER", "MEET", "127.0.0.1", &node.port().to_string()])?;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let ok = nodes.iter().all(|n| {
                n.command(&["CLUSTER", "INFO"]).is_ok_and(|info| {
                    info.contains("cluster_state:ok") && info.contains(&format!("cluster_known_nodes:{}", nodes.len()))
                })
            });
            if ok {
                return Ok(RedisCluster { nodes });
            }
            if std::time::Instant::now() > deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the cluster did not reach cluster_state:ok"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The nodes' URLs.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The servers.
    #[must_use]
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}

/// A cluster of `masters` loopback servers for `test`; `None` (after saying so loudly)
/// when it cannot be built.
///
/// # Panics
/// Instead of skipping, when `REQUIRE_REDIS=1`.
#[must_use]
pub fn cluster_for(test: &str, masters: usize) -> Option<RedisCluster> {
    match RedisCluster::start(masters) {
        Ok(cluster) => Some(cluster),
        Err(e) => skip(test, &format!("a redis cluster of {masters} masters could not be started ({e})")),
    }
}

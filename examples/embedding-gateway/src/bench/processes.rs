//! The bench's child processes (the mock, the gateway, the hop, nginx) and the CPU they
//! use.

use super::*;

/// The child processes of a run and their directory: killed and removed when dropped,
/// whether the run ends or fails.
#[derive(Debug)]
pub(super) struct Children {
    pub(super) dir: PathBuf,
    pub(super) running: Vec<(&'static str, Child)>,
}

impl Children {
    pub(super) fn new() -> Result<Self, BoxError> {
        let dir = std::env::temp_dir().join(format!("egw-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        Ok(Children { dir, running: Vec::new() })
    }

    pub(super) fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The last lines a child wrote on stderr.
    pub(super) fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.path(&format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }

    /// Spawns `command` (stderr to `<name>.log`), keeps it, and returns its pid.
    pub(super) fn spawn(&mut self, name: &'static str, mut command: Command) -> Result<u32, BoxError> {
        let log = std::fs::File::create(self.path(&format!("{name}.log")))?;
        let child = command
            .stdin(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {name} ({:?}): {e}", command.get_program()))?;
        let pid = child.id();
        self.running.push((name, child));
        Ok(pid)
    }

    /// Spawns this binary with `args`, and waits for the address it prints on stdout.
    pub(super) fn spawn_self(&mut self, name: &'static str, args: &[&str]) -> Result<(u32, SocketAddr), BoxError> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
        let mut command = Command::new(exe);
        // Warnings and errors only: no access lines, no start-up lines.
        command.args(args).env("RUST_LOG", "warn,access=off").stdout(Stdio::piped());
        let pid = self.spawn(name, command)?;
        let stdout = self.running.last_mut().and_then(|(_, c)| c.stdout.take()).ok_or("no stdout to read")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = tx.send(line);
            // Whatever else it prints must not fill the pipe.
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        let line = rx.recv_timeout(START_TIMEOUT).unwrap_or_default();
        let addr = line
            .rsplit_once("http://")
            .and_then(|(_, a)| a.trim().parse::<SocketAddr>().ok())
            .ok_or_else(|| format!("{name} printed no address ({line:?}); its stderr:\n{}", self.log_tail(name)))?;
        Ok((pid, addr))
    }

    /// Whether the child `name` has exited.
    pub(super) fn exited(&mut self, name: &str) -> bool {
        self.running.iter_mut().any(|(n, c)| *n == name && !matches!(c.try_wait(), Ok(None)))
    }

    /// Kills the child `name`, if it runs.
    pub(super) fn kill(&mut self, name: &str) {
        if let Some(i) = self.running.iter().position(|(n, _)| *n == name) {
            let (_, mut child) = self.running.remove(i);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.running {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free port on loopback (for nginx, which cannot say which one it took).
pub(super) fn free_port() -> Result<SocketAddr, BoxError> {
    let listener = StdListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// `nginx` on `PATH`, if any.
pub(super) fn find_nginx() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join("nginx")).find(|p| p.is_file())
}

/// A minimal nginx.conf: one process, no access log, a keep-alive upstream pool.
pub(super) fn nginx_conf(dir: &Path, listen: SocketAddr, upstream: SocketAddr) -> String {
    let d = dir.display();
    format!(
        "daemon off;
master_process off;
worker_processes 1;
error_log {d}/nginx-error.log warn;
pid {d}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 10000000;
    upstream mock {{
        server {upstream};
        keepalive 256;
        keepalive_requests 10000000;
    }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://mock;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
        }}
    }}
}}
"
    )
}

/// Starts nginx in front of `upstream`; `None` (and why) if it did not start.
pub(super) async fn start_nginx(children: &mut Children, upstream: SocketAddr) -> Result<(u32, SocketAddr), String> {
    let Some(nginx) = find_nginx() else { return Err("not on PATH".into()) };
    let listen = free_port().map_err(|e| e.to_string())?;
    let conf = children.path("nginx.conf");
    std::fs::write(&conf, nginx_conf(&children.dir, listen, upstream)).map_err(|e| e.to_string())?;
    let mut command = Command::new(nginx);
    command.arg("-p").arg(&children.dir).arg("-c").arg(&conf).arg("-e").arg(children.path("nginx-error.log"));
    command.stdout(Stdio::null());
    let pid = children.spawn("nginx", command).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if TcpStream::connect(listen).await.is_ok() {
            return Ok((pid, listen));
        }
        if children.exited("nginx") || Instant::now() > deadline {
            children.kill("nginx");
            let log = std::fs::read_to_string(children.path("nginx-error.log")).unwrap_or_default();
            return Err(format!("it did not start: {}{}", children.log_tail("nginx"), log.trim()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Clock ticks a second of `/proc/<pid>/stat`'s times: `getconf CLK_TCK`, or 100 (what
/// Linux reports on every architecture) if it cannot be asked.
pub(super) fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&t: &u64| t > 0)
        .unwrap_or(100)
}

/// `utime + stime` of process `pid`, in clock ticks.
pub(super) fn cpu_ticks(pid: u32) -> Result<u64, BoxError> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| format!("cannot read /proc/{pid}/stat: {e}"))?;
    // The command name, in parentheses, may hold spaces: count the fields after it.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or("/proc/<pid>/stat without a command name")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the whole line are 12th and 13th after the name (state is 3rd).
    let field = |i: usize| -> Result<u64, BoxError> {
        Ok(fields.get(i).ok_or("/proc/<pid>/stat is too short")?.parse::<u64>()?)
    };
    Ok(field(11)? + field(12)?)
}

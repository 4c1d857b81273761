//! What the server examples share: their command line, `[--serve [--port N]]` and
//! `--help`, with one-line errors that say what to do, and their `main`: serve on
//! loopback, then either keep serving or run the scripted demonstration against it.

use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;

use tokio::net::TcpListener;

/// An example server's `main`: parses the command line (`usage`, `example_port` as for
/// [`from_env`]), listens on `127.0.0.1`, spawns `serve` on the listener, then, with
/// `--serve`, prints what to try (`commands`) and serves until stopped; otherwise runs
/// `demo` against the server. Exits 0 when the demonstration found every answer as the
/// limits promise, 1 when some differed or the server failed, 2 on a bad argument.
#[allow(clippy::print_stdout)]
pub async fn run<S, SE, D, DE>(
    usage: &str,
    example_port: u16,
    serve: impl FnOnce(TcpListener) -> S,
    commands: impl FnOnce(SocketAddr),
    demo: impl FnOnce(SocketAddr) -> D,
) -> ExitCode
where
    S: Future<Output = Result<(), SE>> + Send + 'static,
    SE: Display + Send + 'static,
    D: Future<Output = Result<usize, DE>>,
    DE: Display,
{
    let args = match from_env(usage, example_port) {
        Ok(args) => args,
        Err(code) => return code,
    };
    let listener = match TcpListener::bind(("127.0.0.1", args.port)).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on 127.0.0.1:{}: {e}; choose another --port", args.port);
            return ExitCode::FAILURE;
        }
    };
    let Ok(addr) = listener.local_addr() else {
        eprintln!("error: the listener has no local address");
        return ExitCode::FAILURE;
    };
    let server = tokio::spawn(serve(listener));
    if args.serve {
        commands(addr);
        return match server.await {
            Ok(Ok(())) => ExitCode::SUCCESS,
            Ok(Err(e)) => {
                eprintln!("error: the server stopped: {e}");
                ExitCode::FAILURE
            }
            Err(e) => {
                eprintln!("error: the server task failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match demo(addr).await {
        Ok(0) => ExitCode::SUCCESS,
        Ok(n) => {
            println!("\n{n} answer(s) differed from what the limits promise");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: the demonstration could not reach its own server at {addr}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What the command line asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeArgs {
    /// Keep a server running for manual poking, instead of the scripted demonstration.
    pub serve: bool,
    /// The port to serve on; 0 lets the system choose.
    pub port: u16,
}

/// Parses `args` (without the program name). `example_port` is the port shown in the
/// error for a missing number.
///
/// # Errors
/// A message naming the argument at fault.
pub fn parse(args: impl IntoIterator<Item = String>, example_port: u16) -> Result<ServeArgs, String> {
    let mut out = ServeArgs { serve: false, port: 0 };
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--serve" => out.serve = true,
            "--port" => {
                let v = it.next().ok_or_else(|| format!("--port needs a number, for example --port {example_port}"))?;
                out.port = v.parse().map_err(|_| format!("--port {v:?} is not a port number (0 to 65535)"))?;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if out.port != 0 && !out.serve {
        return Err("--port goes with --serve (the demonstration picks its own port)".into());
    }
    Ok(out)
}

/// The process's own command line: the arguments, or the exit code after `--help`
/// (printed, success) or a bad argument (one line on stderr, code 2).
///
/// # Errors
/// The code to exit with.
#[allow(clippy::print_stdout)]
pub fn from_env(usage: &str, example_port: u16) -> Result<ServeArgs, ExitCode> {
    if std::env::args().skip(1).any(|a| a == "-h" || a == "--help") {
        println!("{usage}");
        return Err(ExitCode::SUCCESS);
    }
    parse(std::env::args().skip(1), example_port).map_err(|e| {
        eprintln!("error: {e}; {usage}");
        ExitCode::from(2)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_checked() {
        let args = |a: &[&str]| parse(a.iter().map(|s| (*s).to_owned()), 3000);
        assert!(!args(&[]).unwrap().serve);
        assert_eq!(args(&["--serve", "--port", "3000"]).unwrap(), ServeArgs { serve: true, port: 3000 });
        assert!(args(&["--serve", "--port", "http"]).unwrap_err().contains("not a port number"));
        assert!(args(&["--port"]).unwrap_err().contains("needs a number, for example --port 3000"));
        assert!(args(&["--port", "3000"]).unwrap_err().contains("goes with --serve"));
        assert!(args(&["--verbose"]).unwrap_err().contains("unknown argument \"--verbose\""));
    }
}

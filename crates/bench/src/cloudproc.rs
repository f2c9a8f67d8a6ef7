//! The benchmarks' verifier: `tandem cloud serve` as a process of its own, pinned to its cores, and
//! a netem proxy in front of it.

use std::io::{BufRead, BufReader, Lines};
use std::path::Path;
use std::process::{Child, ChildStderr, Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use tandem_client::netem::NetemConfig;
use tandem_engine::CpuSet;

/// `tandem cloud serve` on a loopback port, or in the cloud's network namespace behind the
/// project's proxy under `bench --netns` (`--no-auth` unless given `--tenants`); killed on drop.
pub struct CloudProcess {
    child: Child,
    /// Its gRPC address, and its `/metrics` address when asked for.
    pub addr: String,
    pub metrics_addr: Option<String>,
    /// The target's forward cost it measured at start-up (its `target forward:` line).
    pub forward_cost: Option<tandem_spec::capacity::ForwardCost>,
    /// Under `bench --netns`: the proxy that forwards the veth to it.
    front: Option<Child>,
}

/// The forward cost in `cloud serve`'s line `target forward: A ms for one token, B ms per token
/// past the ridge (…)`.
fn parse_forward_cost(line: &str) -> Option<tandem_spec::capacity::ForwardCost> {
    let rest = line.strip_prefix("target forward: ")?;
    let (one, rest) = rest.split_once(" ms for one token, ")?;
    let (per, _) = rest.split_once(" ms per token")?;
    Some(tandem_spec::capacity::ForwardCost {
        one_token_ms: one.trim().parse().ok()?,
        ms_per_token: per.trim().parse().ok()?,
    })
}

impl CloudProcess {
    /// Start it on `cpus` (one engine thread each; any core when empty) with `extra` flags.
    pub fn start(home: &Path, cpus: &CpuSet, extra: &[String]) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the tandem binary")?;
        // In the cloud's network namespace when the benchmark runs across namespaces (`bench
        // --netns`), on its loopback there, with the project's proxy in front of it on the
        // cloud's end of the veth (below).
        let netns = crate::netns::current();
        let mut cmd = in_namespace(netns, &exe);
        cmd.arg("--home")
            .arg(home)
            .args(["cloud", "serve"])
            // One tenant without keys, unless `extra` names a tenants file.
            .args((!extra.iter().any(|e| e == "--tenants")).then_some("--no-auth"))
            .args(["--no-ledger", "--listen", "127.0.0.1:0", "--threads"])
            .arg(cpus.len().max(1).to_string())
            .args(extra.iter().enumerate().map(|(i, e)| {
                // Its metrics, too, where the benchmark can reach them.
                match (netns, i.checked_sub(1).map(|j| &extra[j])) {
                    (Some(p), Some(flag)) if flag == "--metrics-listen" => {
                        e.replacen("127.0.0.1", &p.cloud_ip.to_string(), 1)
                    }
                    _ => e.clone(),
                }
            }))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if !cpus.is_empty() {
            cmd.args(["--cpus", &cpus.to_string()]);
        }
        let mut metrics_addr = None;
        let mut forward_cost = None;
        let (child, addr, lines) = spawn_until(
            cmd,
            "the verifier process",
            "tandem verifier listening on ",
            |line| {
                if let Some(a) = line.strip_prefix("metrics on http://") {
                    metrics_addr = a.strip_suffix("/metrics").map(str::to_string);
                }
                if let Some(c) = parse_forward_cost(line) {
                    forward_cost = Some(c);
                }
            },
        )?;
        // Keep draining its stderr so that it never blocks on a full pipe; what it logs (at the
        // level TANDEM_LOG asks for) goes on to ours.
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                eprintln!("[verifier] {line}");
            }
        });
        let mut me = Self {
            child,
            addr,
            metrics_addr,
            forward_cost,
            front: None,
        };
        if let Some(p) = netns {
            let mut cmd = in_namespace(Some(p), &exe);
            cmd.args(["netem", "--listen", &format!("{}:0", p.cloud_ip)])
                .args(["--upstream", &me.addr])
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            let (front, addr, lines) = spawn_until(cmd, "the cloud's proxy", "netem ", |_| {})?;
            me.front = Some(front);
            me.addr = addr;
            std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
        }
        Ok(me)
    }

    /// Its resident memory (VmRSS), MB.
    pub fn rss_mb(&self) -> Result<f64> {
        rss_mb_of(self.child.id())
    }

    /// The text of its `/metrics` page.
    pub fn scrape(&self) -> Result<String> {
        use std::io::{Read, Write};
        let addr = self
            .metrics_addr
            .as_ref()
            .ok_or_else(|| anyhow!("the verifier was started without --metrics-listen"))?;
        let mut c = std::net::TcpStream::connect(addr)?;
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: tandem\r\nConnection: close\r\n\r\n")?;
        let mut resp = String::new();
        c.read_to_string(&mut resp)?;
        let (_, body) = resp
            .split_once("\r\n\r\n")
            .ok_or_else(|| anyhow!("a malformed /metrics response"))?;
        Ok(body.to_string())
    }
}

impl Drop for CloudProcess {
    fn drop(&mut self) {
        for c in std::iter::once(&mut self.child).chain(self.front.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A `tandem serve` process (the edge daemon) in front of a verifier, on loopback; killed on
/// drop.
pub struct EdgeProcess {
    child: Child,
    /// Its base URL (`http://127.0.0.1:PORT`).
    pub url: String,
}

impl EdgeProcess {
    /// Start it against the verifier at `cloud` (a URL), its draft on `cpus` (any core when
    /// empty), with `extra` flags.
    pub fn start(home: &Path, cloud: &str, cpus: &CpuSet, extra: &[String]) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the tandem binary")?;
        let mut cmd = Command::new(exe);
        cmd.arg("--home")
            .arg(home)
            .args(["serve", "--listen", "127.0.0.1:0", "--cloud", cloud])
            .args(["--threads", &cpus.len().max(1).to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if !cpus.is_empty() {
            cmd.args(["--cpus", &cpus.to_string()]);
        }
        let (child, url, lines) =
            spawn_until(cmd, "tandem serve", "tandem serve listening on ", |_| {})?;
        std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
        Ok(Self { child, url })
    }

    /// Its resident memory (VmRSS), MB.
    pub fn rss_mb(&self) -> Result<f64> {
        rss_mb_of(self.child.id())
    }
}

impl Drop for EdgeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The resident memory (VmRSS) of process `pid`, MB.
fn rss_mb_of(pid: u32) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow!("no VmRSS in /proc/{pid}/status"))?;
    Ok(kb / 1024.0)
}

/// Start `cmd` (its stderr piped) and read its stderr up to the line that starts with `ready`:
/// the child, the first word after `ready` (its address), and the rest of its stderr, which the
/// caller keeps draining. `seen` hears every line before that one; a child that exits first is
/// an error that quotes them.
fn spawn_until(
    mut cmd: Command,
    what: &str,
    ready: &str,
    mut seen: impl FnMut(&str),
) -> Result<(Child, String, Lines<BufReader<ChildStderr>>)> {
    let mut child = cmd.spawn().with_context(|| format!("starting {what}"))?;
    let mut lines = BufReader::new(child.stderr.take().expect("stderr is piped")).lines();
    let mut said = String::new();
    loop {
        let Some(line) = lines.next().transpose()? else {
            let _ = child.kill();
            bail!("{what} exited before listening: {said}");
        };
        if let Some(rest) = line.strip_prefix(ready) {
            let addr = rest
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            return Ok((child, addr, lines));
        }
        seen(&line);
        said.push_str(&line);
        said.push('\n');
    }
}

/// `exe`, run in the cloud's namespace when there is one.
fn in_namespace(netns: Option<&crate::netns::Placement>, exe: &Path) -> Command {
    match netns {
        Some(p) => p.command(exe),
        None => Command::new(exe),
    }
}

/// A netem proxy in front of the verifier, on a runtime of its own.
pub struct Link {
    rt: tokio::runtime::Runtime,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Link {
    pub fn new() -> Result<Self> {
        Ok(Self {
            rt: tandem_client::runtime()?,
            task: None,
        })
    }

    /// Route a fresh loopback port to `upstream` with `rtt_ms` ± jitter; returns its URL.
    pub fn set(&mut self, upstream: &str, rtt_ms: f64, jitter_ms: f64) -> Result<String> {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        let upstream: std::net::SocketAddr = upstream.parse()?;
        let cfg = NetemConfig {
            rtt_ms,
            jitter_ms,
            seed: 7,
            ..NetemConfig::default()
        };
        let (url, task) = tandem_client::netem::spawn_front(self.rt.handle(), upstream, cfg)
            .map_err(|e| anyhow!("netem: {e}"))?;
        self.task = Some(task);
        Ok(url)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_verifiers_forward_cost_line_is_read() {
        let c = super::parse_forward_cost(
            "target forward: 31.5 ms for one token, 2.84 ms per token past the ridge (≈ 11.1 tokens)",
        )
        .unwrap();
        assert_eq!((c.one_token_ms, c.ms_per_token), (31.5, 2.84));
        assert!(super::parse_forward_cost("tandem verifier listening on 1.2.3.4:5").is_none());
    }
}

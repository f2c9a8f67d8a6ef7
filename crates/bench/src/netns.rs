//! Two hosts on one machine: network namespaces for the edge and the cloud, joined by a veth
//! pair, with the link's rate and loss from the kernel (a `tbf` queue on each end; an nftables
//! rule that drops a share of the packets each side sends, drawn by `numgen random`) and its
//! delay from the project's proxy ([`tandem_client::netem`]), since this kernel has no `netem` qdisc.
//! Real TCP between real hosts: a lost packet is retransmitted by the kernel, on its own clock.
//! Needs root, `ip` and `tc` (iproute2) and `nft` (nftables); [`unavailable`] says which is
//! missing.

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// What the kernel does to the link, in each direction.
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct KernelLink {
    /// The veth link's rate in each direction (a tbf queue), kbit/s.
    #[arg(long = "link-rate-kbit", default_value_t = DEFAULT_LINK.rate_kbit)]
    pub rate_kbit: u32,
    /// Packets each side drops as it sends them (nftables `numgen random`), %.
    #[arg(long = "link-loss-pct", default_value_t = DEFAULT_LINK.loss_pct)]
    pub loss_pct: f64,
}

/// 20 Mbit/s, no loss.
const DEFAULT_LINK: KernelLink = KernelLink {
    rate_kbit: 20_000,
    loss_pct: 0.0,
};

impl Default for KernelLink {
    fn default() -> Self {
        DEFAULT_LINK
    }
}

impl KernelLink {
    pub fn validate(&self) -> Result<()> {
        if self.rate_kbit == 0 {
            bail!("--link-rate-kbit must be at least 1");
        }
        if !(self.loss_pct.is_finite() && (0.0..50.0).contains(&self.loss_pct)) {
            bail!("--link-loss-pct must be in [0, 50), got {}", self.loss_pct);
        }
        Ok(())
    }

    /// How the README and the reports name it.
    pub fn describe(&self) -> String {
        format!(
            "network namespaces joined by veth, {} kbit/s each way (tbf), {}% loss each way (nftables)",
            self.rate_kbit, self.loss_pct
        )
    }
}

/// Why namespaces cannot be made here (None: they can).
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("network namespaces need root".into());
    }
    for (tool, package) in [("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("`{tool}` is missing (apt-get install {package})"));
        }
    }
    None
}

/// One side of the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Edge,
    Cloud,
}

/// The two namespaces and the link between them; dropped, they are deleted (with the veth).
#[derive(Debug)]
pub struct Netns {
    edge: String,
    cloud: String,
    pub edge_ip: Ipv4Addr,
    pub cloud_ip: Ipv4Addr,
    pub link: KernelLink,
}

impl Netns {
    /// Make them. `tag` (a few letters and digits) keeps concurrent sets apart; names are
    /// `tnd<tag>e` and `tnd<tag>c`, interfaces the same, the subnet 10.199.N.0/30.
    pub fn create(tag: &str, link: KernelLink) -> Result<Self> {
        link.validate()?;
        if let Some(why) = unavailable() {
            bail!("{why}");
        }
        if tag.is_empty() || tag.len() > 10 || !tag.chars().all(|c| c.is_ascii_alphanumeric()) {
            bail!("namespace tag {tag:?}: 1-10 letters and digits");
        }
        let n = tag
            .bytes()
            .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b.into()))
            % 250;
        let subnet = 1 + n as u8;
        let me = Self {
            edge: format!("tnd{tag}e"),
            cloud: format!("tnd{tag}c"),
            edge_ip: Ipv4Addr::new(10, 199, subnet, 2),
            cloud_ip: Ipv4Addr::new(10, 199, subnet, 1),
            link,
        };
        // Left over from a run that was killed: start clean.
        me.delete();
        me.set_up().inspect_err(|_| me.delete())?;
        Ok(me)
    }

    fn set_up(&self) -> Result<()> {
        let (e, c) = (&self.edge, &self.cloud);
        run(Command::new("ip").args(["netns", "add", e]))?;
        run(Command::new("ip").args(["netns", "add", c]))?;
        run(Command::new("ip").args(["link", "add", e, "type", "veth", "peer", "name", c]))?;
        for (ns, ip) in [(e, self.edge_ip), (c, self.cloud_ip)] {
            run(Command::new("ip").args(["link", "set", ns, "netns", ns]))?;
            run(Command::new("ip").args([
                "-n",
                ns,
                "addr",
                "add",
                &format!("{ip}/30"),
                "dev",
                ns,
            ]))?;
            run(Command::new("ip").args(["-n", ns, "link", "set", "lo", "up"]))?;
            run(Command::new("ip").args(["-n", ns, "link", "set", ns, "up"]))?;
            let rate = format!("{}kbit", self.link.rate_kbit);
            run(exec_in(ns, "tc").args(["qdisc", "add", "dev", ns]).args([
                "root", "tbf", "rate", &rate, "burst", "32kbit", "latency", "400ms",
            ]))?;
            if self.link.loss_pct > 0.0 {
                // Per mille, on what leaves through the veth (not the namespace's loopback).
                let per_mille = (self.link.loss_pct * 10.0).round() as u32;
                let rules = format!(
                    "table inet tandem_loss {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    oifname \"{ns}\" numgen random mod 1000 < {per_mille} counter drop\n  }}\n}}\n"
                );
                run_with_input(exec_in(ns, "nft").args(["-f", "-"]), &rules)?;
            }
        }
        Ok(())
    }

    /// `program` run inside one side's namespace.
    pub fn command(&self, side: Side, program: impl AsRef<OsStr>) -> Command {
        exec_in(self.name(side), program)
    }

    pub fn name(&self, side: Side) -> &str {
        match side {
            Side::Edge => &self.edge,
            Side::Cloud => &self.cloud,
        }
    }

    /// Packets the loss rule dropped on `side` so far (None: no rule).
    pub fn dropped(&self, side: Side) -> Option<u64> {
        let out = self
            .command(side, "nft")
            .args(["list", "table", "inet", "tandem_loss"])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let (_, after) = text.split_once("counter packets ")?;
        after.split_whitespace().next()?.parse().ok()
    }

    fn delete(&self) {
        for ns in [&self.edge, &self.cloud] {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.delete();
    }
}

/// `program` run inside the namespace `ns`.
fn exec_in(ns: &str, program: impl AsRef<OsStr>) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).arg(program);
    c
}

fn run(c: &mut Command) -> Result<()> {
    run_with_input(c, "")
}

/// Run `c` with `input` on its standard input; its error output when it fails.
fn run_with_input(c: &mut Command, input: &str) -> Result<()> {
    use std::io::Write;
    let mut child = c
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {c:?}"))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{c:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Where this process's benchmarks run when given `--netns` ([`enter`]): the verifier's
/// namespace and address.
#[derive(Debug, Clone)]
pub struct Placement {
    pub cloud: String,
    pub cloud_ip: Ipv4Addr,
}

impl Placement {
    /// `program` run inside the verifier's namespace.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        exec_in(&self.cloud, program)
    }
}

static CURRENT: std::sync::OnceLock<Placement> = std::sync::OnceLock::new();

/// Make the namespaces and move the calling thread into the edge's: call it before any other
/// thread starts (a thread inherits its creator's namespace), so that every edge, proxy and
/// client of the benchmark is there; [`crate::cloudproc::CloudProcess`] then starts the verifier
/// in the cloud's. Hold the result: dropped, the namespaces are deleted.
pub fn enter(link: KernelLink) -> Result<Netns> {
    use std::os::fd::AsRawFd;
    let ns = Netns::create(&format!("b{}", std::process::id() % 100_000), link)?;
    let path = format!("/run/netns/{}", ns.edge);
    let f = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: a valid open descriptor of a network namespace; setns changes only this thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!(
            "entering the edge's namespace: {}",
            std::io::Error::last_os_error()
        );
    }
    CURRENT
        .set(Placement {
            cloud: ns.cloud.clone(),
            cloud_ip: ns.cloud_ip,
        })
        .map_err(|_| anyhow::anyhow!("the benchmark's namespaces were entered already"))?;
    Ok(ns)
}

/// The namespaces [`enter`] made (None: the benchmark runs on loopback).
pub fn current() -> Option<&'static Placement> {
    CURRENT.get()
}
